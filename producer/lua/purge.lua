-- Purge jobs of one queue in one state: each id given is taken out of the queue's list
-- (state 'queued') or the state's registry, and a job whose record still reads that
-- state is deleted with its result log, replay log and execution index (its listeners
-- are nudged: they find no such job). Atomic against the workers' claims and ends: a job
-- a worker claimed meanwhile is no longer in the list, one that ran meanwhile no longer
-- reads 'queued', so neither is touched. The caller passes the ids it listed (and had
-- confirmed), a slice per call, so a job that arrives after the listing stays.
-- KEYS: the queue's list (state 'queued') or the state's registry
-- ARGV: state ('queued' | 'failed' | 'finished' | 'canceled'), notice, ids...
-- Returns {jobs deleted, ''} | {0, type} when KEYS[1] holds another type (nothing done).
local box, state, notice = KEYS[1], ARGV[1], ARGV[2]
local list = state == 'queued'
local t = redis.call('TYPE', box)['ok']
if t ~= (list and 'list' or 'zset') and t ~= 'none' then return {0, t} end
local n = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local taken
  if list then taken = redis.call('LREM', box, 1, id) else taken = redis.call('ZREM', box, id) end
  if taken > 0 then
    local jk = jkey(id)
    local f = redis.pcall('HMGET', jk, 'status', 'mlxq_owner')
    local st = not is_err(f) and f[1]
    if st == 'stopped' then st = 'canceled' end  -- rq's word for it
    -- A queued record with an owner is some worker's (an entry left over): not touched.
    if st == state and not (list and f[2]) then
      redis.call('DEL', jk, K_RESULTS .. id, K_STREAM .. id, K_EXECUTIONS .. id,
                 jk .. ':dependents')
      redis.call('PUBLISH', K_CHANNEL .. id, notice)
      n = n + 1
    end
  end
end
return {n, ''}
