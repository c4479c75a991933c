-- Retry a failed or canceled job: its original request runs again as a new attempt, queued
-- at the back of its own queue (rq's ``origin``) as a new submit is. Atomic against another
-- retry, a cancel and every worker script: a job is requeued once, and only once it ended.
-- Its record keeps its id, request and attempts so far (the next run is attempt n + 1, so a
-- listener tells its chunks from the last run's); what the last run left is cleared: its
-- registry entry, end time, cancel flag and owner, and its replay log, so a listener of the
-- new run never replays the old end. rq's result log keeps the old outcome until the new
-- run's lands on top. The attempts that failed so far are forgiven (``mlxq_clean``), so a
-- job that gave up after its worker died three times gets a full new set.
-- KEYS: rq's set of queues
-- ARGV: id, now_str
-- Returns 'nosuch' | 'active' (queued or running: nothing to retry) | 'finished'
--   | 'noqueue' (its origin names no queue, or its queue's list is another type)
--   | 'oom' (nothing written) | 'requeued'.
local queues = KEYS[1]
local id, now_str = ARGV[1], ARGV[2]
local jk = jkey(id)
if redis.call('TYPE', jk)['ok'] ~= 'hash' then return 'nosuch' end  -- or a rogue key
local f = redis.call('HMGET', jk, 'status', 'mlxq_attempt')
local status = f[1]
if not status then return 'nosuch' end  -- HMGET gives false for a missing field
if status == 'finished' then return 'finished' end
if not TERMINAL[status] then return 'active' end
local o = origin(id)
if not o then return 'noqueue' end
local qk = K_QUEUE .. o
local t = redis.call('TYPE', qk)['ok']
if t ~= 'list' and t ~= 'none' then return 'noqueue' end

-- The first write: refused only when Redis is out of memory, and then nothing is written.
if is_oom(redis.pcall('RPUSH', qk, id)) then return 'oom' end
redis.call('SADD', queues, qk)
redis.call('ZREM', K_FAILED .. o, id)
redis.call('ZREM', K_CANCELED .. o, id)
redis.call('HDEL', jk, 'started_at', 'ended_at', 'exc_info', 'mlxq_cancel', 'mlxq_owner',
           'mlxq_exec', 'mlxq_handed')
local attempts = tonumber(f[2] or '0')
if attempts == nil or attempts < 0 or attempts ~= math.floor(attempts) then attempts = 0 end
redis.call('HSET', jk, 'status', 'queued', 'enqueued_at', now_str, 'mlxq_attempt', attempts,
           'mlxq_clean', attempts)
redis.call('PERSIST', jk)  -- an ended job's record expires; a queued one's must not
redis.call('DEL', K_STREAM .. id)
return 'requeued'
