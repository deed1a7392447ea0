-- ARGV: prefix, pool, owner, lease_ms, request_id, scan_tenants, scan_depth, quantum_s
-- Returns {0, id, token, tenant, payload, attempts, preemptions, deadline_ms}, {1} when
-- nothing fits, {-9} for an unknown pool. Capacity, quota and fairness are charged in
-- the same step as the lease. A retried request id returns the same lease.
local pool, owner, lease_ms, req = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local scan_tenants, scan_depth, quantum = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local now = now_ms()
promote_due(now, 100)

local function lease_reply(id)
  local r = redis.call('HMGET', jk(id), 'epoch', 'tenant', 'attempts', 'preemptions', 'deadline')
  local payload = redis.call('GET', k('payload:' .. id)) or ''
  return {0, id, r[1], r[2], payload, r[3], r[4], r[5]}
end

if req ~= '' then
  local prev = redis.call('GET', k('claimreq:' .. req))
  if prev then
    local state, who = unpack(redis.call('HMGET', jk(prev), 'state', 'owner'))
    if state == 'leased' and who == owner then return lease_reply(prev) end
    return {1}
  end
end

local ph = k('pool:' .. pool)
local capacity = tonumber(redis.call('HGET', ph, 'capacity') or '-1')
if capacity < 0 then return {-9} end
local used = tonumber(redis.call('HGET', ph, 'used') or '0')
if used >= capacity then return {1} end

local function allowed(pools)
  if pools == '' then return true end
  for p in string.gmatch(pools, '[^,]+') do if p == pool then return true end end
  return false
end

local tenants = redis.call('ZRANGE', k('tenants'), 0, scan_tenants - 1, 'WITHSCORES')
for i = 1, #tenants, 2 do
  local tenant, vt = tenants[i], tonumber(tenants[i + 1])
  local th = k('tenant:' .. tenant)
  local weight, max_running, running = unpack(redis.call('HMGET', th, 'weight', 'max_running', 'running'))
  weight = tonumber(weight or '1')
  max_running = tonumber(max_running or '-1')
  running = tonumber(running or '0')
  local heads = redis.call('ZRANGE', k('ready:' .. tenant), 0, scan_depth - 1)
  for _, id in ipairs(heads) do
    local pools, gpus, est = unpack(redis.call('HMGET', jk(id), 'pools', 'gpus', 'est_s'))
    gpus = tonumber(gpus)
    if allowed(pools) and used + gpus <= capacity
       and (max_running < 0 or running + gpus <= max_running) then
      remove_ready(id, tenant)
      local token = redis.call('INCR', k('fence'))
      local deadline = now + lease_ms
      redis.call('HSET', jk(id), 'state', 'leased', 'epoch', token, 'owner', owner,
        'deadline', deadline, 'pool', pool, 'cancel_req', 0)
      redis.call('ZADD', k('leases'), deadline, id)
      redis.call('HINCRBY', ph, 'used', gpus)
      redis.call('HINCRBY', th, 'running', gpus)
      -- Weighted fair queueing on GPU-time: charge the tenant's virtual time.
      local vclock = tonumber(redis.call('GET', k('vclock')) or '0')
      if vt > vclock then redis.call('SET', k('vclock'), vt) end
      est = tonumber(est)
      if est <= 0 then est = quantum end
      local next_vt = vt + gpus * est / weight
      redis.call('HSET', th, 'vtime', next_vt)
      if redis.call('ZSCORE', k('tenants'), tenant) then
        redis.call('ZADD', k('tenants'), next_vt, tenant)
      end
      if req ~= '' then redis.call('SET', k('claimreq:' .. req), id, 'PX', 300000) end
      event(id, now, 'leased', pool)
      return lease_reply(id)
    end
  end
end
return {1}
