-- Commit the ends of started jobs: the last chunk, the result or failure, rq's registries.
-- A pending cancel wins: a job whose cancel() returned True ends canceled, whatever it made.
-- KEYS: alive, started, rq worker, rq worker executions, wip, finished, failed, canceled
--   (the registries of the worker's first queue: each job's own queue's are written, and
--   these only for a job whose record names no queue)
-- ARGV: token, worker, now_ts, now_str, stream_ttl, default result ttl, default failure ttl,
--       max ttl, then per job: id, outcome (finished|failed|canceled), execution id,
--       value (rq result field: base64 return value, or base64 zlib failure text),
--       exc_info (zlib failure text for the job hash), started_ts, seq, chunk, canceled chunk
-- Every key it writes is fitted before its first write (see fit), so an end is never
-- refused midway: a job ends whole (status, TTL, result, registries, last chunk), or is
-- left as it was. A replay log of another type cannot take the last chunk: the job ends
-- all the same, and the rogue key gets the log's TTL (listeners get an error, not text).
-- Returns {'lease'} | {'oom'} | per job {id, outcome as recorded, chunk write, what was
--   replaced ('' for nothing; see heal)} or
--   {id, 'refused'} (not this worker's any more: nothing written),
--   then {'', 'keys', notes} when keys its jobs share were replaced.
local alive, started, rq_worker, worker_execs, wip, finished, failed, canceled =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local token, worker, now_ts, now_str = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local stream_ttl, result_ttl, failure_ttl, max_ttl = tonumber(ARGV[5]), tonumber(ARGV[6]),
  tonumber(ARGV[7]), tonumber(ARGV[8])
local shared = {}
local stop = open_jobs(shared, alive, token, wip, rq_worker, worker_execs, now_str)
if stop then return stop end

local out, n_ok, n_failed = {}, 0, 0
for i = 9, #ARGV, 9 do
  local id, outcome, exec, value, exc_info = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3],
    ARGV[i + 4]
  local started_ts, seq, chunk = ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
  local jk = jkey(id)
  local o = origin(id)
  local note, record = heal(id, wip, {'status', 'started', 'mlxq_owner', worker,
                                      'mlxq_exec', exec}, exec,
                            {{okey(o, K_STARTED, started), 'zset'},
                             {okey(o, K_FINISHED, finished), 'zset'},
                             {okey(o, K_FAILED, failed), 'zset'},
                             {okey(o, K_CANCELED, canceled), 'zset'}})
  local f = {}
  if record ~= 'foreign' then
    f = redis.call('HMGET', jk, 'status', 'mlxq_owner', 'mlxq_cancel', 'mlxq_exec',
                   'result_ttl', 'failure_ttl')
  end
  local status, owner = f[1], f[2] or ''
  if f[4] == exec and owner == worker and TERMINAL[status] then
    out[#out + 1] = {id, status, 'dup', note}  -- a retried end whose first reply was lost
  elseif owner ~= worker or status ~= 'started' or f[4] ~= exec then
    if owner ~= worker then redis.call('LREM', wip, 1, id) end
    out[#out + 1] = {id, 'refused'}
  else
    if f[3] == '1' then outcome, chunk = 'canceled', ARGV[i + 8] end
    end_execution(id, exec, okey(o, K_STARTED, started), worker_execs)
    if outcome == 'finished' then
      local ttl = record_ttl(f[5], result_ttl, max_ttl)
      redis.call('HSET', jk, 'status', 'finished', 'ended_at', now_str)
      add_result(id, 1, worker, 'return_value', value, exec, started_ts, now_ts, ttl)
      redis.call('ZADD', okey(o, K_FINISHED, finished), now_ts + ttl, id)
      redis.call('EXPIRE', jk, ttl)
      n_ok = n_ok + 1
    elseif outcome == 'failed' then
      local ttl = record_ttl(f[6], failure_ttl, max_ttl)
      redis.call('HSET', jk, 'status', 'failed', 'ended_at', now_str, 'exc_info', exc_info)
      add_result(id, 2, worker, 'exc_string', value, exec, started_ts, now_ts, ttl)
      redis.call('ZADD', okey(o, K_FAILED, failed), now_ts + ttl, id)
      redis.call('EXPIRE', jk, ttl)
      n_failed = n_failed + 1
    else
      outcome = 'canceled'
      redis.call('HSET', jk, 'status', 'canceled', 'ended_at', now_str)
      redis.call('ZADD', okey(o, K_CANCELED, canceled), now_ts, id)
      redis.call('EXPIRE', jk, record_ttl(f[6], failure_ttl, max_ttl))
    end
    local how = write_chunk(id, seq, chunk, stream_ttl, true)
    redis.call('LREM', wip, 1, id)
    out[#out + 1] = {id, outcome, how, note}
  end
end
-- rq's counters, for `rq info`: a rogue value there (no integer) is left as it is.
if n_ok > 0 then redis.pcall('HINCRBY', rq_worker, 'successful_job_count', n_ok) end
if n_failed > 0 then redis.pcall('HINCRBY', rq_worker, 'failed_job_count', n_failed) end
return shared_note(out, shared)
