-- Shared by every tuneq queue script. KEYS[1] is the domain's meta hash
-- ("tq:{D}:meta"), which routes the call to the domain's slot on Redis Cluster;
-- ARGV[1] is the key prefix ("tq:{D}:"), so every key a script touches shares the
-- {D} hash tag. Status codes: 0 ok, 1 nothing to do / duplicate, -1 missing job,
-- -3 wrong state, -6 stale token, -7 over quota or capacity, -9 unknown pool.
local P = ARGV[1]
local META = KEYS[1]
local function k(s) return P .. s end
local function jk(id) return P .. 'job:' .. id end

-- Settings stored in the meta hash, read once per script by now_ms().
local CFG = {}

-- Milliseconds from Redis TIME, plus the test clock offset, never going backwards.
-- Also loads the domain's settings into CFG (one HMGET for both).
local function now_ms()
  local m = redis.call('HMGET', META, 'clock_offset', 'clock', 'max_events_per_job',
    'aging_horizon_ms', 'retention_ms', 'retention_count')
  CFG.max_events = tonumber(m[3] or '200')
  CFG.horizon = tonumber(m[4] or '7200000')
  CFG.retention_ms = tonumber(m[5] or '604800000')
  CFG.retention_count = tonumber(m[6] or '100000')
  local t = redis.call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(m[1] or '0')
  local hwm = tonumber(m[2] or '0')
  if ms < hwm then return hwm end
  if ms > hwm then redis.call('HSET', META, 'clock', ms) end
  return ms
end

-- Appends one event to the job's log (capped), numbered by the job's event_seq.
local function event(id, now, kind, message)
  local seq = redis.call('HINCRBY', jk(id), 'event_seq', 1)
  local key = k('events:' .. id)
  local n = redis.call('RPUSH', key, cjson.encode({seq = seq, at_ms = now, kind = kind, message = message}))
  if n > CFG.max_events then redis.call('LTRIM', key, -CFG.max_events, -1) end
end

-- Puts a job in its tenant's ready set (aged score: rank + (9 - prio) * horizon;
-- ties fall back to the zero-padded id, i.e. FIFO) and activates the tenant, which
-- starts no earlier than the global virtual clock (idle tenants bank no credit).
local function add_ready(id, tenant, rank_ms, prio)
  redis.call('ZADD', k('ready:' .. tenant), rank_ms + (9 - prio) * CFG.horizon, id)
  redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', 1)
  if not redis.call('ZSCORE', k('tenants'), tenant) then
    local vt = tonumber(redis.call('HGET', k('tenant:' .. tenant), 'vtime') or '0')
    local vclock = tonumber(redis.call('GET', k('vclock')) or '0')
    if vt < vclock then vt = vclock end
    redis.call('HSET', k('tenant:' .. tenant), 'vtime', vt)
    redis.call('ZADD', k('tenants'), vt, tenant)
  end
end

-- Takes a job out of its tenant's ready set; deactivates the tenant when it empties.
local function remove_ready(id, tenant)
  local ready = k('ready:' .. tenant)
  if redis.call('ZREM', ready, id) == 1 then
    redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', -1)
  end
  if redis.call('ZCARD', ready) == 0 then redis.call('ZREM', k('tenants'), tenant) end
end

-- Gives back the capacity a lease reserved and forgets the lease.
local function release(id)
  local j = jk(id)
  local pool, gpus, tenant = unpack(redis.call('HMGET', j, 'pool', 'gpus', 'tenant'))
  if pool and pool ~= '' then
    redis.call('HINCRBY', k('pool:' .. pool), 'used', -tonumber(gpus))
    redis.call('HINCRBY', k('tenant:' .. tenant), 'running', -tonumber(gpus))
  end
  redis.call('HDEL', j, 'pool', 'owner', 'deadline')
  redis.call('ZREM', k('leases'), id)
  redis.call('ZREM', k('suspect'), id)
end

-- Moves up to `batch` delayed jobs whose retry time has come back to ready.
local function promote_due(now, batch)
  local due = redis.call('ZRANGEBYSCORE', k('delayed'), '-inf', now, 'LIMIT', 0, batch)
  for _, id in ipairs(due) do
    redis.call('ZREM', k('delayed'), id)
    local tenant, prio, rank = unpack(redis.call('HMGET', jk(id), 'tenant', 'prio', 'rank_ms'))
    redis.call('HSET', jk(id), 'state', 'queued')
    redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', -1)
    add_ready(id, tenant, tonumber(rank), tonumber(prio))
  end
end

-- Deletes everything a job owns.
local function forget(id)
  redis.call('DEL', jk(id), k('payload:' .. id), k('events:' .. id))
end

-- Marks a job finished and files it for retention; with a retention count of 0 it
-- is deleted at once (like BullMQ's removeOnComplete).
local function finish(id, now, state, index)
  -- Jobs that asked to be notified get an outbox entry (the webhook sender's work
  -- list), carrying what the notice needs even if retention deletes the job first.
  local notify, tenant = unpack(redis.call('HMGET', jk(id), 'notify', 'tenant'))
  if notify == '1' then
    redis.call('ZADD', k('outbox'), now, id .. '|' .. state .. '|' .. tenant)
  end
  if CFG.retention_count <= 0 then
    forget(id)
    return
  end
  redis.call('HSET', jk(id), 'state', state, 'finished_ms', now)
  redis.call('ZADD', k(index), now, id)
end

-- Deletes finished jobs older than the retention age or beyond the retention count,
-- at most `batch` per call, so memory stays bounded without long-running scripts.
local function trim(now, batch)
  local removed = 0
  for _, index in ipairs({'done', 'dead'}) do
    local key = k(index)
    local count = redis.call('ZCARD', key)
    if count > 0 then
      local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
      local excess = count - CFG.retention_count
      if excess > 0 or tonumber(oldest[2]) < now - CFG.retention_ms then
        local old = redis.call('ZRANGEBYSCORE', key, '-inf', now - CFG.retention_ms, 'LIMIT', 0, batch)
        excess = excess - #old
        if excess > 0 then
          local more = redis.call('ZRANGE', key, #old, #old + math.min(excess, batch) - 1)
          for _, id in ipairs(more) do table.insert(old, id) end
        end
        for _, id in ipairs(old) do
          redis.call('ZREM', key, id)
          forget(id)
          removed = removed + 1
        end
      end
    end
  end
  return removed
end

-- Whether the caller holds the job's current lease.
local function holds(j, token, states)
  local state, epoch = unpack(redis.call('HMGET', j, 'state', 'epoch'))
  if not state then return -1, nil end
  if epoch ~= token then return -6, state end
  for _, s in ipairs(states) do if s == state then return 0, state end end
  return -3, state
end

-- Accepts one job (the body of enqueue and enqueue_bulk). `a` holds, from index `i`:
-- idem_key, tenant, prio, pools, gpus, est_s, max_attempts, payload, notify.
-- Returns status, id: 0 new, 1 duplicate idempotency key, -7 over the tenant's quota.
local function enqueue_one(now, idem_ttl, a, i)
  local idem, tenant, prio, pools = a[i], a[i + 1], tonumber(a[i + 2]), a[i + 3]
  local gpus, est_s, max_attempts, payload, notify =
    tonumber(a[i + 4]), tonumber(a[i + 5]), tonumber(a[i + 6]), a[i + 7], a[i + 8]
  if idem ~= '' then
    local existing = redis.call('GET', k('idem:' .. tenant .. ':' .. idem))
    if existing then return 1, existing end
  end
  local th = k('tenant:' .. tenant)
  local max_waiting = tonumber(redis.call('HGET', th, 'max_waiting') or '-1')
  if max_waiting >= 0 and tonumber(redis.call('HGET', th, 'waiting') or '0') >= max_waiting then
    return -7, ''
  end
  local id = string.format('j%012d', redis.call('INCR', k('seq')))
  if idem ~= '' then
    redis.call('SET', k('idem:' .. tenant .. ':' .. idem), id, 'PX', idem_ttl)
  end
  redis.call('HSET', jk(id), 'tenant', tenant, 'prio', prio, 'pools', pools, 'gpus', gpus,
    'est_s', est_s, 'max_attempts', max_attempts, 'state', 'queued',
    'enq_ms', now, 'rank_ms', now, 'attempts', 0, 'preemptions', 0, 'stalls', 0, 'epoch', 0,
    'event_seq', 0, 'idem', idem, 'notify', notify)
  -- The payload has its own key so the job hash stays small enough for Redis's compact
  -- (listpack) encoding.
  redis.call('SET', k('payload:' .. id), payload)
  add_ready(id, tenant, now, prio)
  event(id, now, 'queued', '')
  return 0, id
end
