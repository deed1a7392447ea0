-- ARGV: prefix, id, token, result_json. The attempt succeeded.
local now, now_s = now_ms()
local s, state = complete_job(now, now_s, ARGV[2], ARGV[3], ARGV[4])
return {s, state}
