-- KEYS: conc, beat. ARGV: process, its open requests. The absolute count repairs what a
-- lost call left wrong; a process with none leaves no trace.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = tonumber(ARGV[2])
if n > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], n)
  redis.call('HSET', KEYS[2], ARGV[1], string.format('%.17g', now))
  redis.call('EXPIRE', KEYS[1], 3600)
  redis.call('EXPIRE', KEYS[2], 3600)
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return 1
