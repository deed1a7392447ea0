-- ARGV: prefix, id. Queued, delayed or paused jobs are cancelled at once ({0, 'cancelled'}).
-- A live attempt gets a cancel request: its token is revoked, and its capacity stays
-- held until confirm_cancelled ({0, 'cancel_requested'}). Finished jobs: {1, state}.
local id = ARGV[2]
local now, now_s = now_ms()
local j = jk(id)
local state, tenant = unpack(redis.call('HMGET', j, 'state', 'tenant'))
if not state then return {-1} end
if state == 'queued' then
  remove_ready(id, tenant)
elseif state == 'paused' then
  redis.call('HINCRBY', k('tenant:' .. tenant), 'paused', '-1')
elseif state == 'delayed' then
  redis.call('ZREM', k('delayed'), id)
  redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', '-1')
elseif state == 'leased' or state == 'running' or state == 'suspect' then
  local token = redis.call('INCR', k('fence'))
  redis.call('HSET', j, 'state', 'cancel_requested', 'cancel_req', '1', 'epoch', str(token))
  redis.call('HDEL', j, 'pause_req')
  redis.call('ZREM', k('leases'), id)
  redis.call('ZREM', k('suspect'), id)
  redis.call('SADD', k('cancelling'), id)
  event(id, now_s, KIND.cancel_requested, '')
  return {0, 'cancel_requested'}
else
  return {1, state}
end
event(id, now_s, KIND.cancelled, '')
finish(id, now_s, 'cancelled', 'done')
return {0, 'cancelled'}
