-- ARGV: prefix, id, token, stop, reason[, pools, why]. The attempt stopped before the
-- end: requeue keeping the job's place in line, without spending its retry budget.
-- `stop` is a STOP code (who stopped it: the platform, a shutdown, a restart), or ''
-- when the attempt never got a node (the pool had no capacity): the same requeue, but
-- no preemption (an `unplaced` event, the preemption count unchanged). With `pools`
-- (comma-separated), the job may from now on run only there (placement moved it on),
-- and a `moved` event says `why`. A job whose tenant asked for a pause is paused instead
-- (not counted as a preemption): the stop was the pause taking effect.
local id, token, stop, reason, pools, why = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local now, now_s = now_ms()
local j = jk(id)
local s, _, pausing = holds(j, token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s} end
release(id)
local tenant, prio, rank = unpack(redis.call('HMGET', j, 'tenant', 'prio', 'rank_ms'))
if stop ~= '' then known(STOP, stop, 'stop') end
if pools and pools ~= '' then redis.call('HSET', j, 'pools', pools) end
if pausing then
  set_paused(id, tenant, now_s, reason, '')
  return {0}
end
redis.call('HSET', j, 'state', 'queued')
if stop == '' then
  event(id, now_s, KIND.unplaced, reason)
else
  redis.call('HINCRBY', j, 'preemptions', '1')
  event(id, now_s, KIND.preempted, reason, event_field('stop', stop))
end
if pools and pools ~= '' then event(id, now_s, KIND.moved, why or '') end
add_ready(id, tenant, tonumber(rank), tonumber(prio))
return {0}
