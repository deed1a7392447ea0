-- ARGV: prefix, id, token, result_json. The attempt succeeded.
local id, token, result = ARGV[2], ARGV[3], ARGV[4]
local now = now_ms()
local s = holds(jk(id), token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s} end
release(id)
redis.call('HSET', jk(id), 'result', result)
event(id, now, 'succeeded', '')
finish(id, now, 'succeeded', 'done')
trim(now, 4)
return {0}
