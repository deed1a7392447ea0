-- ARGV: prefix, id, token, lease_ms, progress_json ('' for none).
-- Extends the lease (a suspect attempt that reports in is running again) and returns
-- {0, deadline}. A stale token gets -6: that attempt must stop.
local id, token, lease_ms, progress = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local now, now_s = now_ms()
local s, state = holds(jk(id), token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s} end
local deadline = now + lease_ms
local deadline_s = str(deadline)
local next_state = state
if state == 'suspect' then
  next_state = 'running'
  redis.call('ZREM', k('suspect'), id)
  event(id, now_s, 'lease_recovered', '')
end
if progress ~= '' then
  redis.call('HSET', jk(id), 'state', next_state, 'deadline', deadline_s, 'progress', progress)
else
  redis.call('HSET', jk(id), 'state', next_state, 'deadline', deadline_s)
end
redis.call('ZADD', k('leases'), deadline_s, id)
return {0, deadline}
