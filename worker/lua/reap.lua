-- Declare a worker dead and requeue everything it held, at the queue's front, in order.
-- Atomic against that worker's heartbeat: if it beat since the caller looked, nothing
-- happens; otherwise its lease is gone for good and, should it wake, it learns it owns
-- nothing (the reaped marker) before it writes anything.
-- KEYS: dead alive, dead wip, queue, roll, started, dead rq worker executions, reaped marker,
--       canceled registry, more rolls it is taken off...
-- Each job goes back to its own queue (rq's ``origin``); ``queue`` is for one whose record
-- names none.
-- ARGV: dead name, alive value the caller saw ('' for none), now_ts, now_str, max ttl, notice,
--       marker ttl
-- Returns {'alive'} | {'reaped', requeued ids...}.
local alive, wip, queue, roll, started, worker_execs, marker, canceled =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local dead, seen = ARGV[1], ARGV[2]
-- A lease of another type (a rogue write) is unreadable: expired, as one that lapsed.
local current = lease(alive)
if current and current ~= seen then return {'alive'} end
redis.call('DEL', alive)
local c = {wip = wip, queue = queue, started = started, worker_execs = worker_execs,
           canceled = canceled, now_ts = tonumber(ARGV[3]), now_str = ARGV[4],
           max_ttl = tonumber(ARGV[5]), notice = ARGV[6]}
-- In its list but unclaimed ('' owner): a move whose reply it never read. Still its own.
local function its(owner) return owner == dead or owner == '' end
-- Every key it writes is fitted first (see fit and requeue_one): a reap never stops
-- midway. A WIP list of another type holds nothing to requeue.
fit({}, wip, 'list')
fit({}, worker_execs, 'set')
local ids = redis.call('LRANGE', wip, 0, -1)
local out = {'reaped'}
for i = #ids, 1, -1 do
  if requeue_one(ids[i], c, its, false) == 'requeued' then out[#out + 1] = ids[i] end
end
redis.call('DEL', wip)
redis.call('SET', marker, 1, 'EX', tonumber(ARGV[7]))
-- A roll of another type is no roll to leave: the next beat of a live worker replaces it.
redis.pcall('SREM', roll, dead)
for i = 9, #KEYS do redis.pcall('SREM', KEYS[i], dead) end
return out
