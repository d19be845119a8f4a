-- session_put: a session's entry (a committed migration's target, marked). KEYS: the session's key;
-- ARGV: its entry, ttl ms. A script, not a plain SET, so that it goes in the iteration's pipeline: a
-- burst of session writes (a migration storm's commits) takes one connection
return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
