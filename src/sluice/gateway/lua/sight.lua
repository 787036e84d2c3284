-- KEYS: rate, share. ARGV: rpm, tpm, process, demand_tau_s. The sight alone (levels and
-- part of the demand, as in acquire.lua's answer), charging nothing.
return {lvl(rpm, rl), lvl(tpm, tl), demand(KEYS[2], ARGV[3], 0, tonumber(ARGV[4]))}
