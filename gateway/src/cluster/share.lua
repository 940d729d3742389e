-- One gateway replica's share of one decoder's slots, granted so that the live replicas' shares
-- never sum past the decoder's capacity. Run atomically by the store (EVALSHA), so two replicas
-- never both take the same free slots.
--
-- KEYS[1]  the replicas' records: hash, replica -> "share want head since seq capacity"
-- KEYS[2]  their leases: sorted set, replica -> expiry (ms, the store's clock)
-- KEYS[3]  settling until (ms): while it is ahead, nobody grows
-- KEYS[4]  the last call (ms): absent when the store starts empty
-- ARGV     replica, capacity, in_use, want, head, head_age_ms, lease_ms, held, seq
--
-- Returns {share, live replicas, settling (0/1)}. The share is the grant; the store records no
-- less than `held` (what the replica may be using now) until the replica has applied a smaller
-- grant and says so in its next call: the record never falls below what a replica admits on.
-- `seq` rises with every call of a replica: a call that arrives after a later one (a retry
-- overtook it) changes nothing.
local me = ARGV[1]
local my_cap = tonumber(ARGV[2])
local in_use = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local head = tonumber(ARGV[5])
local head_age = tonumber(ARGV[6])
local lease = tonumber(ARGV[7])
local held = tonumber(ARGV[8])
local seq = tonumber(ARGV[9])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function parse(v)
  local s, w, h, since, q, c = string.match(v, '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
  return tonumber(s), tonumber(w), tonumber(h), tonumber(since), tonumber(q), tonumber(c)
end

local mine = redis.call('HGET', KEYS[1], me)
if mine then
  local s, _, _, _, q = parse(mine)
  if seq <= q then
    -- A stale call: the replica has moved on.
    return {s, redis.call('HLEN', KEYS[1]), 0}
  end
end

local function settle()
  local until_ms = now + lease
  if tonumber(redis.call('GET', KEYS[3]) or '0') < until_ms then
    redis.call('SET', KEYS[3], until_ms, 'PX', lease)
  end
end
local last = redis.call('GET', KEYS[4])
if not last or now - tonumber(last) > lease then
  -- The store starts empty (it may have lost what the replicas hold), or nobody reached it for a
  -- lease (every replica's lease ran out while they kept their shares): nobody grows until every
  -- live replica has said again what it holds, one lease from now.
  settle()
end
redis.call('SET', KEYS[4], now, 'PX', lease * 4)
if not mine and (held > 0 or in_use > 0) then
  -- The store does not know what this replica holds (its lease lapsed while it could not reach
  -- the store): nobody grows for one lease.
  settle()
end
-- Replicas whose lease ran out are gone, and their shares with them.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + lease, me)
local settling = tonumber(redis.call('GET', KEYS[3]) or '0') > now

-- The others: what they hold, and who has waited longest for more (by its oldest waiter). The
-- capacity is the smallest any live replica was configured with (a rollout that lowers it).
local my_since = 0
if head > 0 and want > held then my_since = math.max(now - head_age, 1) end
local others, alive, cap = 0, 1, my_cap
local oldest, oldest_since, oldest_head = nil, 0, 0
if my_since > 0 then oldest, oldest_since, oldest_head = me, my_since, head end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local r = all[i]
  if r ~= me then
    if redis.call('ZSCORE', KEYS[2], r) then
      local s, w, h, since, _, c = parse(all[i + 1])
      others = others + s
      alive = alive + 1
      cap = math.min(cap, c)
      if since > 0 and w > s and (oldest == nil or since < oldest_since) then
        oldest, oldest_since, oldest_head = r, since, h
      end
    else
      redis.call('HDEL', KEYS[1], r)
    end
  end
end

local fair = math.floor(cap / alive)
local target
if settling then
  target = held
elseif oldest == nil then
  -- Nobody waits: keep up to a fair share spare, so a request arriving here goes at once.
  target = math.max(want, fair)
elseif oldest == me then
  target = want
else
  -- Someone else has waited longest: hold no more than a fair share, less if its next request
  -- needs more than a fair share.
  local left = math.floor((cap - math.max(oldest_head, fair)) / math.max(alive - 1, 1))
  target = math.min(want, fair, math.max(left, 0))
end
local share = math.min(target, cap - others)
-- Slots already held stay counted until they are returned.
if share < in_use then share = in_use end
if share < 0 then share = 0 end
local since = 0
if want > share and head > 0 then since = my_since end
local record = math.max(share, held)
redis.call('HSET', KEYS[1], me, string.format('%d %d %d %d %d %d', record, want, head, since, seq, my_cap))
redis.call('PEXPIRE', KEYS[1], lease * 4)
redis.call('PEXPIRE', KEYS[2], lease * 4)
local s = 0
if settling then s = 1 end
return {share, alive, s}
