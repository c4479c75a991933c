-- A worker's heartbeat: keep its lease, or learn that it lost it; and stay on its rolls.
-- KEYS: alive, roll, reaped marker, the rolls of its other queues...; ARGV: token, name,
--       lease ms
-- Returns {verdict, notes}: verdict 'ok' (lease kept), 'renewed' (it had lapsed, or was
-- made another type, but nobody took this worker's jobs: they are still its own) or
-- 'reaped' (declared dead: it owns nothing any more, and nothing is written); notes: what
-- was replaced ('' for nothing: see fit).
local alive, marker = KEYS[1], KEYS[3]
local token, name, ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local notes, verdict = {}, 'ok'
if lease(alive) == token then
  redis.call('PEXPIRE', alive, ms)  -- not refused under OOM: heartbeats keep priority
else
  if redis.call('EXISTS', marker) == 1 then return {'reaped', ''} end
  fit(notes, alive, 'string')
  redis.call('SET', alive, token, 'PX', ms)
  verdict = 'renewed'
end
-- Every beat puts this worker on the rolls the reapers walk: a roll made another type is
-- replaced, and one deleted is whole again within a beat of each live worker.
for i = 2, #KEYS do
  if i ~= 3 then
    fit(notes, KEYS[i], 'set')
    redis.pcall('SADD', KEYS[i], name)  -- refused for memory: the next beat adds it
  end
end
return {verdict, table.concat(notes, '; ')}
