-- Give back jobs another worker handed this one that it has not claimed within the grace
-- (it stayed full): to the queue's front, in the order they were handed, for any worker.
-- KEYS: alive, handed, wip, queue; ARGV: token, cutoff ms (handed before it go back)
-- Returns how many went back.
local alive, handed, wip, queue = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('GET', alive) ~= ARGV[1] then return 0 end
if drop_wrong_type(handed, 'zset') then return 0 end
local ids = redis.call('ZRANGEBYSCORE', handed, '-inf', ARGV[2])
local n = 0
for i = #ids, 1, -1 do
  local id = ids[i]
  local f = redis.pcall('HMGET', jkey(id), 'status', 'mlxq_owner')
  local unclaimed = not is_err(f) and f[1] == 'queued' and not f[2]
  if unclaimed and redis.call('LPOS', wip, id) then
    if is_err(redis.pcall('LPUSH', queue, id)) then break end  -- out of memory: next beat
    redis.call('LREM', wip, 1, id)
    n = n + 1
  end
  redis.call('ZREM', handed, id)
end
return n
