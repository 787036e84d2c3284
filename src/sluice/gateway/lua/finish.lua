-- KEYS: rate, conc. ARGV: rpm, tpm, requests back, tokens back (negative: charge more),
-- slots released, process. A refund is (1, tokens, 1); a settle + release (0, charged -
-- used, 1); a release alone (0, 0, 1); the gate sends the sum of a few at once. Returns
-- the levels after it (as in acquire.lua's sight): the freshest sight once traffic stops.
local rback = tonumber(ARGV[3])
local tback = tonumber(ARGV[4])
if (rpm > 0 and rback ~= 0) or (tpm > 0 and tback ~= 0) then
  rl = math.min(rpm, rl + rback)
  tl = math.min(tpm, tl + tback)
  store()
end
local releases = tonumber(ARGV[5])
if releases > 0 and redis.call('HEXISTS', KEYS[2], ARGV[6]) == 1 then
  if redis.call('HINCRBY', KEYS[2], ARGV[6], -releases) <= 0 then
    redis.call('HDEL', KEYS[2], ARGV[6])
  end
end
return {lvl(rpm, rl), lvl(tpm, tl)}
