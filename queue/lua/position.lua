-- ARGV: prefix, id. {0, ahead_in_tenant, ahead, estimated_start_ms or -1} for a queued
-- job: jobs of its own tenant in front of it, plus what other active tenants get first
-- under their weights; the start estimate spreads those over the capacity of the pools
-- the job may use, at their average run time (unknown until one job has finished).
local id = ARGV[2]
local now = now_ms()
local j = jk(id)
local state, tenant, pools = unpack(redis.call('HMGET', j, 'state', 'tenant', 'pools'))
pools = pools or ''
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
local names = {}
if pools == '' then
  names = redis.call('SMEMBERS', k('pools'))
else
  for p in string.gmatch(pools, '[^,]+') do table.insert(names, p) end
end
local capacity, weighted, known = 0, 0, 0
for _, p in ipairs(names) do
  local cap, avg = unpack(redis.call('HMGET', k('pool:' .. p), 'capacity', 'avg_run_ms'))
  if cap and avg then
    capacity = capacity + tonumber(cap)
    weighted = weighted + tonumber(cap) * tonumber(avg)
    known = known + 1
  end
end
local eta = -1
if known > 0 and capacity > 0 then
  local avg = weighted / capacity
  -- Everyone ahead runs in waves of `capacity`; this job starts after the waves before it.
  eta = now + math.floor(math.floor(ahead / capacity) * avg)
end
return {0, rank, ahead, eta}
