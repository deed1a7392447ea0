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

-- One event as the JSON line the log keeps, written by hand because every transition
-- writes one: only a message with quotes, backslashes or control characters needs
-- cjson to escape it.
local function event_json(seq, now, kind, message)
  if string.find(message, '[%c"\\]') then
    message = cjson.encode(message)
  else
    message = '"' .. message .. '"'
  end
  return '{"seq":' .. seq .. ',"at_ms":' .. now .. ',"kind":"' .. kind .. '","message":' .. message .. '}'
end

-- Appends event lines to a job's log, keeping the newest max_events_per_job.
local function push_events(id, lines)
  local key = k('events:' .. id)
  local n = redis.call('RPUSH', key, unpack(lines))
  if n > CFG.max_events then redis.call('LTRIM', key, -CFG.max_events, -1) end
end

-- Appends one event to the job's log (capped), numbered by the job's event_seq.
local function event(id, now, kind, message)
  local seq = redis.call('HINCRBY', jk(id), 'event_seq', 1)
  push_events(id, {event_json(seq, now, kind, message)})
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
-- at most `batch` per index per call, so memory stays bounded without long-running
-- scripts. Both rules take from the oldest end of an index, so the jobs to delete are
-- a prefix of it: the ones over the count, then the ones past the age. Reading that
-- prefix (or just the oldest job, to check its age) costs one ZRANGE.
local function trim(now, batch)
  local removed = 0
  local cutoff = now - CFG.retention_ms
  for _, index in ipairs({'done', 'dead'}) do
    local key = k(index)
    local count = redis.call('ZCARD', key)
    if count > 0 and batch > 0 then
      local excess = count - CFG.retention_count
      local head = redis.call('ZRANGE', key, 0, math.min(math.max(excess, 1), batch) - 1, 'WITHSCORES')
      local old = {}
      for i = 1, #head, 2 do
        if #old >= excess and tonumber(head[i + 1]) > cutoff then break end
        table.insert(old, head[i])
      end
      -- Everything read was past the age and the batch has room: more may be too.
      if #old == #head / 2 and #old < batch and tonumber(head[#head]) <= cutoff then
        local more = redis.call('ZRANGEBYSCORE', key, '-inf', cutoff, 'LIMIT', #old, batch - #old)
        for _, id in ipairs(more) do table.insert(old, id) end
      end
      for _, id in ipairs(old) do
        redis.call('ZREM', key, id)
        forget(id)
      end
      removed = removed + #old
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

-- A node pool's hash as claim and complete use it, read with one HMGET: they change
-- `used` and `avg` in the table and save_pool writes both back with one HSET, so a
-- script that gives capacity back and takes it again touches the hash twice, not six
-- times. `capacity` is -1 for an unknown pool, `avg` -1 while no run time is known.
local function load_pool(name)
  local key = k('pool:' .. name)
  local capacity, used, avg = unpack(redis.call('HMGET', key, 'capacity', 'used', 'avg_run_ms'))
  return {name = name, key = key, capacity = tonumber(capacity or '-1'),
    used = tonumber(used or '0'), avg = tonumber(avg or '-1'), changed = false}
end

-- Writes back what claim and complete changed in a load_pool table.
local function save_pool(p)
  if not p.changed then return end
  if p.avg >= 0 then
    redis.call('HSET', p.key, 'used', p.used, 'avg_run_ms', p.avg)
  else
    redis.call('HSET', p.key, 'used', p.used)
  end
end

-- Whether a job that may run on `pools` (comma-separated, '' for any) may run on `pool`.
local function allowed(pools, pool)
  if pools == '' then return true end
  for p in string.gmatch(pools, '[^,]+') do if p == pool then return true end end
  return false
end

-- Leases job `id` of `tenant` (its ready set is `ready`) on pool `p` for `owner`, with
-- a new fencing token; with `start` the attempt is running at once. `job` holds the
-- job's gpus, est_s, attempts, preemptions and event_seq; `t` the tenant's weight,
-- running, waiting and virtual time `vt`; `empties` says whether the job is the last
-- one the tenant has waiting. Charges the pool (in `p`), the tenant's quota and its
-- fair share. Returns the claim reply.
local function lease(now, p, owner, lease_ms, quantum, start, id, tenant, ready, job, t, empties)
  redis.call('ZREM', ready, id)
  local token = redis.call('INCR', k('fence'))
  local deadline = now + lease_ms
  local seq = tonumber(job.seq or '0')
  local lines = {event_json(seq + 1, now, 'leased', p.name)}
  local state = 'leased'
  if start then
    state = 'running'
    lines[2] = event_json(seq + 2, now, 'started', '')
  end
  local fields = {'state', state, 'epoch', token, 'owner', owner, 'deadline', deadline,
    'pool', p.name, 'cancel_req', 0, 'event_seq', seq + #lines}
  if start then
    table.insert(fields, 'started_ms')
    table.insert(fields, now)
  end
  redis.call('HSET', jk(id), unpack(fields))
  redis.call('ZADD', k('leases'), deadline, id)
  p.used = p.used + job.gpus
  p.changed = true
  -- Weighted fair queueing on GPU-time: charge the tenant's virtual time.
  local vclock = tonumber(redis.call('GET', k('vclock')) or '0')
  if t.vt > vclock then redis.call('SET', k('vclock'), t.vt) end
  local est = tonumber(job.est)
  if est <= 0 then est = quantum end
  local next_vt = t.vt + job.gpus * est / t.weight
  redis.call('HSET', k('tenant:' .. tenant), 'running', t.running + job.gpus,
    'waiting', t.waiting - 1, 'vtime', next_vt)
  if empties then
    redis.call('ZREM', k('tenants'), tenant)
  else
    redis.call('ZADD', k('tenants'), next_vt, tenant)
  end
  push_events(id, lines)
  local payload = redis.call('GET', k('payload:' .. id)) or ''
  return {0, id, token, tenant, payload, job.attempts, job.preemptions, deadline}
end

-- Claims the best job that fits pool `p` (a load_pool table; the caller saves it) for
-- `owner` and returns the claim reply, or nil when nothing fits. It looks at up to
-- `scan_tenants` active tenants, lowest virtual time first, and at up to `scan_depth`
-- of each one's best-ranked jobs. Both lists are read a few entries at a time, since
-- the first candidate nearly always fits; the first read takes two jobs, so that
-- taking the first tells whether the tenant runs dry.
local function claim_next(now, p, owner, lease_ms, scan_tenants, scan_depth, quantum, start)
  if p.used >= p.capacity then return nil end
  local tenants = redis.call('ZRANGE', k('tenants'), 0, 0, 'WITHSCORES')
  local i = 1
  while i < #tenants do
    local tenant = tenants[i]
    local th = k('tenant:' .. tenant)
    local weight, max_running, running, waiting =
      unpack(redis.call('HMGET', th, 'weight', 'max_running', 'running', 'waiting'))
    local t = {vt = tonumber(tenants[i + 1]), weight = tonumber(weight or '1'),
      running = tonumber(running or '0'), waiting = tonumber(waiting or '0')}
    max_running = tonumber(max_running or '-1')
    -- Every job takes at least one GPU: a tenant at its quota has nothing that fits.
    if max_running < 0 or t.running < max_running then
      local ready = k('ready:' .. tenant)
      local heads = redis.call('ZRANGE', ready, 0, 1)
      local alone = #heads == 1
      local n = 1
      while n <= #heads and n <= scan_depth do
        local id = heads[n]
        local pools, gpus, est, attempts, preemptions, seq = unpack(redis.call('HMGET', jk(id),
          'pools', 'gpus', 'est_s', 'attempts', 'preemptions', 'event_seq'))
        gpus = tonumber(gpus)
        if allowed(pools, p.name) and p.used + gpus <= p.capacity
           and (max_running < 0 or t.running + gpus <= max_running) then
          local job = {gpus = gpus, est = est, attempts = attempts, preemptions = preemptions, seq = seq}
          return lease(now, p, owner, lease_ms, quantum, start, id, tenant, ready, job, t, alone)
        end
        if n == 2 and scan_depth > 2 then
          for _, more in ipairs(redis.call('ZRANGE', ready, 2, scan_depth - 1)) do
            table.insert(heads, more)
          end
        end
        n = n + 1
      end
    end
    if i == 1 and scan_tenants > 1 then
      for _, v in ipairs(redis.call('ZRANGE', k('tenants'), 1, scan_tenants - 1, 'WITHSCORES')) do
        table.insert(tenants, v)
      end
    end
    i = i + 2
  end
  return nil
end

-- Completes the attempt on job `id` that holds `token`: keeps the pool's moving average
-- of run times (queued jobs' estimated start uses it), gives the capacity back and files
-- the job as succeeded. `p`, when given, is a load_pool table the caller saves: if the
-- job ran on that pool, the release is made in it rather than with writes of its own.
-- Returns 0, or a failure status and the job's state (nothing changed).
local function complete_job(now, id, token, result, p)
  local j = jk(id)
  local state, epoch, pool, started, gpus, tenant, notify, seq = unpack(redis.call('HMGET', j,
    'state', 'epoch', 'pool', 'started_ms', 'gpus', 'tenant', 'notify', 'event_seq'))
  if not state then return -1 end
  if epoch ~= token then return -6, state end
  if state ~= 'leased' and state ~= 'running' and state ~= 'suspect' then return -3, state end
  if pool and pool ~= '' then
    local ran_on = p
    if not (p and p.name == pool) then ran_on = load_pool(pool) end
    if started then
      local took = now - tonumber(started)
      if ran_on.avg < 0 then ran_on.avg = took else ran_on.avg = math.floor(0.8 * ran_on.avg + 0.2 * took) end
    end
    ran_on.used = ran_on.used - tonumber(gpus)
    ran_on.changed = true
    if ran_on ~= p then save_pool(ran_on) end
    redis.call('HINCRBY', k('tenant:' .. tenant), 'running', -tonumber(gpus))
  end
  redis.call('ZREM', k('leases'), id)
  if state == 'suspect' then redis.call('ZREM', k('suspect'), id) end
  -- Jobs that asked to be notified get an outbox entry (see finish).
  if notify == '1' then
    redis.call('ZADD', k('outbox'), now, id .. '|succeeded|' .. tenant)
  end
  if CFG.retention_count <= 0 then
    -- Deleted at once, so its result and last event are not written at all.
    forget(id)
  else
    seq = tonumber(seq or '0') + 1
    redis.call('HSET', j, 'state', 'succeeded', 'finished_ms', now, 'result', result, 'event_seq', seq)
    redis.call('HDEL', j, 'pool', 'owner', 'deadline')
    push_events(id, {event_json(seq, now, 'succeeded', '')})
    redis.call('ZADD', k('done'), now, id)
  end
  trim(now, 4)
  return 0
end
