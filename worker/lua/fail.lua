-- Fail claimed jobs that never started (unreadable, invalid, past their ttl, too long for
-- the model): status FAILED with the reason, an error chunk for listeners. A job with a
-- pending cancel ends canceled instead: its cancel() returned True, so that is its end.
-- KEYS: alive, wip, failed registry, canceled registry (the first queue's: see end.lua)
-- ARGV: token, worker, now_ts, now_str, stream_ttl, default failure ttl, max ttl, notice,
--       then per job: id, value (base64 zlib reason), exc_info (zlib reason), seq, chunk
-- Every key it writes is fitted before its first write (see fit): a job fails whole.
-- Returns {'lease'} | {'oom'} | per job {id, 'failed' | 'canceled' | 'refused', what was
--   replaced ('' for nothing; see heal)}, then {'', 'keys', notes} when its WIP list was
--   replaced.
local alive, wip, failed, canceled = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token, worker, now_ts, now_str = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local stream_ttl, failure_ttl, max_ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local notice = ARGV[8]
if lease(alive) ~= token then return {'lease'} end
local shared = {}
fit(shared, wip, 'list')
local out, probed = {}, false
for i = 9, #ARGV, 5 do
  local id = ARGV[i]
  local jk = jkey(id)
  local o = origin(id)
  local note, record = heal(id, wip, {'status', 'queued', 'mlxq_owner', worker}, nil,
                            {{okey(o, K_FAILED, failed), 'zset'},
                             {okey(o, K_CANCELED, canceled), 'zset'}})
  local f = {}
  if record ~= 'foreign' then
    f = redis.call('HMGET', jk, 'status', 'mlxq_owner', 'failure_ttl', 'mlxq_cancel')
  end
  if f[2] ~= worker or f[1] ~= 'queued' then
    if f[2] ~= worker then redis.call('LREM', wip, 1, id) end
    out[#out + 1] = {id, 'refused', note}
  elseif not probed and is_oom(redis.pcall('HSET', jk, 'ended_at', now_str)) then
    return {'oom'}  -- the first write: nothing was written
  elseif f[4] == '1' then
    probed = true
    redis.call('LREM', wip, 1, id)
    mark_canceled(id, okey(o, K_CANCELED, canceled), f[3], now_ts, now_str, notice,
                  max_ttl)
    out[#out + 1] = {id, 'canceled', note}
  else
    probed = true
    redis.call('HSET', jk, 'status', 'failed', 'ended_at', now_str, 'exc_info', ARGV[i + 2])
    local ttl = record_ttl(f[3], failure_ttl, max_ttl)
    redis.call('DEL', K_STREAM .. id)  -- it never ran: anything there is not its own
    add_result(id, 2, worker, 'exc_string', ARGV[i + 1], nil, nil, now_ts, ttl)
    redis.call('ZADD', okey(o, K_FAILED, failed), now_ts + ttl, id)
    redis.call('EXPIRE', jk, ttl)
    write_chunk(id, ARGV[i + 3], ARGV[i + 4], stream_ttl, true)
    redis.call('LREM', wip, 1, id)
    out[#out + 1] = {id, 'failed', note}
  end
end
return shared_note(out, shared)
