-- ARGV: prefix, batch. Deletes finished jobs past retention; returns how many.
local now = now_ms()
return trim(now, tonumber(ARGV[2]))
