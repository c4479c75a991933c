-- Shared by every mlxq script (prepended after the key header from keys.py).
--
-- Every job-state change mlxq makes is one of these scripts, so it is atomic. Scripts never
-- trust a hash field: numbers are parsed with fallbacks, unknown states are left alone, and
-- each job is handled on its own, so one rogue record never stops the others. A script's
-- first write is checked for OOM before anything else is written (Redis only refuses a
-- script's first write when out of memory; later ones go through), so an OOM refusal
-- leaves nothing half done and the caller retries in order.

local TERMINAL = {finished = true, failed = true, canceled = true, stopped = true}

local function jkey(id) return K_JOB .. id end

local function is_err(r) return type(r) == 'table' and r.err ~= nil end

local function is_oom(r) return is_err(r) and string.find(r.err, 'OOM', 1, true) ~= nil end

-- A record's TTL from a (possibly rogue) hash field: a positive whole number, capped.
local function record_ttl(v, default, cap)
  local n = tonumber(v)
  if n == nil or n <= 0 then n = default end
  if n > cap then n = cap end
  return math.floor(n)
end

-- Delete ``k`` when it holds another type than ``want``; returns that type, else nil.
local function drop_wrong_type(k, want)
  local t = redis.call('TYPE', k)['ok']
  if t ~= want and t ~= 'none' then
    redis.call('DEL', k)
    return t
  end
  return nil
end

-- A worker's lease (its token), or nil: none, or a key of another type (a rogue write),
-- which no token matches. Every script reads a lease through this: a worker whose own
-- lease was made another type finds it lost (its next beat rewrites it, unless it was
-- reaped meanwhile), and a reaper finds such a lease of another worker expired.
local function lease(k)
  local v = redis.pcall('GET', k)
  if type(v) == 'string' then return v end
  return nil
end

-- A key a script will write, made another type by a rogue write, makes that write raise,
-- and a script that raises midway keeps what it wrote before it (a status without its
-- TTL, an end without its last chunk). So every script fits each key it will write
-- before its first write: one of another type is deleted (it holds nothing of mlxq's or
-- rq's) and ``notes`` says so ('<key> was a <type>').
local function fit(notes, k, want)
  local t = drop_wrong_type(k, want)
  if t then notes[#notes + 1] = k .. ' was a ' .. t end
end

-- A job's keys made the wrong type (a rogue SET) make every write to them raise, and a
-- script that raises drops the writes of every other job it carries. So a script looks at
-- a job's keys before it writes them: its result log, execution index and execution of
-- another type are deleted, and so is each of ``more`` ({key, type} pairs: the registries
-- of its queue the script will write); its record, when it is no hash, is rebuilt from
-- ``fields``, but only for a job in ``wip`` (this worker's; ``wip`` nil: never). Returns
-- what was replaced ('' for nothing) and the record's state: 'ok', 'rebuilt' or 'foreign'
-- (no hash and not this worker's to rebuild: the caller must not touch it).
local function heal(id, wip, fields, exec, more)
  local notes = {}
  fit(notes, K_RESULTS .. id, 'stream')
  fit(notes, K_EXECUTIONS .. id, 'zset')
  if exec ~= nil and exec ~= '' then fit(notes, K_EXECUTION .. id .. ':' .. exec, 'hash') end
  for _, kw in ipairs(more or {}) do fit(notes, kw[1], kw[2]) end
  local jk = jkey(id)
  local t = redis.call('TYPE', jk)['ok']
  local record = 'ok'
  if t ~= 'hash' and t ~= 'none' then
    if wip ~= nil and redis.call('LPOS', wip, id) then
      redis.call('DEL', jk)
      redis.call('HSET', jk, unpack(fields))
      notes[#notes + 1] = 'its record ' .. jk .. ' was a ' .. t
      record = 'rebuilt'
    else
      record = 'foreign'
    end
  end
  return table.concat(notes, '; '), record
end

-- A call's notes on the keys its jobs share (its worker's own, a registry), as the last
-- entry of its reply: {'', 'keys', notes}; nothing when none was replaced.
local function shared_note(out, notes)
  if #notes > 0 then out[#out + 1] = {'', 'keys', table.concat(notes, '; ')} end
  return out
end

-- The opening of a worker's start or end of jobs: its lease checked, the keys all the
-- call's jobs share fitted (noted in ``shared``), then the first write, the worker's rq
-- heartbeat, refused whole when Redis is out of memory. Returns the script's answer when
-- it must stop there ({'lease'} or {'oom'}), else nil.
local function open_jobs(shared, alive, token, wip, rq_worker, worker_execs, now_str)
  if lease(alive) ~= token then return {'lease'} end
  fit(shared, wip, 'list')
  fit(shared, rq_worker, 'hash')
  fit(shared, worker_execs, 'set')
  if is_oom(redis.pcall('HSET', rq_worker, 'last_heartbeat', now_str)) then return {'oom'} end
  return nil
end

-- The queue job ``id`` came from: rq's ``origin`` in its record, or nil when that names no
-- queue (missing, empty, too long, control characters: a rogue write). The worker serves
-- several queues with one WIP list, so a job's registries are its own queue's.
local function origin(id)
  local o = redis.pcall('HGET', jkey(id), 'origin')
  if type(o) ~= 'string' or #o == 0 or #o > 128 or string.find(o, '%c') then return nil end
  return o
end

-- Key ``prefix`` (K_QUEUE, K_STARTED, ...) of queue ``o``, or ``default`` (the caller's own
-- queue's) when ``o`` is nil.
local function okey(o, prefix, default)
  if o then return prefix .. o end
  return default
end

-- Close a job's rq execution: its hash, its registry entries and the worker's index.
local function end_execution(id, exec, started, worker_execs)
  if exec == nil or exec == '' then return end
  local composite = id .. ':' .. exec
  redis.call('DEL', K_EXECUTION .. composite)
  redis.call('ZREM', started, composite)
  redis.call('ZREM', K_EXECUTIONS .. id, exec)
  if worker_execs ~= nil then redis.call('SREM', worker_execs, composite) end
end

-- Append a run's outcome to rq's result log of job ``id`` (rq's Result: ``kind`` 1 for a
-- return value, 2 for a failure, under ``field``), the log kept ``ttl`` seconds. ``exec``
-- nil: the job never ran, no execution is named.
local function add_result(id, kind, worker, field, value, exec, started_ts, ended_ts, ttl)
  local results = K_RESULTS .. id
  local entry = {'type', kind, 'worker_name', worker, field, value}
  if exec ~= nil then
    for _, v in ipairs({'execution_id', exec, 'execution_started_at', started_ts}) do
      entry[#entry + 1] = v
    end
  end
  entry[#entry + 1] = 'execution_ended_at'
  entry[#entry + 1] = ended_ts
  redis.call('XADD', results, 'MAXLEN', '~', 10, '*', unpack(entry))
  redis.call('EXPIRE', results, ttl)
end

-- Record a job as canceled (rq's CanceledJobRegistry) and nudge its listeners.
local function mark_canceled(id, origin_canceled, failure_ttl, now_ts, now_str, notice, max_ttl)
  local jk = jkey(id)
  redis.call('HSET', jk, 'status', 'canceled', 'ended_at', now_str)
  redis.call('ZADD', origin_canceled, now_ts, id)
  redis.call('EXPIRE', jk, record_ttl(failure_ttl, max_ttl, max_ttl))
  redis.call('PUBLISH', K_CHANNEL .. id, notice)
end

-- Append one chunk to a job's replay log, then publish it. Chunks of a job are written in
-- order, so an entry at or past ``seq`` that is not this very chunk is foreign (forged):
-- it is deleted and the log's last id set back, so the write goes through.
-- Returns 'ok', 'dup' (a retried write, already there), 'healed', 'oom' or an error text.
local function write_chunk(id, seq, data, ttl, expire)
  local stream, eid = K_STREAM .. id, '0-' .. seq
  local r = redis.pcall('XADD', stream, eid, 'c', data)
  local how = 'ok'
  if is_err(r) then
    if is_oom(r) then return 'oom' end
    if not string.find(r.err, 'equal or smaller', 1, true) then
      -- A rogue key in the log's place (another type): it fails this job; it must not
      -- outlive the log it stands for.
      redis.call('EXPIRE', stream, ttl)
      return r.err
    end
    local here = redis.call('XRANGE', stream, eid, eid)
    if #here == 1 and here[1][2][2] == data then
      how = 'dup'
    else
      for _, entry in ipairs(redis.call('XRANGE', stream, eid, '+')) do
        redis.call('XDEL', stream, entry[1])
      end
      local prev = '0-' .. (tonumber(seq) - 1)
      redis.call('XSETID', stream, prev, 'ENTRIESADDED', redis.call('XLEN', stream),
                 'MAXDELETEDID', prev)
      r = redis.pcall('XADD', stream, eid, 'c', data)
      if is_err(r) then return r.err end
      how = 'healed'
    end
  end
  if how ~= 'dup' then redis.call('PUBLISH', K_CHANNEL .. id, data) end
  if expire then redis.call('EXPIRE', stream, ttl) end
  return how
end

-- Give a held job back to the queue's front (or end it canceled when a cancel is pending).
-- ``owns(owner)`` says whether the caller may touch it. The caller fits the keys its jobs
-- share (``c.wip``, ``c.worker_execs``) first. Returns 'requeued', 'canceled', 'skipped'
-- (not the caller's, or already gone from ``wip``) or 'ended'.
local function requeue_one(id, c, owns, clean)
  local jk = jkey(id)
  local o = origin(id)
  local _, record = heal(id, c.wip, {'status', 'queued'}, nil,
                         {{okey(o, K_STARTED, c.started), 'zset'},
                          {okey(o, K_CANCELED, c.canceled), 'zset'},
                          {okey(o, K_QUEUE, c.queue), 'list'}})
  if record == 'foreign' then
    redis.call('LREM', c.wip, 1, id)
    return 'skipped'
  end
  local f = redis.call('HMGET', jk, 'status', 'mlxq_owner', 'mlxq_cancel', 'mlxq_exec',
                       'failure_ttl')
  local status, owner = f[1], f[2] or ''
  if not owns(owner) then
    redis.call('LREM', c.wip, 1, id)
    return 'skipped'
  end
  -- Not in the list: given back already (its owner went with it), or the list was
  -- replaced (a rogue write) while the caller, whom the record still names, held it.
  if redis.call('LREM', c.wip, 1, id) == 0 and owner == '' then return 'skipped' end
  if status == nil or TERMINAL[status] then return 'ended' end
  if status == 'started' then
    end_execution(id, f[4], okey(o, K_STARTED, c.started), c.worker_execs)
  end
  if f[3] == '1' then
    mark_canceled(id, okey(o, K_CANCELED, c.canceled), f[5], c.now_ts, c.now_str, c.notice,
                  c.max_ttl)
    return 'canceled'
  end
  redis.call('HSET', jk, 'status', 'queued')
  redis.call('HDEL', jk, 'mlxq_owner', 'mlxq_exec')
  if clean and status == 'started' then
    local n = tonumber(redis.call('HGET', jk, 'mlxq_clean')) or 0
    redis.call('HSET', jk, 'mlxq_clean', n + 1)
  end
  redis.call('LPUSH', okey(o, K_QUEUE, c.queue), id)
  return 'requeued'
end

-- Jobs another worker handed this one (``handed``) before ``cutoff`` ms and not claimed go
-- back to their queue's front (``queue`` when a record names none), in the order they were handed; returns how many. At most
-- ``most`` are looked at (-1: all), so a forged set cannot make a heartbeat long.
local function give_back(handed, wip, queue, cutoff, most)
  if drop_wrong_type(handed, 'zset') then return 0 end
  local ids = redis.call('ZRANGEBYSCORE', handed, '-inf', cutoff, 'LIMIT', 0, most)
  local n = 0
  for i = #ids, 1, -1 do
    local id = ids[i]
    local f = redis.pcall('HMGET', jkey(id), 'status', 'mlxq_owner')
    local unclaimed = not is_err(f) and f[1] == 'queued' and not f[2]
    local at = unclaimed and redis.pcall('LPOS', wip, id)
    if at and not is_err(at) then
      if is_err(redis.pcall('LPUSH', okey(origin(id), K_QUEUE, queue), id)) then break end  -- out of memory: next call
      redis.call('LREM', wip, 1, id)
      n = n + 1
    end
    redis.call('ZREM', handed, id)
  end
  return n
end
