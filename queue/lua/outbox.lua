-- ARGV: prefix, op, then per op:
--   due limit / ack member tenant / retry member tenant delay_ms / hand member tenant /
--   sends tenants per_tenant.
-- Two stages, both durable until acknowledged, so a crashed process loses nothing:
-- - 'outbox' (one sorted set, scored by due time): finished jobs whose outcome is not
--   filed yet. op 'due': up to `limit` of them whose time has come, oldest first.
-- - the send queue (one sorted set per tenant, 'sendq:<tenant>', and an index of the
--   tenants scored by each one's earliest due time): webhooks waiting to be sent.
--   op 'hand' moves a delivery from the outbox into its tenant's send queue, due now.
--   op 'sends': the tenants whose time has come (at most `tenants`, earliest first)
--   and, for each, at most `per_tenant` due deliveries, oldest first, so one tenant's
--   backlog cannot hide another tenant's deliveries.
-- op 'ack': the delivery `member` is done (wherever it waits). op 'retry': try it again
-- after delay_ms.
local op = ARGV[2]
local now, now_s = now_ms()
local function sendq(tenant) return k('sendq:' .. tenant) end
local senders = k('sendq_tenants')
-- Scores the tenant in the index by its earliest delivery; drops it when it has none.
local function reindex(tenant)
  local first = redis.call('ZRANGE', sendq(tenant), '0', '0', 'WITHSCORES')
  if first[1] then
    redis.call('ZADD', senders, first[2], tenant)
  else
    redis.call('ZREM', senders, tenant)
  end
end
if op == 'due' then
  return redis.call('ZRANGEBYSCORE', k('outbox'), '-inf', now_s, 'WITHSCORES', 'LIMIT', '0', ARGV[3])
elseif op == 'ack' then
  local member, tenant = ARGV[3], ARGV[4]
  local removed = redis.call('ZREM', k('outbox'), member)
  if redis.call('ZREM', sendq(tenant), member) == 1 then
    reindex(tenant)
    removed = 1
  end
  return removed
elseif op == 'retry' then
  local member, tenant = ARGV[3], ARGV[4]
  local at = str(now + tonumber(ARGV[5]))
  if redis.call('ZSCORE', sendq(tenant), member) then
    redis.call('ZADD', sendq(tenant), at, member)
    reindex(tenant)
    return 1
  end
  return redis.call('ZADD', k('outbox'), 'XX', at, member)
elseif op == 'hand' then
  local member, tenant = ARGV[3], ARGV[4]
  if redis.call('ZREM', k('outbox'), member) == 0 then return 0 end
  redis.call('ZADD', sendq(tenant), now_s, member)
  reindex(tenant)
  return 1
elseif op == 'sends' then
  local out = {}
  local tenants = redis.call('ZRANGEBYSCORE', senders, '-inf', now_s, 'LIMIT', '0', ARGV[3])
  for _, tenant in ipairs(tenants) do
    local due = redis.call('ZRANGEBYSCORE', sendq(tenant), '-inf', now_s, 'WITHSCORES', 'LIMIT', '0', ARGV[4])
    for i = 1, #due do out[#out + 1] = due[i] end
  end
  return out
end
return redis.error_reply('unknown outbox op ' .. op)
