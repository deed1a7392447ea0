-- ARGV: prefix, id, token, lease_ms. Confirms the attempt is running: leased -> running.
local id, token, lease_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
-- A repeat (after a lost reply) only renews the lease.
local s, state = holds(jk(id), token, {'leased', 'running'})
if s ~= 0 then return {s} end
local deadline = now + lease_ms
if state == 'running' then
  redis.call('HSET', jk(id), 'deadline', deadline)
else
  redis.call('HSET', jk(id), 'state', 'running', 'deadline', deadline, 'started_ms', now)
  event(id, now, 'started', '')
end
redis.call('ZADD', k('leases'), deadline, id)
return {0, deadline}
