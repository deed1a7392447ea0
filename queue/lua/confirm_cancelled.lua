-- ARGV: prefix, id. The cancelled attempt is confirmed gone: release its capacity.
local id = ARGV[2]
local now, now_s = now_ms()
local state = redis.call('HGET', jk(id), 'state')
if not state then return {-1} end
if state ~= 'cancel_requested' then return {-3, state} end
release(id)
redis.call('SREM', k('cancelling'), id)
event(id, now_s, KIND.cancelled, '')
finish(id, now_s, 'cancelled', 'done')
return {0}
