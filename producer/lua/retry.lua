-- Requeue an ended job (failed or canceled) as a new attempt of its original request,
-- atomically against another retry, a purge and the workers (none holds an ended job).
-- Its request (rq's ``data``) and its run count (``mlxq_attempt``) stay: the next run is
-- attempt n + 1, numbering its chunks past the old run's and opening with a ``reset``,
-- so a listener that showed the old text clears it and none ever sees a mix. The old
-- replay log goes at once: a listener arriving before the new run sees only that run.
-- The runs so far count as clean hand-backs (``mlxq_clean``), so the retried job has the
-- whole budget of failed runs again, and ``enqueued_at`` is now (its ``ttl`` counts anew).
-- KEYS: rq's set of queues
-- ARGV: id, now_str, notice
-- Returns 'requeued' | 'nosuch' | 'oom' | 'noqueue' (its record names no queue)
--   | 'badqueue' (its queue's key holds another type) | its status when that is neither
--   failed nor canceled ('queued', 'started', 'finished', or whatever a rogue wrote).
local queues = KEYS[1]
local id, now_str, notice = ARGV[1], ARGV[2], ARGV[3]
local jk = jkey(id)
if redis.call('TYPE', jk)['ok'] ~= 'hash' then return 'nosuch' end
local f = redis.call('HMGET', jk, 'status', 'mlxq_attempt')
local status = f[1]
if not status then return 'nosuch' end  -- HMGET gives false for a missing field
if status ~= 'failed' and status ~= 'canceled' and status ~= 'stopped' then return status end
local o = origin(id)
if not o then return 'noqueue' end
local queue = K_QUEUE .. o
local t = redis.call('TYPE', queue)['ok']
if t ~= 'list' and t ~= 'none' then return 'badqueue' end
if is_oom(redis.pcall('HSET', jk, 'status', 'queued', 'enqueued_at', now_str)) then
  return 'oom'  -- the first write: nothing was written
end
local runs = tonumber(f[2] or '0')
if runs ~= nil and runs >= 0 and runs == math.floor(runs) then
  redis.call('HSET', jk, 'mlxq_clean', runs)
end  -- else left for the claim to fail it by its bad mlxq_attempt
redis.call('HDEL', jk, 'started_at', 'ended_at', 'exc_info', 'last_heartbeat', 'mlxq_owner',
           'mlxq_exec', 'mlxq_cancel', 'mlxq_handed')
redis.call('PERSIST', jk)  -- an ended record expires; a queued one waits as long as it takes
redis.pcall('ZREM', K_FAILED .. o, id)  -- a registry of another type: a rogue's, left alone
redis.pcall('ZREM', K_CANCELED .. o, id)
redis.call('DEL', K_STREAM .. id)
redis.call('RPUSH', queue, id)
redis.call('SADD', queues, queue)
redis.call('PUBLISH', K_CHANNEL .. id, notice)
return 'requeued'
