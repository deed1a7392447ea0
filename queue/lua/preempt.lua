-- ARGV: prefix, id, token, reason. The attempt's machine was taken away (spot loss,
-- drain): requeue keeping the job's place in line, without spending its retry budget.
local id, token, reason = ARGV[2], ARGV[3], ARGV[4]
local now, now_s = now_ms()
local j = jk(id)
local s = holds(j, token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s} end
release(id)
redis.call('HINCRBY', j, 'preemptions', '1')
redis.call('HSET', j, 'state', 'queued')
local tenant, prio, rank = unpack(redis.call('HMGET', j, 'tenant', 'prio', 'rank_ms'))
add_ready(id, tenant, tonumber(rank), tonumber(prio))
event(id, now_s, 'preempted', reason)
return {0}
