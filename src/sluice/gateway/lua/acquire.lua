-- KEYS: rate, conc, beat, share. ARGV: rpm, tpm, maxConcurrency, tokens, process,
-- stale_s, concurrency_retry_s, demand_tau_s. Returns {ok (1|0), retry_after_s, then the
-- sight: requests level, tokens level ('-1': no such limit), this process's part of the
-- demand}, all but ok as strings. A request is charged at most a full bucket.
local maxc = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
if tpm > 0 and tokens > tpm then tokens = tpm end
local me = ARGV[5]
local weight = 1
if tpm > 0 then weight = math.max(1, tokens) end
local part = demand(KEYS[4], me, weight, tonumber(ARGV[8]))
local function answer(ok, retry)
  return {ok, retry, lvl(rpm, rl), lvl(tpm, tl), part}
end
if maxc > 0 then
  local stale = tonumber(ARGV[6])
  local conc = redis.call('HGETALL', KEYS[2])
  local open = 0
  for i = 1, #conc, 2 do
    local beat = tonumber(redis.call('HGET', KEYS[3], conc[i]) or '0')
    if conc[i] ~= me and now - beat > stale then
      redis.call('HDEL', KEYS[2], conc[i])
      redis.call('HDEL', KEYS[3], conc[i])
    else
      open = open + tonumber(conc[i + 1])
    end
  end
  if open >= maxc then return answer(0, ARGV[7]) end
end
local wait = 0
if rpm > 0 and rl < 1 then wait = (1 - rl) * 60 / rpm end
if tpm > 0 then
  local need = tokens - tl
  if need > 0 then wait = math.max(wait, need * 60 / tpm) end
end
if wait > 0 then return answer(0, string.format('%.6f', wait)) end
rl = rl - 1
tl = tl - tokens
store()
if maxc > 0 then
  redis.call('HINCRBY', KEYS[2], me, 1)
  redis.call('HSET', KEYS[3], me, string.format('%.17g', now))
  redis.call('EXPIRE', KEYS[2], 3600)
  redis.call('EXPIRE', KEYS[3], 3600)
end
return answer(1, '0')
