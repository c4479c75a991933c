-- A clean stop: the worker's lease and stats go, so no job is handed to it after this;
-- every job handed to it and not claimed goes back to the queue's front (one handed after
-- its last beat's give-back included); then, holding nothing, it leaves the queue's roll,
-- else it stays on it, lease gone, for a live worker to reap what it holds at once.
-- KEYS: alive, roll, stats, handed, wip, queue, the rolls of its other queues...
-- ARGV: token, name, settled ('1': every job it ran has ended, '' otherwise)
-- Returns {'left' | 'stays', how many handed jobs went back}.
local alive, roll, stats, handed, wip, queue = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local n = 0
if lease(alive) == ARGV[1] then n = give_back(handed, wip, queue, '+inf', -1) end
redis.call('DEL', alive, stats)
local held = redis.pcall('LLEN', wip)
if ARGV[3] == '1' and held == 0 then
  -- A roll of another type (a rogue write) is no roll to leave: a live worker's next beat
  -- replaces it.
  redis.pcall('SREM', roll, ARGV[2])
  for i = 7, #KEYS do redis.pcall('SREM', KEYS[i], ARGV[2]) end
  return {'left', n}
end
return {'stays', n}
