-- After the Redis master changed (a failover), make the new master's records agree with
-- what this live worker holds: the last writes of the old master may be missing here.
-- Per running job (id, execution id, the attempt its stream goes on under):
--   started by this worker with this execution: kept; its attempt raised (its stream
--     starts a new run: listeners get a reset, then the full text) and its WIP entry put
--     back if the WIP list lost it -> 'ok';
--   queued (its claim or start was lost) and nobody else's: claimed again for this worker,
--     out of its queue, into the WIP list, started under this execution -> 'reclaimed';
--   anything else (another worker's, ended, gone) -> 'lost': the worker drops it.
-- A raised attempt counts as a clean run (mlxq_clean), never towards the failed-run limit.
-- Then the WIP entries of jobs started by this worker under an execution not listed (an
-- end the old master took with it): returned as strays, for the caller to give back once
-- it checked it does not hold them.
-- KEYS: alive, wip, queue (for a job whose record names none)
-- ARGV: token, worker, now_str, then per job: id, execution id, attempt
-- Returns {'lease'} | {verdicts (one per job), strays}.
local alive, wip, queue = KEYS[1], KEYS[2], KEYS[3]
local token, worker, now_str = ARGV[1], ARGV[2], ARGV[3]
if lease(alive) ~= token then return {'lease'} end
fit({}, wip, 'list')
local verdicts, execs = {}, {}
for i = 4, #ARGV, 3 do
  local id, exec, attempt = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  execs[id] = exec
  local jk = jkey(id)
  local f = {}
  if redis.call('TYPE', jk)['ok'] == 'hash' then
    f = redis.call('HMGET', jk, 'status', 'mlxq_owner', 'mlxq_exec')
  end
  local status, owner = f[1], f[2] or ''
  local verdict = 'lost'
  if status == 'started' and owner == worker and f[3] == exec then
    verdict = 'ok'
  elseif status == 'queued' and (owner == worker or owner == '') then
    redis.call('LREM', okey(origin(id), K_QUEUE, queue), 0, id)
    redis.call('HSET', jk, 'status', 'started', 'mlxq_owner', worker, 'mlxq_exec', exec,
               'worker_name', worker, 'started_at', now_str)
    redis.call('PERSIST', jk)
    verdict = 'reclaimed'
  end
  if verdict ~= 'lost' then
    local was = tonumber(redis.call('HGET', jk, 'mlxq_attempt')) or 0
    if tonumber(attempt) > was then
      redis.call('HSET', jk, 'mlxq_attempt', attempt)
      redis.call('HINCRBY', jk, 'mlxq_clean', tonumber(attempt) - math.max(was, 1))
    end
    if not redis.call('LPOS', wip, id) then redis.call('RPUSH', wip, id) end
  end
  verdicts[#verdicts + 1] = verdict
end
local strays = {}
for _, id in ipairs(redis.call('LRANGE', wip, 0, -1)) do
  if execs[id] == nil and redis.call('TYPE', jkey(id))['ok'] == 'hash' then
    local f = redis.call('HMGET', jkey(id), 'status', 'mlxq_owner')
    if f[1] == 'started' and f[2] == worker then strays[#strays + 1] = id end
  end
end
return {verdicts, strays}
