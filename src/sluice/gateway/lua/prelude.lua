-- Shared by the bucket scripts (prepended to each): the time (Redis's own), the limits
-- (ARGV[1] rpm, ARGV[2] tpm) and both buckets of KEYS[1] after refill; store() writes
-- them back. A call takes no level below minus a whole bucket (a request charges at
-- most a full bucket, and what a backend reports of its usage costs its tenant at most a
-- minute), nor below where it was when it was already deeper: a debt is never
-- forgiven. store(true), the hand-back's (resume.lua), has no floor: what the processes
-- admitted while Redis was lost is charged whole.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local function level(cap, lf, tf)
  local v = redis.call('HMGET', KEYS[1], lf, tf)
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then return cap end
  if now > at then l = l + (now - at) * cap / 60 end
  if l > cap then l = cap end
  return l
end
local rl, tl = 0, 0
if rpm > 0 then rl = level(rpm, 'rl', 'rt') end
if tpm > 0 then tl = level(tpm, 'tl', 'tt') end
local rl0, tl0 = rl, tl
local function store(nofloor)
  local ttl = 0
  local f = '%.17g'
  if not nofloor then
    rl = math.max(rl, math.min(rl0, -rpm))
    tl = math.max(tl, math.min(tl0, -tpm))
  end
  if rpm > 0 then
    redis.call('HSET', KEYS[1], 'rl', string.format(f, rl), 'rt', string.format(f, now))
    ttl = math.max(ttl, (rpm - rl) * 60 / rpm)
  end
  if tpm > 0 then
    redis.call('HSET', KEYS[1], 'tl', string.format(f, tl), 'tt', string.format(f, now))
    ttl = math.max(ttl, (tpm - tl) * 60 / tpm)
  end
  -- a bucket that would be full again is the same as no key
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000)
  else
    redis.call('DEL', KEYS[1])
  end
end
local function lvl(cap, l)
  if cap > 0 then return string.format('%.17g', l) end
  return '-1'
end
