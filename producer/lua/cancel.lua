-- Cancel a job, atomically against the worker's start and end: a queued job is canceled at
-- once; a job a worker holds gets a durable cancel flag (its start and end scripts honour
-- it, so it WILL end canceled) and its worker a message. Ended jobs are left alone.
-- Every key it writes is fitted first (see fit), so a cancel either lands whole or not at
-- all: it never raises after writing, nor answers False for a job it canceled.
-- ARGV: id, now_ts, now_str, max ttl, notice
-- Returns 'nosuch' | 'ended' | 'canceled' | 'requested'.
local id = ARGV[1]
local jk = jkey(id)
local t = redis.call('TYPE', jk)['ok']
if t ~= 'hash' then return 'nosuch' end  -- none, or a rogue key of another type: no job
local f = redis.call('HMGET', jk, 'status', 'origin', 'mlxq_owner', 'failure_ttl')
local status, origin, owner = f[1], f[2] or '', f[3] or ''
if not status then return 'nosuch' end  -- HMGET gives false for a missing field
if TERMINAL[status] then return 'ended' end
if status == 'queued' then fit({}, K_CANCELED .. origin, 'zset') end
-- The first write: refused for memory, it raises before anything else is written.
redis.call('HSET', jk, 'mlxq_cancel', 1)
-- A queue of another type holds no job: one it names is not waiting there.
local removed = status == 'queued' and redis.pcall('LREM', K_QUEUE .. origin, 0, id)
if type(removed) == 'number' and removed > 0 then
  mark_canceled(id, K_CANCELED .. origin, f[4], tonumber(ARGV[2]), ARGV[3], ARGV[5],
                tonumber(ARGV[4]))
  return 'canceled'
end
if owner ~= '' then redis.call('PUBLISH', K_CANCEL_CHANNEL .. owner, id) end
return 'requested'
