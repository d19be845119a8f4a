-- abandon: drop a claim whose request failed, unless it was completed. KEYS: the key
if redis.call('GET', KEYS[1]) == '' then return redis.call('DEL', KEYS[1]) end
return 0
