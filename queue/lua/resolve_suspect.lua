-- ARGV: prefix, id, epoch, verdict ('adopt' | 'requeue'), lease_ms, max_stalls, reason
-- (what the job's error says when it fails as lost).
-- adopt: the attempt is alive, it runs on. requeue: it is gone; the job goes back to
-- its place in line (stalls + 1), or fails once it stalled max_stalls times; a job
-- with a pause pending is paused instead of put back in line.
local id, epoch, verdict, lease_ms, max_stalls = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local reason = ARGV[7] or ''
local now, now_s = now_ms()
local j = jk(id)
local s, _, pausing = holds(j, epoch, {'suspect'})
if s ~= 0 then return {s} end
if verdict == 'adopt' then
  local deadline = str(now + lease_ms)
  redis.call('ZREM', k('suspect'), id)
  redis.call('HSET', j, 'state', 'running', 'deadline', deadline)
  redis.call('ZADD', k('leases'), deadline, id)
  event(id, now_s, KIND.adopted, '')
  return {0, 'running'}
end
release(id)
local stalls = redis.call('HINCRBY', j, 'stalls', '1')
if stalls >= max_stalls then
  redis.call('HSET', j, 'error', reason, 'failure', FAILURE.job_lost)
  event(id, now_s, KIND.failed, reason, event_field('failure', FAILURE.job_lost))
  finish(id, now_s, 'failed', 'dead')
  return {0, 'failed'}
end
-- A new epoch fences the lost attempt should it ever report back.
redis.call('HSET', j, 'epoch', str(redis.call('INCR', k('fence'))))
local tenant, prio, rank = unpack(redis.call('HMGET', j, 'tenant', 'prio', 'rank_ms'))
if pausing then
  set_paused(id, tenant, now_s, reason, '')
  return {0, 'paused'}
end
redis.call('HSET', j, 'state', 'queued')
add_ready(id, tenant, tonumber(rank), tonumber(prio))
event(id, now_s, KIND.requeued, '')
return {0, 'queued'}
