-- Start claimed jobs: rq's states (STARTED, an execution, StartedJobRegistry) in bulk.
-- KEYS: alive, started registry, rq worker key, rq worker executions, wip, canceled registry
--   (the registries of the worker's first queue: see end.lua)
-- ARGV: token, worker, now_ts, now_str, ttl, failure_ttl_cap, notice,
--       then per job: id, attempts before this start, execution id
-- Every key it writes is fitted before its first write (see fit), so a start is never
-- refused midway: a job is started whole, or left as it was.
-- Returns {'lease'} | {'oom'} | one entry per job: {id, 'ok', what was replaced ('' for
--   nothing; see heal)} | {id, 'canceled'}
--   | {id, 'refused', why} (no longer this worker's to start: it must drop the job),
--   then {'', 'keys', notes} when keys its jobs share were replaced.
local alive, started, rq_worker, worker_execs, wip, canceled =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local token, worker, now_ts, now_str = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local ttl, max_ttl, notice = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
-- Not rq's ``state``: the worker's counters own that (busy while rows run), so a job
-- that starts and ends between two of their writes never leaves an idle worker reading busy.
local shared = {}
local stop = open_jobs(shared, alive, token, wip, rq_worker, worker_execs, now_str)
if stop then return stop end

local out = {}
for i = 8, #ARGV, 3 do
  local id, before, exec = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local jk = jkey(id)
  local o = origin(id)
  local note, record = heal(id, wip, {'status', 'queued', 'mlxq_owner', worker,
                                      'mlxq_attempt', ARGV[i + 1]}, exec,
                            {{okey(o, K_STARTED, started), 'zset'},
                             {okey(o, K_CANCELED, canceled), 'zset'}})
  local f = {}
  if record ~= 'foreign' then
    f = redis.call('HMGET', jk, 'status', 'mlxq_owner', 'mlxq_attempt', 'mlxq_cancel',
                   'mlxq_exec', 'failure_ttl')
  end
  local status, owner = f[1], f[2] or ''
  if status == 'started' and owner == worker and f[5] == exec then
    out[#out + 1] = {id, 'ok', note}  -- a retried start whose first reply was lost
  elseif owner ~= worker or status ~= 'queued' or (tonumber(f[3] or '0') ~= before) then
    if owner ~= worker then redis.call('LREM', wip, 1, id) end
    out[#out + 1] = {id, 'refused', 'status=' .. tostring(status) .. ' owner=' .. owner}
  elseif f[4] == '1' then
    redis.call('LREM', wip, 1, id)
    mark_canceled(id, okey(o, K_CANCELED, canceled), f[6], now_ts, now_str, notice,
                  max_ttl)
    out[#out + 1] = {id, 'canceled'}
  else
    local attempt = before + 1
    redis.call('HSET', jk, 'status', 'started', 'started_at', now_str, 'last_heartbeat', now_str,
               'worker_name', worker, 'mlxq_attempt', attempt, 'mlxq_exec', exec)
    redis.call('PERSIST', jk)
    local composite = id .. ':' .. exec
    local ek = K_EXECUTION .. composite
    redis.call('HSET', ek, 'id', exec, 'job_id', id, 'created_at', now_ts,
               'last_heartbeat', now_ts, 'worker_name', worker)
    redis.call('EXPIRE', ek, ttl)
    redis.call('ZADD', K_EXECUTIONS .. id, now_ts + ttl + 60, exec)
    redis.call('EXPIRE', K_EXECUTIONS .. id, ttl + 60)
    redis.call('ZADD', okey(o, K_STARTED, started), now_ts + ttl, composite)
    redis.call('SADD', worker_execs, composite)
    -- A first run has no log of its own yet: whatever sits under its name is forged.
    -- A later run keeps the log (listeners replay across runs) unless it is not a stream.
    local stream = K_STREAM .. id
    if attempt == 1 then
      redis.call('DEL', stream)
    else
      drop_wrong_type(stream, 'stream')
    end
    out[#out + 1] = {id, 'ok', note}
  end
end
redis.call('EXPIRE', worker_execs, ttl + 60)
return shared_note(out, shared)
