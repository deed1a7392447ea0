-- ARGV: prefix, id, token, lease_ms. Confirms the attempt is running: leased -> running.
local id, token, lease_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])
local now, now_s = now_ms()
-- A repeat (after a lost reply) only renews the lease.
local s, state = holds(jk(id), token, {'leased', 'running'})
if s ~= 0 then return {s} end
local deadline = now + lease_ms
local deadline_s = str(deadline)
if state == 'running' then
  redis.call('HSET', jk(id), 'deadline', deadline_s)
else
  redis.call('HSET', jk(id), 'state', 'running', 'deadline', deadline_s, 'started_ms', now_s)
  event(id, now_s, KIND.started, '')
end
redis.call('ZADD', k('leases'), deadline_s, id)
return {0, deadline}
