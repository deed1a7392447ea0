-- ARGV: prefix, id, token, reason, retryable (0/1), base_ms, max_ms, jitter (0..1),
-- failure class (a FAILURE code; kept beside the reason, so the two always describe
-- the same failure).
-- Counts an attempt; retries after exponential backoff with jitter while the budget
-- lasts (the job goes to the back: rank = retry time), then fails for good. A job
-- with a pause pending that may be retried is paused instead ({2}): resume retries it.
local id, token, reason, retryable = ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1'
local base, cap, jitter = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local class = known(FAILURE, ARGV[9], 'failure')
local now, now_s = now_ms()
local j = jk(id)
local s, _, pausing = holds(j, token, {'leased', 'running', 'suspect'})
if s ~= 0 then return {s} end
release(id)
redis.call('HSET', j, 'failure', class)
local attempts = redis.call('HINCRBY', j, 'attempts', '1')
local max_attempts = tonumber(redis.call('HGET', j, 'max_attempts'))
if retryable and attempts < max_attempts then
  if pausing then
    redis.call('HSET', j, 'error', reason)
    set_paused(id, redis.call('HGET', j, 'tenant'), now_s, reason, event_field('failure', class))
    return {2}
  end
  local delay = math.min(cap, base * 2 ^ (attempts - 1))
  delay = math.floor(delay + delay * jitter)
  local due = now + delay
  local due_s = str(due)
  redis.call('HSET', j, 'error', reason, 'state', 'delayed', 'due_ms', due_s, 'rank_ms', due_s)
  redis.call('ZADD', k('delayed'), due_s, id)
  redis.call('HINCRBY', k('tenant:' .. redis.call('HGET', j, 'tenant')), 'waiting', '1')
  event(id, now_s, KIND.retry_scheduled, reason, event_field('failure', class))
  return {0, due}
end
redis.call('HSET', j, 'error', reason)
event(id, now_s, KIND.failed, reason, event_field('failure', class))
finish(id, now_s, 'failed', 'dead')
return {1}
