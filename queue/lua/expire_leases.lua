-- ARGV: prefix, batch. Leases past their deadline make their job suspect. Nothing is
-- re-dispatched here: the dispatcher decides (adopt the attempt, or requeue it).
local batch = ARGV[2]
local now, now_s = now_ms()
local expired = redis.call('ZRANGEBYSCORE', k('leases'), '-inf', str(now - 1), 'LIMIT', '0', batch)
for _, id in ipairs(expired) do
  redis.call('ZREM', k('leases'), id)
  redis.call('HSET', jk(id), 'state', 'suspect')
  redis.call('ZADD', k('suspect'), now_s, id)
  event(id, now_s, KIND.lease_expired, '')
end
return expired
