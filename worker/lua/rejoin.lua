-- A worker that learned it was reaped starts over under a new token: whatever still sits in
-- its WIP list (a job a queue handed it while it was frozen) goes back to the queue first.
-- A worker starting takes its name the same way: what a dead predecessor of that name left
-- in the list (a worker killed, or a start that failed) goes back, and its lease is taken,
-- unless another holds it.
-- KEYS: alive, wip, queue, roll, started, rq worker executions, reaped marker, canceled,
--       the rolls of its other queues...
-- ARGV: new token, name, now_ts, now_str, max ttl, notice, lease ms, and when starting,
--       the lease value the caller found ('' for none): should the lease hold another
--       value now, nothing is done
-- Returns how many entries went back, or -1 (starting: another worker holds the name).
local alive, wip, queue, roll, started, worker_execs, marker, canceled =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local name = ARGV[2]
if ARGV[8] ~= nil then
  local current = lease(alive)
  if current and current ~= ARGV[8] then return -1 end
end
local c = {wip = wip, queue = queue, started = started, worker_execs = worker_execs,
           canceled = canceled, now_ts = tonumber(ARGV[3]), now_str = ARGV[4],
           max_ttl = tonumber(ARGV[5]), notice = ARGV[6]}
local function its(owner) return owner == name or owner == '' end
-- Every key it writes is fitted first (see fit and requeue_one): it never stops midway.
fit({}, wip, 'list')
fit({}, worker_execs, 'set')
local ids = redis.call('LRANGE', wip, 0, -1)
for i = #ids, 1, -1 do requeue_one(ids[i], c, its, false) end
redis.call('DEL', wip, marker)
redis.call('SET', alive, ARGV[1], 'PX', tonumber(ARGV[7]))
for i = 4, #KEYS do
  if i == 4 or i > 8 then
    fit({}, KEYS[i], 'set')
    redis.pcall('SADD', KEYS[i], name)  -- refused for memory: the next beat adds it
  end
end
return #ids
