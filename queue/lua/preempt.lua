-- ARGV: prefix, id, token, reason[, pools, why]. The attempt's machine was taken away
-- (spot loss, drain): requeue keeping the job's place in line, without spending its
-- retry budget. With `pools` (comma-separated), the job may from now on run only there
-- (placement moved it on: repeated preemptions on one pool), and a `moved` event says
-- `why`.
local id, token, reason, pools, why = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local now, now_s = now_ms()
local j = jk(id)
local s = holds(j, token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s} end
release(id)
redis.call('HINCRBY', j, 'preemptions', '1')
redis.call('HSET', j, 'state', 'queued')
event(id, now_s, 'preempted', reason)
if pools and pools ~= '' then
  redis.call('HSET', j, 'pools', pools)
  event(id, now_s, 'moved', why or '')
end
local tenant, prio, rank = unpack(redis.call('HMGET', j, 'tenant', 'prio', 'rank_ms'))
add_ready(id, tenant, tonumber(rank), tonumber(prio))
return {0}
