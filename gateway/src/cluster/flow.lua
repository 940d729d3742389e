-- Flow control's fair-share counters, summed over the replicas, and the replicas' count.
--
-- KEYS[1]  tenants' service: hash, tenant -> cost served fleet-wide (over its weight)
-- KEYS[2]  the replicas flow control counts: sorted set, replica -> lease expiry (ms)
-- ARGV     replica, lease_ms, keep_ms, then per tenant: name, delta, served
--
-- Adds each tenant's delta (this replica's service since its last call) and answers the sum;
-- a tenant the store lacks (it restarted, or the fleet was idle past keep_ms) is seeded with
-- this replica's whole service. Returns {live replicas, total...} (totals as strings: Lua's
-- numbers would be cut to integers).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], now + lease, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('PEXPIRE', KEYS[2], lease * 2)
local out = {redis.call('ZCARD', KEYS[2])}
for i = 4, #ARGV, 3 do
  local total
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    total = redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
    total = ARGV[i + 2]
  end
  out[#out + 1] = tostring(total)
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return out
