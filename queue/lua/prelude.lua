-- Shared by every tuneq queue script. The scripts are the functions of one Redis
-- Functions library (see Library in backend.rs): this prelude is its top, built once
-- when the library loads, and each script's body becomes a function of (KEYS, ARGV)
-- that starts with begin_call. KEYS[1] is the domain's meta hash ("tq:{D}:meta"),
-- which routes the call to the domain's slot on Redis Cluster; ARGV[1] is the key
-- prefix ("tq:{D}:"), so every key a script touches shares the {D} hash tag. Status
-- codes: 0 ok, 1 nothing to do / duplicate, -1 missing job, -3 wrong state, -6 stale
-- token, -7 over quota or capacity, -9 unknown pool.

-- The call's key prefix and meta key (set by begin_call).
local P, META
local function k(s) return P .. s end
local function jk(id) return P .. 'job:' .. id end

-- What a script costs is mostly its redis.call()s and its number conversions: Redis
-- formats a Lua number handed to a command with '%.17g', Lua formats a number joined
-- with '..' with '%.14g', and tonumber() parses with strtod, twice; each costs about
-- as much as a simple command. So the scripts pass on the strings they read (ARGV,
-- replies) as they are, write constants as strings ('0', '1'), format a computed whole
-- number once with str(), and parse (num()) only what they compute with.

-- A whole number as a string ('%d' costs half of Redis's '%.17g'). A fractional one
-- (a virtual time) stays a number, which Redis formats exactly.
local function str(n)
  if n % 1 == 0 then return string.format('%d', n) end
  return n
end

-- A number read as a decimal string (from a reply or ARGV) as a number: the arithmetic
-- parses it once, where tonumber() checks it and then converts it.
local function num(s) return s + 0 end

-- Settings stored in the meta hash, read once per call by now_ms().
local CFG = {}

-- Starts a call: its meta key and prefix, and no settings read yet.
local function begin_call(keys, argv)
  META, P, CFG = keys[1], argv[1], {}
end

-- Milliseconds from Redis TIME (or, when a test pinned the clock, from the pinned
-- moment), plus the test clock offset, never going backwards, returned as a number and
-- as a string. Also loads the domain's settings into CFG (one HMGET for both).
local function now_ms()
  local m = redis.call('HMGET', META, 'clock_offset', 'clock', 'max_events_per_job',
    'aging_horizon_ms', 'retention_ms', 'retention_count', 'clock_pinned')
  CFG.max_events = m[3] and num(m[3]) or 200
  CFG.horizon = m[4] and num(m[4]) or 7200000
  CFG.retention_ms = m[5] and num(m[5]) or 604800000
  CFG.retention_count = m[6] and num(m[6]) or 100000
  local ms
  if m[7] then
    ms = num(m[7])
  else
    local t = redis.call('TIME')
    ms = num(t[1]) * 1000 + math.floor(num(t[2]) / 1000)
  end
  if m[1] then ms = ms + num(m[1]) end
  -- The high-water mark, stored as str() wrote it, is its own string.
  if m[2] then
    local hwm = num(m[2])
    if ms <= hwm then return hwm, m[2] end
  end
  local s = str(ms)
  redis.call('HSET', META, 'clock', s)
  return ms, s
end

-- A string as a JSON string literal: only one with quotes, backslashes or control
-- characters needs cjson to escape it (every transition writes an event).
local function json_string(text)
  if string.find(text, '[%c"\\]') then return cjson.encode(text) end
  return '"' .. text .. '"'
end

-- One event as the JSON line the log keeps, written by hand because every transition
-- writes one. `kind` is a code of the generated KIND table (never a literal: a test
-- holds every script to it); `extra` is '' or more members, as event_field makes them.
-- `seq` and `now_s` are strings (see str()).
local function event_json(seq, now_s, kind, message, extra)
  return '{"seq":' .. seq .. ',"at_ms":' .. now_s .. ',"kind":"' .. kind .. '"' .. (extra or '')
    .. ',"message":' .. json_string(message) .. '}'
end

-- One typed member of an event (`pool`, `stop`, `failure`), for event_json's `extra`.
local function event_field(name, value)
  return ',"' .. name .. '":' .. json_string(value)
end

-- Appends event lines (the arguments after `id`) to a job's log, keeping the newest
-- max_events_per_job.
local function push_events(id, ...)
  local key = k('events:' .. id)
  local n = redis.call('RPUSH', key, ...)
  if n > CFG.max_events then redis.call('LTRIM', key, str(-CFG.max_events), '-1') end
end

-- Appends one event to the job's log (capped), numbered by the job's event_seq.
local function event(id, now_s, kind, message, extra)
  local seq = redis.call('HINCRBY', jk(id), 'event_seq', '1')
  push_events(id, event_json(str(seq), now_s, kind, message, extra))
end

-- A code the caller passed for one of the generated tables (STOP, FAILURE, KIND), or
-- a script error: a code this library does not know is never stored.
local function known(table, code, what)
  if table[code] == nil then error('unknown ' .. what .. ' code: ' .. tostring(code)) end
  return code
end

-- Puts a job in its tenant's ready set (aged score: rank + (9 - prio) * horizon;
-- ties fall back to the zero-padded id, i.e. FIFO) and activates the tenant, which
-- starts no earlier than the global virtual clock (idle tenants bank no credit).
local function add_ready(id, tenant, rank_ms, prio)
  redis.call('ZADD', k('ready:' .. tenant), str(rank_ms + (9 - prio) * CFG.horizon), id)
  redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', '1')
  if not redis.call('ZSCORE', k('tenants'), tenant) then
    local vt = num(redis.call('HGET', k('tenant:' .. tenant), 'vtime') or '0')
    local vclock = num(redis.call('GET', k('vclock')) or '0')
    if vt < vclock then vt = vclock end
    vt = str(vt)
    redis.call('HSET', k('tenant:' .. tenant), 'vtime', vt)
    redis.call('ZADD', k('tenants'), vt, tenant)
  end
end

-- Takes a job out of its tenant's ready set; deactivates the tenant when it empties.
local function remove_ready(id, tenant)
  local ready = k('ready:' .. tenant)
  if redis.call('ZREM', ready, id) == 1 then
    redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', '-1')
  end
  if redis.call('ZCARD', ready) == 0 then redis.call('ZREM', k('tenants'), tenant) end
end

-- Gives back the capacity a lease reserved and forgets the lease.
local function release(id)
  local j = jk(id)
  local pool, gpus, tenant = unpack(redis.call('HMGET', j, 'pool', 'gpus', 'tenant'))
  if pool and pool ~= '' then
    redis.call('HINCRBY', k('pool:' .. pool), 'used', '-' .. gpus)
    redis.call('HINCRBY', k('tenant:' .. tenant), 'running', '-' .. gpus)
  end
  redis.call('HDEL', j, 'pool', 'owner', 'deadline')
  redis.call('ZREM', k('leases'), id)
  redis.call('ZREM', k('suspect'), id)
end

-- Sets a job that holds no capacity and is in no line aside as paused, until resume
-- puts it back in line; paused jobs count against their tenant's waiting quota. The
-- `paused` event says `message` (and `extra`, as event_field makes it).
local function set_paused(id, tenant, now_s, message, extra)
  local j = jk(id)
  redis.call('HSET', j, 'state', 'paused')
  redis.call('HDEL', j, 'pause_req', 'due_ms')
  redis.call('HINCRBY', k('tenant:' .. tenant), 'paused', '1')
  event(id, now_s, KIND.paused, message, extra)
end

-- Moves up to `batch` (a string) delayed jobs whose retry time has come back to ready.
local function promote_due(now_s, batch)
  local due = redis.call('ZRANGEBYSCORE', k('delayed'), '-inf', now_s, 'LIMIT', '0', batch)
  for _, id in ipairs(due) do
    redis.call('ZREM', k('delayed'), id)
    local tenant, prio, rank = unpack(redis.call('HMGET', jk(id), 'tenant', 'prio', 'rank_ms'))
    redis.call('HSET', jk(id), 'state', 'queued')
    redis.call('HINCRBY', k('tenant:' .. tenant), 'waiting', '-1')
    add_ready(id, tenant, num(rank), num(prio))
  end
end

-- Deletes everything a job owns.
local function forget(id)
  redis.call('DEL', jk(id), k('payload:' .. id), k('events:' .. id))
end

-- Marks a job finished and files it for retention; with a retention count of 0 it
-- is deleted at once (like BullMQ's removeOnComplete).
local function finish(id, now_s, state, index)
  -- Jobs that asked to be notified get an outbox entry (the webhook sender's work
  -- list), carrying what the notice needs even if retention deletes the job first.
  local notify, tenant = unpack(redis.call('HMGET', jk(id), 'notify', 'tenant'))
  if notify == '1' then
    redis.call('ZADD', k('outbox'), now_s, id .. '|' .. state .. '|' .. tenant)
  end
  if CFG.retention_count <= 0 then
    forget(id)
    return
  end
  redis.call('HSET', jk(id), 'state', state, 'finished_ms', now_s)
  redis.call('ZADD', k(index), now_s, id)
end

-- Deletes everything the jobs `ids` own, a few hundred jobs per command (a Lua call
-- takes a bounded number of arguments).
local function forget_all(ids)
  local keys = {}
  for i, id in ipairs(ids) do
    keys[#keys + 1] = jk(id)
    keys[#keys + 1] = k('payload:' .. id)
    keys[#keys + 1] = k('events:' .. id)
    if i % 300 == 0 or i == #ids then
      redis.call('DEL', unpack(keys))
      keys = {}
    end
  end
end

-- Deletes finished jobs older than the retention age or beyond the retention count,
-- at most `batch` per index per call, so memory stays bounded without long-running
-- scripts. Both rules take from the oldest end of an index: the jobs over the count
-- go whatever their age (one ZPOPMIN takes them), and when the last of those was past
-- the age too, or none was over the count, the oldest ones past the age follow.
local function trim(now, batch)
  -- With nothing to keep, finished jobs are deleted as they finish, so both indexes
  -- are empty unless the settings changed: one EXISTS tells.
  if CFG.retention_count <= 0 and redis.call('EXISTS', k('done'), k('dead')) == 0 then
    return 0
  end
  local removed = 0
  for _, index in ipairs({'done', 'dead'}) do
    local key = k(index)
    local count = redis.call('ZCARD', key)
    if count > 0 and batch > 0 then
      local cutoff = now - CFG.retention_ms
      local old = {}
      local more_past_age = true
      local excess = math.min(count - CFG.retention_count, batch)
      if excess > 0 then
        local popped = redis.call('ZPOPMIN', key, str(excess))
        for i = 1, #popped, 2 do old[#old + 1] = popped[i] end
        more_past_age = num(popped[#popped]) <= cutoff
      end
      if more_past_age and #old < batch then
        local aged = redis.call('ZRANGEBYSCORE', key, '-inf', str(cutoff), 'LIMIT', '0', str(batch - #old))
        for _, id in ipairs(aged) do
          redis.call('ZREM', key, id)
          old[#old + 1] = id
        end
      end
      forget_all(old)
      removed = removed + #old
    end
  end
  return removed
end

-- Whether the caller holds the job's current lease (a job never leased has epoch 0):
-- the status, the job's state, and whether its tenant asked for a pause (read in the
-- same call, since the fenced scripts that hold a lease are the ones that need it).
local function holds(j, token, states)
  local state, epoch, pause_req = unpack(redis.call('HMGET', j, 'state', 'epoch', 'pause_req'))
  if not state then return -1, nil end
  if (epoch or '0') ~= token then return -6, state end
  for _, s in ipairs(states) do if s == state then return 0, state, pause_req == '1' end end
  return -3, state
end

-- Accepts one job (the body of enqueue and enqueue_bulk). `a` holds, from index `i`:
-- idem_key, tenant, prio, pools, gpus, est_s, max_attempts, payload, notify.
-- Returns status, id: 0 new, 1 duplicate idempotency key, -7 over the tenant's quota.
local function enqueue_one(now, now_s, idem_ttl, a, i)
  local idem, tenant, prio, pools = a[i], a[i + 1], a[i + 2], a[i + 3]
  local gpus, est_s, max_attempts, payload, notify = a[i + 4], a[i + 5], a[i + 6], a[i + 7], a[i + 8]
  if idem ~= '' then
    local existing = redis.call('GET', k('idem:' .. tenant .. ':' .. idem))
    if existing then return 1, existing end
  end
  local th = k('tenant:' .. tenant)
  local max_waiting, waiting, paused = unpack(redis.call('HMGET', th, 'max_waiting', 'waiting', 'paused'))
  if max_waiting and num(waiting or '0') + num(paused or '0') >= num(max_waiting) then
    return -7, ''
  end
  local id = string.format('j%012d', redis.call('INCR', k('seq')))
  if idem ~= '' then
    redis.call('SET', k('idem:' .. tenant .. ':' .. idem), id, 'PX', idem_ttl)
  end
  -- The job's first event is written below, so event_seq starts at 1. Fields at their
  -- defaults are left out (readers take an absent attempts, preemptions, stalls, epoch
  -- or est_s as 0, pools or idem as '', notify as '0'): a smaller hash is cheaper to
  -- write and to search (a listpack is searched field by field, the ones read most
  -- come first) and takes less memory.
  local fields = {'state', 'queued', 'tenant', tenant, 'gpus', gpus, 'event_seq', '1',
    'prio', prio, 'max_attempts', max_attempts, 'enq_ms', now_s, 'rank_ms', now_s}
  if pools ~= '' then fields[#fields + 1] = 'pools'; fields[#fields + 1] = pools end
  if est_s ~= '0' then fields[#fields + 1] = 'est_s'; fields[#fields + 1] = est_s end
  if notify ~= '0' then fields[#fields + 1] = 'notify'; fields[#fields + 1] = notify end
  if idem ~= '' then fields[#fields + 1] = 'idem'; fields[#fields + 1] = idem end
  redis.call('HSET', jk(id), unpack(fields))
  -- The payload has its own key so the job hash stays small enough for Redis's compact
  -- (listpack) encoding.
  redis.call('SET', k('payload:' .. id), payload)
  add_ready(id, tenant, now, num(prio))
  push_events(id, event_json('1', now_s, KIND.queued, ''))
  return 0, id
end

-- A node pool's hash as claim and complete use it, read with one HMGET: they change
-- `used` and `avg` in the table and save_pool writes both back with one HSET (none
-- when they ended as they were, as when a worker gives one GPU back and takes one),
-- so a script that gives capacity back and takes it again touches the hash at most
-- twice, not six times. `capacity` is -1 for an unknown pool, `avg` -1 while no run
-- time is known.
local function load_pool(name)
  local key = k('pool:' .. name)
  local capacity, used, avg = unpack(redis.call('HMGET', key, 'capacity', 'used', 'avg_run_ms'))
  used = used and num(used) or 0
  avg = avg and num(avg) or -1
  return {name = name, key = key, capacity = capacity and num(capacity) or -1,
    used = used, avg = avg, loaded_used = used, loaded_avg = avg}
end

-- Writes back what claim and complete changed in a load_pool table.
local function save_pool(p)
  if p.used == p.loaded_used and p.avg == p.loaded_avg then return end
  if p.avg >= 0 then
    redis.call('HSET', p.key, 'used', str(p.used), 'avg_run_ms', str(p.avg))
  else
    redis.call('HSET', p.key, 'used', str(p.used))
  end
end

-- Whether a job that may run on `pools` (comma-separated, '' for any) may run on `pool`.
local function allowed(pools, pool)
  if pools == '' then return true end
  for p in string.gmatch(pools, '[^,]+') do if p == pool then return true end end
  return false
end

-- Claims the best job that fits pool `p` (a load_pool table; the caller saves it) for
-- `owner` and returns the claim reply, or nil when nothing fits. It looks at up to
-- `scan_tenants` active tenants, lowest virtual time first, and at up to `scan_depth`
-- of each one's best-ranked jobs. Both lists are read a few entries at a time, since
-- the first candidate nearly always fits; the first read takes two jobs, so that
-- taking the first tells whether the tenant runs dry. `lease_ms` and `quantum` are
-- ARGV strings.
local function claim_next(now, now_s, p, owner, lease_ms, scan_tenants, scan_depth, quantum, start)
  if p.used >= p.capacity then return nil end
  local tenants = redis.call('ZRANGE', k('tenants'), '0', '0', 'WITHSCORES')
  local i = 1
  while i < #tenants do
    local tenant, vt_s = tenants[i], tenants[i + 1]
    local th = k('tenant:' .. tenant)
    local weight, max_running, running, waiting =
      unpack(redis.call('HMGET', th, 'weight', 'max_running', 'running', 'waiting'))
    running = running and num(running) or 0
    max_running = max_running and num(max_running) or -1
    -- Every job takes at least one GPU: a tenant at its quota has nothing that fits.
    if max_running < 0 or running < max_running then
      local ready = k('ready:' .. tenant)
      local heads = redis.call('ZRANGE', ready, '0', '1')
      local alone = #heads == 1
      local n = 1
      while n <= #heads and n <= scan_depth do
        local id = heads[n]
        local j = jk(id)
        local pools, gpus, est, attempts, preemptions, seq = unpack(redis.call('HMGET', j,
          'pools', 'gpus', 'est_s', 'attempts', 'preemptions', 'event_seq'))
        gpus = num(gpus)
        if allowed(pools or '', p.name) and p.used + gpus <= p.capacity
           and (max_running < 0 or running + gpus <= max_running) then
          -- Lease it, with a new fencing token; with `start` the attempt is running at
          -- once. This charges the pool (in `p`), the tenant's quota and its fair share.
          redis.call('ZREM', ready, id)
          local token = redis.call('INCR', k('fence'))
          local deadline = now + num(lease_ms)
          local deadline_s = str(deadline)
          seq = num(seq or '0') + 1
          local leased = event_json(str(seq), now_s, KIND.leased, '', event_field('pool', p.name))
          if start then
            seq = seq + 1
            local seq_s = str(seq)
            redis.call('HSET', j, 'state', 'running', 'epoch', str(token), 'owner', owner,
              'deadline', deadline_s, 'pool', p.name, 'cancel_req', '0', 'event_seq', seq_s,
              'started_ms', now_s)
            push_events(id, leased, event_json(seq_s, now_s, KIND.started, ''))
          else
            redis.call('HSET', j, 'state', 'leased', 'epoch', str(token), 'owner', owner,
              'deadline', deadline_s, 'pool', p.name, 'cancel_req', '0', 'event_seq', str(seq))
            push_events(id, leased)
          end
          redis.call('ZADD', k('leases'), deadline_s, id)
          p.used = p.used + gpus
          -- Weighted fair queueing on GPU-time: charge the tenant's virtual time.
          local vt = num(vt_s)
          local vclock_key = k('vclock')
          local vclock = redis.call('GET', vclock_key)
          if vt > (vclock and num(vclock) or 0) then redis.call('SET', vclock_key, vt_s) end
          est = est and num(est) or 0
          if est <= 0 then est = num(quantum) end
          local next_vt = str(vt + gpus * est / (weight and num(weight) or 1))
          redis.call('HSET', th, 'running', str(running + gpus),
            'waiting', str((waiting and num(waiting) or 0) - 1), 'vtime', next_vt)
          if alone then
            -- That was the tenant's last waiting job.
            redis.call('ZREM', k('tenants'), tenant)
          else
            redis.call('ZADD', k('tenants'), next_vt, tenant)
          end
          local payload = redis.call('GET', k('payload:' .. id)) or ''
          return {0, id, token, tenant, payload, attempts or '0', preemptions or '0', deadline}
        end
        if n == 2 and scan_depth > 2 then
          for _, more in ipairs(redis.call('ZRANGE', ready, '2', str(scan_depth - 1))) do
            table.insert(heads, more)
          end
        end
        n = n + 1
      end
    end
    if i == 1 and scan_tenants > 1 then
      for _, v in ipairs(redis.call('ZRANGE', k('tenants'), '1', str(scan_tenants - 1), 'WITHSCORES')) do
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
local function complete_job(now, now_s, id, token, result, p)
  local j = jk(id)
  local state, epoch, pool, started, gpus, tenant, notify, seq = unpack(redis.call('HMGET', j,
    'state', 'epoch', 'pool', 'started_ms', 'gpus', 'tenant', 'notify', 'event_seq'))
  if not state then return -1 end
  if (epoch or '0') ~= token then return -6, state end
  if state ~= 'leased' and state ~= 'running' and state ~= 'suspect' then return -3, state end
  if pool and pool ~= '' then
    local ran_on = p
    if not (p and p.name == pool) then ran_on = load_pool(pool) end
    if started then
      local took = now - num(started)
      if ran_on.avg < 0 then ran_on.avg = took else ran_on.avg = math.floor(0.8 * ran_on.avg + 0.2 * took) end
    end
    ran_on.used = ran_on.used - num(gpus)
    if ran_on ~= p then save_pool(ran_on) end
    redis.call('HINCRBY', k('tenant:' .. tenant), 'running', '-' .. gpus)
  end
  redis.call('ZREM', k('leases'), id)
  if state == 'suspect' then redis.call('ZREM', k('suspect'), id) end
  -- Jobs that asked to be notified get an outbox entry (see finish).
  if notify == '1' then
    redis.call('ZADD', k('outbox'), now_s, id .. '|succeeded|' .. tenant)
  end
  if CFG.retention_count <= 0 then
    -- Deleted at once, so its result and last event are not written at all.
    forget(id)
  else
    seq = str(num(seq or '0') + 1)
    redis.call('HSET', j, 'state', 'succeeded', 'finished_ms', now_s, 'result', result, 'event_seq', seq)
    redis.call('HDEL', j, 'pool', 'owner', 'deadline')
    push_events(id, event_json(seq, now_s, KIND.succeeded, ''))
    redis.call('ZADD', k('done'), now_s, id)
  end
  trim(now, 4)
  return 0
end
