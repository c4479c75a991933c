-- A worker that learned it was reaped starts over under a new token: whatever still sits in
-- its WIP list (a job a queue handed it while it was frozen) goes back to the queue first.
-- KEYS: alive, wip, queue, roll, started, rq worker executions, reaped marker, canceled,
--       the rolls of its other queues...
-- ARGV: new token, name, now_ts, now_str, max ttl, notice, lease ms
local alive, wip, queue, roll, started, worker_execs, marker, canceled =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local name = ARGV[2]
local c = {wip = wip, queue = queue, started = started, worker_execs = worker_execs,
           canceled = canceled, now_ts = tonumber(ARGV[3]), now_str = ARGV[4],
           max_ttl = tonumber(ARGV[5]), notice = ARGV[6]}
local function its(owner) return owner == name or owner == '' end
drop_wrong_type(wip, 'list')  -- a rogue write made it another type: see claim.lua
local ids = redis.call('LRANGE', wip, 0, -1)
for i = #ids, 1, -1 do requeue_one(ids[i], c, its, false) end
redis.call('DEL', wip, marker)
redis.call('SET', alive, ARGV[1], 'PX', tonumber(ARGV[7]))
redis.call('SADD', roll, name)
for i = 9, #KEYS do redis.call('SADD', KEYS[i], name) end
return #ids
