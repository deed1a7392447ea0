-- ARGV: prefix, id, token, lease_ms. Confirms the attempt is running: leased -> running.
local id, token, lease_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local s = holds(jk(id), token, {'leased', 'running'})
if s ~= 0 then return {s} end
local deadline = now + lease_ms
redis.call('HSET', jk(id), 'state', 'running', 'deadline', deadline, 'started_ms', now)
redis.call('ZADD', k('leases'), deadline, id)
event(id, now, 'started', '')
return {0, deadline}
