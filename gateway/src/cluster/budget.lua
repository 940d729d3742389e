-- One tenant's token budget, one bucket for every replica: refilled at its rate by the store's
-- clock, taken from per request and given back (less what the answer cost) when it ends.
--
-- KEYS[1]  the bucket: hash {level, at (ms)}; absent: full
-- ARGV     tokens_per_minute, take, need
--   need > 0: `take` taken only if `need` is there (a request's hold);
--   need = 0: `take` applied whatever the level (an answer's cost beyond its hold, taken even
--   below zero; or, negative, what it held beyond its cost given back, never past full)
--
-- Returns {1, level} taken (or given), {0, seconds until `need` is there} refused.
local cap = tonumber(ARGV[1])
local take = tonumber(ARGV[2])
local need = tonumber(ARGV[3])
local rate = math.max(cap / 60000, 1e-12)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local level = tonumber(redis.call('HGET', KEYS[1], 'level') or cap)
local at = tonumber(redis.call('HGET', KEYS[1], 'at') or now)
level = math.min(cap, level + rate * math.max(0, now - at))
if need > 0 and level < need then
  return {0, tostring(math.max(1, math.ceil((need - level) / rate / 1000)))}
end
level = math.min(cap, level - take)
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', now)
-- Once full again the bucket is the same as no key.
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - level) / rate) + 1000)
return {1, tostring(level)}
