-- ARGV: prefix, pool, owner, lease_ms, request_id, scan_tenants, scan_depth, quantum_s,
-- and optionally start ('1': the attempt is running at once, as if started).
-- Returns {0, id, token, tenant, payload, attempts, preemptions, deadline_ms}, {1} when
-- nothing fits, {-9} for an unknown pool. Capacity, quota and fairness are charged in
-- the same step as the lease. A retried request id returns the same lease.
local pool, owner, lease_ms, req = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local scan_tenants, scan_depth, quantum = num(ARGV[6]), num(ARGV[7]), ARGV[8]
local start = ARGV[9] == '1'
local now, now_s = now_ms()
promote_due(now_s, '100')

if req ~= '' then
  local prev = redis.call('GET', k('claimreq:' .. req))
  if prev then
    local state, who = unpack(redis.call('HMGET', jk(prev), 'state', 'owner'))
    if (state == 'leased' or (start and state == 'running')) and who == owner then
      local r = redis.call('HMGET', jk(prev), 'epoch', 'tenant', 'attempts', 'preemptions', 'deadline')
      local payload = redis.call('GET', k('payload:' .. prev)) or ''
      return {0, prev, r[1], r[2], payload, r[3] or '0', r[4] or '0', r[5]}
    end
    return {1}
  end
end

local p = load_pool(pool)
if p.capacity < 0 then return {-9} end
local reply = claim_next(now, now_s, p, owner, lease_ms, scan_tenants, scan_depth, quantum, start)
if not reply then return {1} end
save_pool(p)
if req ~= '' then redis.call('SET', k('claimreq:' .. req), reply[2], 'PX', '300000') end
return reply
