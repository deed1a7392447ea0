-- ARGV: prefix, id. {0, ahead_in_tenant, ahead_estimate} for a queued job: jobs of its
-- own tenant in front of it, plus what other active tenants get first under their weights.
local id = ARGV[2]
local j = jk(id)
local state, tenant = unpack(redis.call('HMGET', j, 'state', 'tenant'))
if not state then return {-1} end
if state ~= 'queued' then return {-3, state} end
local rank = redis.call('ZRANK', k('ready:' .. tenant), id)
local own_weight = tonumber(redis.call('HGET', k('tenant:' .. tenant), 'weight') or '1')
local ahead = rank
for _, other in ipairs(redis.call('ZRANGE', k('tenants'), 0, 63)) do
  if other ~= tenant then
    local w = tonumber(redis.call('HGET', k('tenant:' .. other), 'weight') or '1')
    local n = redis.call('ZCARD', k('ready:' .. other))
    ahead = ahead + math.min(n, math.ceil((rank + 1) * w / own_weight))
  end
end
return {0, rank, ahead}
