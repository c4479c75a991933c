-- Hand a job this worker claimed (and has not started) to the worker whose prompt cache
-- holds its conversation: out of this worker's WIP list into that one's, unclaimed (no
-- owner), noted in its handed set so it claims it next. Every check comes first; a job is
-- handed at most once, and only to a live worker with free rows that is not much busier
-- than this one (a chat's turns follow its cache, but never pile onto one worker while
-- another idles).
-- KEYS: alive, wip, to alive, to wip, to handed, to stats, the roll of workers of the job's
--       queue (the first queue's is passed; the job's own is read)
-- ARGV: token, worker, id, to name, now ms, handed set ttl ms, the most rows the other may
--       hold (running and buffered: its WIP list)
-- Returns 'ok' | 'lease' | 'gone' (no live worker of this queue) | 'full' (no free row)
--   | 'busy' | 'job'
--   (not this worker's unstarted job, or handed before) | 'keys' (a key of the wrong type)
--   | 'oom'.
local alive, wip, to_alive, to_wip, handed, to_stats, roll =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local token, worker, id, to = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if lease(alive) ~= token then return 'lease' end
drop_wrong_type(wip, 'list')  -- a rogue write made it another type: see claim.lua
local jk = jkey(id)
local f = redis.pcall('HMGET', jk, 'status', 'mlxq_owner', 'mlxq_cancel', 'mlxq_handed')
if is_err(f) or f[1] ~= 'queued' or f[2] ~= worker or f[3] == '1' or f[4] then return 'job' end
if not redis.call('LPOS', wip, id) then return 'job' end
if to == worker or not lease(to_alive) then return 'gone' end
local serves = redis.pcall('SISMEMBER', okey(origin(id), K_ROLL, roll), to)  -- a worker of another queue: never
if is_err(serves) or serves == 0 then return 'gone' end
for k, want in pairs({[to_wip] = 'list', [handed] = 'zset'}) do
  local t = redis.call('TYPE', k)['ok']
  if t ~= want and t ~= 'none' then return 'keys' end
end
-- What it holds now is its WIP list, exactly; its stats are up to a second old (a worker
-- that just ended the turns handed to it would still read as holding them). Its rows are
-- its last stats' free and held ones together, a sum the hand-offs below keep.
f = redis.pcall('HMGET', to_stats, 'room', 'load')
if is_err(f) then return 'full' end
local holds = redis.call('LLEN', to_wip)
if (tonumber(f[1]) or 0) + (tonumber(f[2]) or 0) - holds < 1 then return 'full' end
if holds > tonumber(ARGV[7]) then return 'busy' end
if is_err(redis.pcall('HSET', jk, 'mlxq_handed', to)) then return 'oom' end
redis.call('HDEL', jk, 'mlxq_owner')
redis.call('LREM', wip, 1, id)
redis.call('RPUSH', to_wip, id)
redis.call('ZADD', handed, tonumber(ARGV[5]), id)
redis.call('PEXPIRE', handed, tonumber(ARGV[6]))
-- Until its next stats say otherwise, it has one row less and one job more.
redis.pcall('HINCRBY', to_stats, 'room', -1)
redis.pcall('HINCRBY', to_stats, 'load', 1)
return 'ok'
