-- ARGV: prefix, id, epoch, verdict ('adopt' | 'requeue'), lease_ms, max_stalls.
-- adopt: the attempt is alive, it runs on. requeue: it is gone; the job goes back to
-- its place in line (stalls + 1), or fails once it stalled max_stalls times.
local id, epoch, verdict, lease_ms, max_stalls = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local now, now_s = now_ms()
local j = jk(id)
local s = holds(j, epoch, {'suspect'})
if s ~= 0 then return {s} end
if verdict == 'adopt' then
  local deadline = str(now + lease_ms)
  redis.call('ZREM', k('suspect'), id)
  redis.call('HSET', j, 'state', 'running', 'deadline', deadline)
  redis.call('ZADD', k('leases'), deadline, id)
  event(id, now_s, 'adopted', '')
  return {0, 'running'}
end
release(id)
local stalls = redis.call('HINCRBY', j, 'stalls', '1')
if stalls >= max_stalls then
  redis.call('HSET', j, 'error', 'stalled ' .. stalls .. ' times')
  redis.call('HDEL', j, 'failure')
  event(id, now_s, 'failed', 'stalled ' .. stalls .. ' times')
  finish(id, now_s, 'failed', 'dead')
  return {0, 'failed'}
end
-- A new epoch fences the lost attempt should it ever report back.
redis.call('HSET', j, 'state', 'queued', 'epoch', str(redis.call('INCR', k('fence'))))
local tenant, prio, rank = unpack(redis.call('HMGET', j, 'tenant', 'prio', 'rank_ms'))
add_ready(id, tenant, tonumber(rank), tonumber(prio))
event(id, now_s, 'requeued', 'attempt lost')
return {0, 'queued'}
