-- KEYS: rate. ARGV: rpm, tpm, the requests and tokens to charge for what one process
-- admitted on its own while Redis was lost (its use less what its share refilled
-- meanwhile; negative: a charge to take off), and its estimate of the levels had nothing
-- been used ('-1': unknown), which stand in for buckets Redis lost (a restart).
local rest, test = tonumber(ARGV[5]), tonumber(ARGV[6])
if rpm > 0 and rest >= 0 and redis.call('HEXISTS', KEYS[1], 'rt') == 0 then
  rl = math.min(rpm, rest)
end
if tpm > 0 and test >= 0 and redis.call('HEXISTS', KEYS[1], 'tt') == 0 then
  tl = math.min(tpm, test)
end
rl = rl - tonumber(ARGV[3])
tl = tl - tonumber(ARGV[4])
store(true)
return 1
