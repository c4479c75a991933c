-- Enqueue jobs as rq's enqueue_many does (each job's record, its id at the queue's tail,
-- the queue in rq's set of queues), after every check, so a submit lands whole or not at
-- all: never a record without its queue entry, never a live job overwritten.
-- An id whose job is still live (queued, started: not ended) is refused; one of an ended
-- job (its records not expired yet) starts a new job in its place, its old records (result
-- log, replay log, executions, registry entries) gone with it.
-- KEYS: queue, rq's set of queues
-- ARGV: max queued (-1: no cap), m, m more ids to check (the caller's later slices), then
--       per job: id, number of fields, field, value...
-- Returns {'ok'} | {'queue', type} (the queue is of another type: a rogue write)
--   | {'full', jobs queued} | {'live', id, status} | {'taken', id, type} (its record's key
--   is no hash) | {'oom'} (nothing written).
local queue, queues = KEYS[1], KEYS[2]
local cap, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TYPE', queue)['ok']
if t ~= 'list' and t ~= 'none' then return {'queue', t} end

-- Why ``id`` cannot be a new job's, or nil.
local function refused(id)
  local jk = jkey(id)
  local kt = redis.call('TYPE', jk)['ok']
  if kt == 'none' then return nil end
  if kt ~= 'hash' then return {'taken', id, kt} end
  local status = redis.call('HGET', jk, 'status')
  if status and TERMINAL[status] then return nil end
  return {'live', id, status or ''}
end

for i = 3, 2 + m do
  local why = refused(ARGV[i])
  if why then return why end
end
local jobs, i = {}, 3 + m
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  local why = refused(id)
  if why then return why end
  jobs[#jobs + 1] = {id, i + 2, i + 1 + 2 * n}
  i = i + 2 + 2 * n
end
if cap >= 0 then
  local queued = redis.call('LLEN', queue)
  if queued + #jobs > cap then return {'full', queued} end
end

-- The first write: refused for memory, nothing is written. A set of queues of another
-- type (a rogue write) only leaves this queue unlisted there: its jobs still run.
if is_oom(redis.pcall('SADD', queues, queue)) then return {'oom'} end
for _, job in ipairs(jobs) do
  local id = job[1]
  local jk = jkey(id)
  local old = redis.pcall('HGET', jk, 'origin')
  if redis.call('EXISTS', jk) == 1 then  -- an ended job's: replaced whole
    redis.call('DEL', jk, K_RESULTS .. id, K_STREAM .. id, K_EXECUTIONS .. id)
    if type(old) == 'string' then
      for _, prefix in ipairs({K_FINISHED, K_FAILED, K_CANCELED}) do
        redis.pcall('ZREM', prefix .. old, id)
      end
    end
  end
  -- Refused for memory only as the first write (the set of queues was of another type):
  -- nothing of this submit is written but an ended job's records it replaces.
  if is_oom(redis.pcall('HSET', jk, unpack(ARGV, job[2], job[3]))) then return {'oom'} end
  redis.call('RPUSH', queue, id)
end
return {'ok'}
