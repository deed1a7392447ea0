-- ARGV: prefix, idem_ttl_ms, then one job: idem_key, tenant, prio, pools, gpus, est_s,
-- max_attempts, payload, notify.
-- Returns {0, id} for a new job, {1, id} for a duplicate idempotency key, {-7} over quota.
local now, now_s = now_ms()
local status, id = enqueue_one(now, now_s, ARGV[2], ARGV, 3)
return {status, id}
