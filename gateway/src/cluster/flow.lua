-- Flow control's fair-share counters, summed over the replicas, and the replicas' count.
--
-- KEYS[1]  what every tenant's counter key starts with (`<prefix>:{flow}:served:`): per tenant,
--          a hash replica -> the service that replica gave it (over its weight), absolute
-- KEYS[2]  the replicas flow control counts: sorted set, replica -> lease expiry (ms)
-- ARGV     replica, lease_ms, keep_ms, then per tenant: name, served
--
-- Each replica writes its own whole service (not a delta): a call that ran but whose answer was
-- lost, sent again, counts once, and a store that restarted empty has every replica's service
-- back at its next sync. A replica that stops keeps its field (its service still counts) until
-- nobody wrote the tenant for keep_ms. Returns {live replicas, total...} (totals as strings:
-- Lua's numbers would be cut to integers).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
local keep = tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], now + lease, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('PEXPIRE', KEYS[2], lease * 2)
local out = {redis.call('ZCARD', KEYS[2])}
for i = 4, #ARGV, 2 do
  local key = KEYS[1] .. ARGV[i]
  redis.call('HSET', key, ARGV[1], ARGV[i + 1])
  redis.call('PEXPIRE', key, keep)
  local total = 0
  for _, v in ipairs(redis.call('HVALS', key)) do
    total = total + tonumber(v)
  end
  out[#out + 1] = tostring(total)
end
return out
