-- ARGV: prefix, idem_ttl_ms, then 9 fields per job (as in enqueue.lua), in order.
-- Returns {status1, id1, status2, id2, ...}; each job is accepted or refused on its own.
local now, now_s = now_ms()
local out = {}
for i = 3, #ARGV, 9 do
  local status, id = enqueue_one(now, now_s, ARGV[2], ARGV, i)
  table.insert(out, status)
  table.insert(out, id)
end
return out
