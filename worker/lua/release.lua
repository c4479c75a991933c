-- Give held jobs back: to the queue's front, or dropped from the WIP list.
-- KEYS: alive, wip, queue, started, rq worker executions, canceled registry
-- ARGV: token, worker, now_ts, now_str, max ttl, notice, mode, ids...
--   mode 'requeue': back to the queue (a batch failed, or it was handed over);
--   'clean': the same on a clean shutdown, which does not count as a failed attempt;
--   'drop': only out of the WIP list (an entry that is no job, or not a readable id).
-- Returns {'lease'} | per id the outcome ('requeued', 'canceled', 'skipped', 'ended', 'dropped').
local alive, wip, queue, started, worker_execs, canceled =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local token, worker = ARGV[1], ARGV[2]
if lease(alive) ~= token then return {'lease'} end
-- Every key it writes is fitted first (see fit and requeue_one): a job goes back whole.
fit({}, wip, 'list')
fit({}, worker_execs, 'set')
local mode = ARGV[7]
local c = {wip = wip, queue = queue, started = started, worker_execs = worker_execs,
           canceled = canceled, now_ts = tonumber(ARGV[3]), now_str = ARGV[4],
           max_ttl = tonumber(ARGV[5]), notice = ARGV[6]}
local function mine(owner) return owner == worker or owner == '' end
local out = {}
for i = #ARGV, 8, -1 do  -- backwards, so LPUSH keeps their order at the front
  local id = ARGV[i]
  if mode == 'drop' then
    redis.call('LREM', wip, 1, id)
    out[i - 7] = 'dropped'
  else
    out[i - 7] = requeue_one(id, c, mine, mode == 'clean')
  end
end
return out
