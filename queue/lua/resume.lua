-- ARGV: prefix, id. A paused job goes back to its place in its tenant's line
-- ({0, 'queued'}); its next attempt resumes from its last checkpoint. A job that is not
-- paused and has no pause pending: nothing to do ({1, state}). A pause still in
-- progress (the attempt is checkpointing), a finished job or one being cancelled:
-- {-3, state}.
local id = ARGV[2]
local now, now_s = now_ms()
local j = jk(id)
local state, tenant, prio, rank, pause_req =
  unpack(redis.call('HMGET', j, 'state', 'tenant', 'prio', 'rank_ms', 'pause_req'))
if not state then return {-1} end
if state ~= 'paused' then
  if pause_req == '1' or state == 'cancel_requested' or state == 'succeeded'
     or state == 'failed' or state == 'cancelled' then
    return {-3, state}
  end
  return {1, state}
end
redis.call('HINCRBY', k('tenant:' .. tenant), 'paused', '-1')
redis.call('HSET', j, 'state', 'queued')
add_ready(id, tenant, num(rank), num(prio))
event(id, now_s, KIND.unpaused, '')
return {0, 'queued'}
