-- ARGV: prefix, id, token, result_json. The attempt succeeded.
local id, token, result = ARGV[2], ARGV[3], ARGV[4]
local now = now_ms()
local s = holds(jk(id), token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s} end
-- Keep a moving average of run times per pool: queued jobs' estimated start uses it.
local pool, started = unpack(redis.call('HMGET', jk(id), 'pool', 'started_ms'))
if pool and started then
  local ph = k('pool:' .. pool)
  local took = now - tonumber(started)
  local avg = tonumber(redis.call('HGET', ph, 'avg_run_ms') or '-1')
  if avg < 0 then avg = took else avg = 0.8 * avg + 0.2 * took end
  redis.call('HSET', ph, 'avg_run_ms', math.floor(avg))
end
release(id)
redis.call('HSET', jk(id), 'result', result)
event(id, now, 'succeeded', '')
finish(id, now, 'succeeded', 'done')
trim(now, 4)
return {0}
