-- A worker's heartbeat: keep its lease, or learn that it lost it.
-- KEYS: alive, roll, reaped marker, the rolls of its other queues...; ARGV: token, name,
--       lease ms
-- Returns 'ok' (lease kept), 'renewed' (it had lapsed but nobody took this worker's jobs:
-- they are still its own) or 'reaped' (declared dead: it owns nothing any more).
local alive, roll, marker = KEYS[1], KEYS[2], KEYS[3]
local token, name, ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('GET', alive) == token then
  redis.call('PEXPIRE', alive, ms)  -- not refused under OOM: heartbeats keep priority
  return 'ok'
end
if redis.call('EXISTS', marker) == 1 then return 'reaped' end
redis.call('SET', alive, token, 'PX', ms)
redis.call('SADD', roll, name)
for i = 4, #KEYS do redis.call('SADD', KEYS[i], name) end
return 'renewed'
