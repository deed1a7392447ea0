-- ARGV: prefix, idem_key, idem_ttl_ms, tenant, prio, pools, gpus, est_s, max_attempts, payload, notify
-- Returns {0, id} for a new job, {1, id} for a duplicate idempotency key, {-7} over quota.
local idem, idem_ttl, tenant = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local prio, pools, gpus, est_s, max_attempts, payload =
  tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10]
local now = now_ms()
if idem ~= '' then
  local existing = redis.call('GET', k('idem:' .. tenant .. ':' .. idem))
  if existing then return {1, existing} end
end
local th = k('tenant:' .. tenant)
local max_waiting = tonumber(redis.call('HGET', th, 'max_waiting') or '-1')
if max_waiting >= 0 and tonumber(redis.call('HGET', th, 'waiting') or '0') >= max_waiting then
  return {-7}
end
local id = string.format('j%012d', redis.call('INCR', k('seq')))
if idem ~= '' then
  redis.call('SET', k('idem:' .. tenant .. ':' .. idem), id, 'PX', idem_ttl)
end
redis.call('HSET', jk(id), 'tenant', tenant, 'prio', prio, 'pools', pools, 'gpus', gpus,
  'est_s', est_s, 'max_attempts', max_attempts, 'state', 'queued',
  'enq_ms', now, 'rank_ms', now, 'attempts', 0, 'preemptions', 0, 'stalls', 0, 'epoch', 0,
  'event_seq', 0, 'idem', idem, 'notify', ARGV[11])
-- The payload has its own key so the job hash stays small enough for Redis's compact
-- (listpack) encoding.
redis.call('SET', k('payload:' .. id), payload)
add_ready(id, tenant, now, prio)
event(id, now, 'queued', '')
return {0, id}
