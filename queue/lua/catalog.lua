-- ARGV: prefix, op, kind, owner, id, then per op:
--   create body / update body / swap expected body / delete / list after limit / count.
-- The catalog: entries of a kind (files, API keys, fine-tunes, models…) per owner (a
-- tenant), kept beyond the queue's retention. Each entry is a hash (body, created_ms,
-- seq); an index per (kind, owner) orders them by creation, newest first for listing.
local op, kind, owner, id = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local function ek(entry) return k('cat:' .. kind .. ':' .. owner .. ':' .. entry) end
local idx = k('catidx:' .. kind .. ':' .. owner)
if op == 'create' then
  if redis.call('HGET', ek(id), 'seq') then return {1} end
  local now, now_s = now_ms()
  local seq = redis.call('INCR', k('catseq'))
  redis.call('HSET', ek(id), 'body', ARGV[6], 'created_ms', now_s, 'seq', seq)
  redis.call('ZADD', idx, seq, id)
  return {0, now}
elseif op == 'update' then
  if not redis.call('HGET', ek(id), 'seq') then return {-1} end
  redis.call('HSET', ek(id), 'body', ARGV[6])
  return {0}
elseif op == 'swap' then
  -- Compare-and-set: the body becomes ARGV[7] only if it is still ARGV[6]. {0} swapped
  -- (or already ARGV[7]: a repeat after a lost reply), {1} the body is something else,
  -- {-1} no such entry.
  local body = redis.call('HGET', ek(id), 'body')
  if not body then return {-1} end
  if body == ARGV[7] then return {0} end
  if body ~= ARGV[6] then return {1} end
  redis.call('HSET', ek(id), 'body', ARGV[7])
  return {0}
elseif op == 'delete' then
  if redis.call('DEL', ek(id)) == 0 then return {-1} end
  redis.call('ZREM', idx, id)
  return {0}
elseif op == 'list' then
  -- Entries created before `after` (an id; '' starts from the newest), at most `limit`.
  -- Returns {0, has_more, id, body, created_ms, id, body, created_ms, …}; {-1} when
  -- `after` is not an entry.
  local after, limit = ARGV[6], tonumber(ARGV[7])
  local max = '+inf'
  if after ~= '' then
    local seq = redis.call('ZSCORE', idx, after)
    if not seq then return {-1} end
    max = '(' .. seq
  end
  local ids = redis.call('ZREVRANGEBYSCORE', idx, max, '-inf', 'LIMIT', 0, limit + 1)
  local out = {0, 0}
  if #ids > limit then out[2] = 1 end
  for i = 1, math.min(#ids, limit) do
    local body, created = unpack(redis.call('HMGET', ek(ids[i]), 'body', 'created_ms'))
    table.insert(out, ids[i])
    table.insert(out, body)
    table.insert(out, created)
  end
  return out
elseif op == 'count' then
  return {0, redis.call('ZCARD', idx)}
end
return redis.error_reply('unknown catalog op ' .. op)
