-- KEYS: rate, this process's record of its hand-back of this loss. ARGV: rpm, tpm, the
-- requests and tokens to charge for what one process admitted on its own while Redis was
-- lost (its use less what its share refilled meanwhile, all of the loss so far; negative:
-- a charge to take off), its estimate of the levels had nothing been used ('-1':
-- unknown), which stand in for buckets Redis lost (a restart), the hand-back's number
-- within the loss, and how long to remember it. A hand-back already applied, or older
-- than one applied (an answer lost, the call resent), charges nothing; a newer one only
-- what it adds (the loss's requests that ran on, settled). Returns 1 if applied, else 0.
local seen = redis.call('HMGET', KEYS[2], 'n', 'r', 't')
local seq = tonumber(ARGV[7])
local last = tonumber(seen[1])
if last ~= nil and seq <= last then return 0 end
local r0, t0 = 0, 0
if last == nil then
  local rest, test = tonumber(ARGV[5]), tonumber(ARGV[6])
  if rpm > 0 and rest >= 0 and redis.call('HEXISTS', KEYS[1], 'rt') == 0 then
    rl = math.min(rpm, rest)
  end
  if tpm > 0 and test >= 0 and redis.call('HEXISTS', KEYS[1], 'tt') == 0 then
    tl = math.min(tpm, test)
  end
else
  r0, t0 = tonumber(seen[2]), tonumber(seen[3])
end
rl = rl - (tonumber(ARGV[3]) - r0)
tl = tl - (tonumber(ARGV[4]) - t0)
store(true)
redis.call('HSET', KEYS[2], 'n', ARGV[7], 'r', ARGV[3], 't', ARGV[4])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[8]))
return 1
