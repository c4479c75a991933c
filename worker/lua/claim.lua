-- Claim jobs for a worker: move up to N more ids from the queue into its WIP list and read
-- what it needs of each, size-capped, never decompressing anything here.
-- Jobs another worker handed this one (its handed set) come first, then the queue's.
-- A worker serving several queues claims from each with its own call; every job keeps
-- its own queue (rq's ``origin``, set to the queue it was taken from should a rogue write
-- have changed it), whose registries its later scripts write.
-- KEYS: queue, wip, alive, canceled registry (the queue's), handed set
-- ARGV: token, worker, now_ts, now_str, n, max_data_bytes, failure_ttl_cap, notice, ids...
--   (ids: already moved into wip by a blocking BLMOVE, or found there by reconcile; one no
--   longer there is 'missing')
-- Returns {'lease'} when the worker's lease is not its own (it was declared dead: what it
-- was handed goes back to the queue's front), else one entry per id:
--   {id, 'ok', data, attempt, clean, enqueued_at, handed ('1' or ''), origin}
--   | {id, 'dup', status} | {id, 'mine', 'started'} (this worker's own started job)
--   | {id, 'missing'} | {id, 'canceled'} | {id, 'nodata'} | {id, 'toolarge', bytes}
--   | {id, 'bad', field=value}
--   | {id, 'broken', what} (its record was no hash: rebuilt as this worker's, to fail)
--   | {id, 'oom'} (not claimed: Redis refused the write)
--   | {'', 'wip', type} (this worker's WIP list was of that type: replaced)
--   | {'', 'queue', type} (the queue is of that type: nothing can be taken from it; it is
--     left as it is, a key the worker only reads)
--   | {'', 'keys', notes} (keys its jobs share were replaced: see fit).
local queue, wip, alive, canceled, handed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local token, worker, now_ts, now_str = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n, cap, max_ttl, notice = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local ids, seen, popped = {}, {}, {}

-- Whether another worker holds ``id`` in its WIP list now. An entry for a job it holds is
-- a duplicate; a queued job whose named owner no longer holds it (rq's own ``requeue`` of
-- a failed job keeps the last runner's name) is a job like any other. An owner's list of
-- another type holds nothing.
local function held_by(owner, id)
  local at = redis.pcall('LPOS', K_WIP .. owner, id)
  return not is_err(at) and at ~= false and at ~= nil
end
local queue_name = string.sub(queue, #K_QUEUE + 1)
for i = 9, #ARGV do
  if not seen[ARGV[i]] then ids[#ids + 1] = ARGV[i] end
  seen[ARGV[i]] = true
end

if lease(alive) ~= token then
  fit({}, queue, 'list')  -- a rogue write made it another type: it held no job
  for i = #ids, 1, -1 do
    if redis.pcall('LREM', wip, 1, ids[i]) == 1 then redis.call('LPUSH', queue, ids[i]) end
  end
  return {'lease'}
end
local shared = {}
fit(shared, handed, 'zset')
-- This worker's own list made another type (a rogue write) would make every claim raise,
-- for good: it goes (what it listed is lost; their records still name their owner).
local was = drop_wrong_type(wip, 'list')
-- An id passed in was in the WIP list when the caller read it; this worker's heartbeat may
-- have given it back to the queue since (handed here, left unclaimed): not its own now.
local out, passed = {}, ids
if was then out[1] = {'', 'wip', was} end
ids = {}
for _, id in ipairs(passed) do
  if redis.call('LPOS', wip, id) then ids[#ids + 1] = id else out[#out + 1] = {id, 'missing'} end
end
if n > 0 then
  for _, id in ipairs(redis.call('ZRANGE', handed, 0, n - 1)) do
    redis.call('ZREM', handed, id)
    if not seen[id] and redis.call('LPOS', wip, id) then
      ids[#ids + 1] = id
      seen[id] = true
      n = n - 1
    end
  end
end
for _ = 1, n do
  local id = redis.pcall('LMOVE', queue, wip, 'LEFT', 'RIGHT')
  if is_err(id) and string.find(id.err, 'WRONGTYPE', 1, true) then
    out[#out + 1] = {'', 'queue', redis.call('TYPE', queue)['ok']}
  end
  if is_err(id) or not id then break end
  ids[#ids + 1] = id
  popped[id] = true
end

for _, id in ipairs(ids) do
  local jk = jkey(id)
  -- A job taken from this queue is this queue's, whatever its record says (a rogue origin
  -- is set right below, once the claim is accepted).
  local o = origin(id) or queue_name
  if popped[id] then o = queue_name end
  local note, record = heal(id, wip, {'status', 'queued', 'mlxq_owner', worker}, nil,
                            {{okey(o, K_CANCELED, canceled), 'zset'}})
  local f = {}
  if record == 'ok' then
    f = redis.call('HMGET', jk, 'status', 'mlxq_owner', 'mlxq_attempt', 'mlxq_clean',
                   'mlxq_cancel', 'enqueued_at', 'failure_ttl', 'mlxq_handed')
    redis.call('ZREM', handed, id)  -- claimed (or dropped) here: never given back
  end
  local status, owner = f[1], f[2] or ''
  if record == 'rebuilt' then
    out[#out + 1] = {id, 'broken', note}  -- this worker's now, to fail by that reason
  elseif not status then  -- no record (HMGET gives false for a missing field), or foreign
    redis.call('LREM', wip, 1, id)
    out[#out + 1] = {id, 'missing'}
  elseif status == 'started' and owner == worker then
    -- This worker's own started job: a second entry for a job it runs, or (found in its
    -- WIP list after a failover) one whose end the new master lacks; the worker, which
    -- knows whether it still runs it, gives the latter back.
    redis.call('LREM', wip, 1, id)
    out[#out + 1] = {id, 'mine', status}
  elseif status ~= 'queued' or (owner ~= '' and owner ~= worker and held_by(owner, id)) then
    -- Another entry for a job that runs, ran, or another worker holds: drop this one.
    redis.call('LREM', wip, 1, id)
    out[#out + 1] = {id, 'dup', status}
  elseif f[5] == '1' then
    redis.call('LREM', wip, 1, id)
    mark_canceled(id, okey(o, K_CANCELED, canceled), f[7], now_ts, now_str, notice, max_ttl)
    out[#out + 1] = {id, 'canceled'}
  else
    local w = redis.pcall('HSET', jk, 'mlxq_owner', worker, 'origin', o)
    if is_err(w) then
      -- Not claimed after all: back to the queue's front, for whoever has memory.
      fit({}, okey(o, K_QUEUE, queue), 'list')
      redis.call('LREM', wip, 1, id)
      redis.call('LPUSH', okey(o, K_QUEUE, queue), id)
      out[#out + 1] = {id, 'oom'}
    else
      local attempt, clean = tonumber(f[3] or '0'), tonumber(f[4] or '0')
      local size = redis.call('HSTRLEN', jk, 'data')
      if attempt == nil or attempt < 0 or attempt ~= math.floor(attempt) then
        out[#out + 1] = {id, 'bad', 'mlxq_attempt=' .. string.sub(f[3], 1, 40)}
      elseif clean == nil or clean < 0 then
        out[#out + 1] = {id, 'bad', 'mlxq_clean=' .. string.sub(f[4], 1, 40)}
      elseif size == 0 then
        out[#out + 1] = {id, 'nodata'}
      elseif size > cap then
        out[#out + 1] = {id, 'toolarge', size}
      else
        out[#out + 1] = {id, 'ok', redis.call('HGET', jk, 'data'), attempt, clean, f[6] or '',
                         f[8] and '1' or '', o}
      end
    end
  end
end
return shared_note(out, shared)
