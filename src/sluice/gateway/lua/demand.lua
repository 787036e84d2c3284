-- This process's part of the tenant's recent demand (tokens asked; requests when the
-- tenant has no token quota): exponentially decayed sums, one per process and their
-- total, all decayed alike so that the parts add up to the total at any time. Returns the
-- part as a string ('-1': no demand recorded). Prepended after prelude.lua.
local function demand(key, me, add, tau)
  local f = '%.17g'
  local v = redis.call('HMGET', key, 'T', 'Tt', 'd:' .. me, 't:' .. me, 'S')
  local total, mine = tonumber(v[1]) or 0, tonumber(v[3]) or 0
  if v[2] then total = total * math.exp(-math.max(0, now - tonumber(v[2])) / tau) end
  if v[4] then mine = mine * math.exp(-math.max(0, now - tonumber(v[4])) / tau) end
  if add > 0 then
    total, mine = total + add, mine + add
    redis.call('HSET', key, 'T', string.format(f, total), 'Tt', string.format(f, now),
      'd:' .. me, string.format(f, mine), 't:' .. me, string.format(f, now))
    -- once per tau: forget processes silent for 10 tau (gone; their part is ~0 by then)
    if now >= (tonumber(v[5]) or 0) then
      local all = redis.call('HGETALL', key)
      for i = 1, #all, 2 do
        local name = all[i]
        if string.sub(name, 1, 2) == 't:' and now - tonumber(all[i + 1]) > 10 * tau then
          redis.call('HDEL', key, name, 'd:' .. string.sub(name, 3))
        end
      end
      redis.call('HSET', key, 'S', string.format(f, now + tau))
    end
    redis.call('PEXPIRE', key, math.ceil(10 * tau * 1000))
  end
  if total <= 0 then return '-1' end
  return string.format(f, math.min(1, mine / total))
end
