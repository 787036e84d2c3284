-- KEYS: the set of live gateway processes. ARGV: process, stale_s. Returns how many
-- processes showed signs of life within stale_s (this one included).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], 3600)
return redis.call('ZCARD', KEYS[1])
