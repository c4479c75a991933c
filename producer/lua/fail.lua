-- Fail claimed jobs that never started (unreadable, invalid, past their ttl, too long for
-- the model): status FAILED with the reason, an error chunk for listeners.
-- KEYS: alive, wip, failed registry
-- ARGV: token, worker, now_ts, now_str, stream_ttl, default failure ttl, max ttl,
--       then per job: id, value (base64 zlib reason), exc_info (zlib reason), seq, chunk
-- Returns {'lease'} | {'oom'} | per job {id, 'failed' | 'refused'}.
local alive, wip, failed = KEYS[1], KEYS[2], KEYS[3]
local token, worker, now_ts, now_str = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local stream_ttl, failure_ttl, max_ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if redis.call('GET', alive) ~= token then return {'lease'} end
local out, probed = {}, false
for i = 8, #ARGV, 5 do
  local id = ARGV[i]
  local jk = jkey(id)
  local f = redis.call('HMGET', jk, 'status', 'mlxq_owner', 'failure_ttl')
  if f[2] ~= worker or f[1] ~= 'queued' then
    if f[2] ~= worker then redis.call('LREM', wip, 1, id) end
    out[#out + 1] = {id, 'refused'}
  else
    local w = redis.pcall('HSET', jk, 'status', 'failed', 'ended_at', now_str,
                          'exc_info', ARGV[i + 2])
    if not probed and is_oom(w) then return {'oom'} end
    probed = true
    local ttl = record_ttl(f[3], failure_ttl, max_ttl)
    local results = K_RESULTS .. id
    redis.call('DEL', K_STREAM .. id)  -- it never ran: anything there is not its own
    redis.call('XADD', results, 'MAXLEN', '~', 10, '*', 'type', 2, 'worker_name', worker,
               'exc_string', ARGV[i + 1], 'execution_ended_at', now_ts)
    redis.call('EXPIRE', results, ttl)
    redis.call('ZADD', failed, now_ts + ttl, id)
    redis.call('EXPIRE', jk, ttl)
    write_chunk(id, ARGV[i + 3], ARGV[i + 4], stream_ttl, true)
    redis.call('LREM', wip, 1, id)
    out[#out + 1] = {id, 'failed'}
  end
end
return out
