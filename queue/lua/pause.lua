-- ARGV: prefix, id. A waiting job (queued or delayed) is paused at once: out of its
-- tenant's line, holding nothing, until resumed ({0, 'paused'}). A live attempt gets a
-- pause request ({0, state}): its dispatcher sees it at the next heartbeat and stops
-- the attempt after a checkpoint, and the job is paused when that stop is reported
-- (preempt). Paused already, or a pause asked already: {1, state}. A finished job or
-- one being cancelled: {-3, state}.
local id = ARGV[2]
local now, now_s = now_ms()
local j = jk(id)
local state, tenant, pause_req = unpack(redis.call('HMGET', j, 'state', 'tenant', 'pause_req'))
if not state then return {-1} end
if state == 'paused' then return {1, state} end
if state == 'queued' then
  remove_ready(id, tenant)
elseif state == 'delayed' then
  redis.call('ZREM', k('delayed'), id)
  redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', '-1')
elseif state == 'leased' or state == 'running' or state == 'suspect' then
  if pause_req == '1' then return {1, state} end
  redis.call('HSET', j, 'pause_req', '1')
  event(id, now_s, KIND.pause_requested, '')
  return {0, state}
else
  return {-3, state}
end
set_paused(id, tenant, now_s, '', '')
return {0, 'paused'}
