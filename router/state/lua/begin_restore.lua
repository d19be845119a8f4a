-- include: now
-- begin_restore: a restore announced. KEYS: restoring; ARGV: field, epoch id, ms until the entry
-- lapses (a router that died restoring)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. (now + tonumber(ARGV[3])))
return 1
