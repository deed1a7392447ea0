-- ARGV: prefix, id, token, result_json, pool, owner, lease_ms, scan_tenants, scan_depth,
-- quantum_s. Completes the attempt (as complete.lua), then claims the next job for the
-- same worker and starts it (as claim.lua with start), so a busy worker makes one call
-- per job. Returns the claim's reply ({0, lease...} or {1} when nothing fits), or,
-- with nothing changed, {-9} for an unknown pool or the completion's failure status.
local pool, owner, lease_ms = ARGV[5], ARGV[6], ARGV[7]
local scan_tenants, scan_depth, quantum = num(ARGV[8]), num(ARGV[9]), ARGV[10]
local now, now_s = now_ms()
local p = load_pool(pool)
if p.capacity < 0 then return {-9} end
local s, state = complete_job(now, now_s, ARGV[2], ARGV[3], ARGV[4], p)
if s ~= 0 then return {s, state} end
promote_due(now_s, '100')
local reply = claim_next(now, now_s, p, owner, lease_ms, scan_tenants, scan_depth, quantum, true)
save_pool(p)
return reply or {1}
