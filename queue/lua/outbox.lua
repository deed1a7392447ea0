-- ARGV: prefix, op, limit_or_member, delay_ms.
-- op 'due': up to `limit` deliveries whose time has come, oldest first (they stay in
--   the outbox until acknowledged, so a crashed sender loses none).
-- op 'ack': the delivery `member` is done. op 'retry': try `member` again after delay_ms.
local op = ARGV[2]
local now, now_s = now_ms()
if op == 'due' then
  return redis.call('ZRANGEBYSCORE', k('outbox'), '-inf', now_s, 'WITHSCORES', 'LIMIT', '0', ARGV[3])
elseif op == 'ack' then
  return redis.call('ZREM', k('outbox'), ARGV[3])
elseif op == 'retry' then
  return redis.call('ZADD', k('outbox'), 'XX', str(now + tonumber(ARGV[4])), ARGV[3])
end
return redis.error_reply('unknown outbox op ' .. op)
