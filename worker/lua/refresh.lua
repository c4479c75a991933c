-- Keep rq's view of long-running jobs alive: their StartedJobRegistry scores and execution
-- records, so rq's own maintenance never counts them abandoned while this worker lives.
-- KEYS: alive, started, rq worker; ARGV: token, now_ts, now_str, ttl, then pairs: id, exec
-- Every key it writes is fitted first (see fit): a refresh never stops midway.
if lease(KEYS[1]) ~= ARGV[1] then return 'lease' end
local now_ts, now_str, ttl = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
fit({}, KEYS[3], 'hash')
for i = 5, #ARGV, 2 do
  local id, exec = ARGV[i], ARGV[i + 1]
  local o = origin(id)
  heal(id, nil, nil, exec, {{okey(o, K_STARTED, KEYS[2]), 'zset'}})
  local composite = id .. ':' .. exec
  redis.call('ZADD', okey(o, K_STARTED, KEYS[2]), 'XX', now_ts + ttl, composite)
  redis.call('ZADD', K_EXECUTIONS .. id, 'XX', now_ts + ttl + 60, exec)
  redis.call('EXPIRE', K_EXECUTIONS .. id, ttl + 60)
  redis.call('HSET', K_EXECUTION .. composite, 'last_heartbeat', now_ts)
  redis.call('EXPIRE', K_EXECUTION .. composite, ttl)
end
redis.call('HSET', KEYS[3], 'last_heartbeat', now_str)
return 'ok'
