-- ARGV: prefix, id, token, lease_ms, progress_json ('' for none), report_seq ('' for a
-- plain heartbeat), then (kind, message, data) triples to append to the job's log: a
-- KIND code, text for people, and the event's fields as a JSON object ('' for none).
-- Extends the lease (a suspect attempt that reports in is running again), records the
-- progress and events, and returns {0, deadline, pause, recorded} (pause: '1' when the
-- tenant asked for a pause, which the attempt's dispatcher carries out; recorded: '0'
-- for a repeated report, which recorded nothing). A stale token gets -6: that attempt
-- must stop. Reports are numbered per attempt: a repeated report (after a lost reply)
-- renews the lease but appends nothing twice.
local id, token, lease_ms, progress, report = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local now, now_s = now_ms()
local j = jk(id)
local s, state, pausing = holds(j, token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s, state} end
local deadline = now + lease_ms
local deadline_s = str(deadline)
local next_state = state
if state == 'suspect' then
  next_state = 'running'
  redis.call('ZREM', k('suspect'), id)
  event(id, now_s, KIND.lease_recovered, '')
end
local fields = {'state', next_state, 'deadline', deadline_s}
local fresh = true
if report and report ~= '' then
  local last = redis.call('HGET', j, 'report_seq')
  local seen_token, seen = string.match(last or '', '^(%d+):(%d+)$')
  if seen_token == token and num(seen) >= num(report) then fresh = false end
  fields[#fields + 1] = 'report_seq'
  fields[#fields + 1] = token .. ':' .. report
end
if fresh then
  if progress and progress ~= '' then
    fields[#fields + 1] = 'progress'
    fields[#fields + 1] = progress
  end
  if #ARGV >= 9 then
    local seq = num(redis.call('HGET', j, 'event_seq') or '0')
    local lines = {}
    for i = 7, #ARGV - 2, 3 do
      seq = seq + 1
      local data = ARGV[i + 2]
      local extra = ''
      if data ~= '' then extra = ',"data":' .. data end
      lines[#lines + 1] = event_json(str(seq), now_s, known(KIND, ARGV[i], 'event kind'), ARGV[i + 1], extra)
    end
    fields[#fields + 1] = 'event_seq'
    fields[#fields + 1] = str(seq)
    push_events(id, unpack(lines))
  end
end
redis.call('HSET', j, unpack(fields))
redis.call('ZADD', k('leases'), deadline_s, id)
local pause, recorded = '0', '0'
if pausing then pause = '1' end
if fresh then recorded = '1' end
return {0, deadline, pause, recorded}
