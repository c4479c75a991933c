-- Enqueue jobs as rq's enqueue_many does (each job's record, its id at the queue's tail,
-- the queue in rq's set of queues), after every check, so a submit lands whole or not at
-- all: never a record without its queue entry, never a live job overwritten.
-- An id whose job is still live (queued, started: not ended) is refused; one of an ended
-- job (its records not expired yet) starts a new job in its place, its old records (result
-- log, replay log, executions, registry entries) gone with it.
-- A live job whose record holds the same request (its `data` field's SHA-1) is no refusal:
-- a submit retried (its first reply lost, or its WAIT short of replicas) leaves it as it is,
-- queued once, and only counts the retry in its record (a write the caller's WAIT covers).
-- KEYS: queue, rq's set of queues
-- ARGV: max queued (-1: no cap), m, m more (id, request SHA-1) to check (the caller's later
--       slices), then per job: id, request SHA-1, number of fields, field, value...
-- Returns {'ok'} | {'queue', type} (the queue is of another type: a rogue write)
--   | {'full', jobs queued} | {'live', id, status} | {'taken', id, type} (its record's key
--   is no hash) | {'oom'} (nothing written).
local queue, queues = KEYS[1], KEYS[2]
local cap, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TYPE', queue)['ok']
if t ~= 'list' and t ~= 'none' then return {'queue', t} end

-- Why ``id`` cannot be a new job's ({'same'}: it is already this request's live job), or nil.
local function refused(id, sha)
  local jk = jkey(id)
  local kt = redis.call('TYPE', jk)['ok']
  if kt == 'none' then return nil end
  if kt ~= 'hash' then return {'taken', id, kt} end
  local status = redis.call('HGET', jk, 'status')
  if status and TERMINAL[status] then return nil end
  local data = redis.call('HGET', jk, 'data')
  if data and redis.sha1hex(data) == sha then return {'same'} end
  return {'live', id, status or ''}
end

for i = 3, 1 + 2 * m, 2 do
  local why = refused(ARGV[i], ARGV[i + 1])
  if why and why[1] ~= 'same' then return why end
end
local jobs, i = {}, 3 + 2 * m
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 2])
  local why = refused(id, ARGV[i + 1])
  if why and why[1] ~= 'same' then return why end
  jobs[#jobs + 1] = {id, i + 3, i + 2 + 2 * n, why ~= nil}
  i = i + 3 + 2 * n
end
local fresh = 0
for _, job in ipairs(jobs) do
  if not job[4] then fresh = fresh + 1 end
end
if cap >= 0 then
  local queued = redis.call('LLEN', queue)
  if queued + fresh > cap then return {'full', queued} end
end

-- The first write: refused for memory, nothing is written. A set of queues of another
-- type (a rogue write) only leaves this queue unlisted there: its jobs still run.
if is_oom(redis.pcall('SADD', queues, queue)) then return {'oom'} end
for _, job in ipairs(jobs) do
  local id = job[1]
  local jk = jkey(id)
  if job[4] then
    -- The same request, still live: left queued once; one write for the caller's WAIT.
    redis.call('HINCRBY', jk, 'mlxq_resubmits', 1)
  else
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
end
return {'ok'}
