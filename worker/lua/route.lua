-- Note which worker holds the conversations it just finished (their KV state is in its
-- prompt cache), so the jobs that continue them are handed to it.
-- KEYS: alive; ARGV: token, worker, ttl s, route keys...
-- Returns {'lease'} | {'ok'} (a key Redis refused, out of memory, is left unwritten).
if lease(KEYS[1]) ~= ARGV[1] then return {'lease'} end
local ttl = tonumber(ARGV[3])
for i = 4, #ARGV do redis.pcall('SET', ARGV[i], ARGV[2], 'EX', ttl) end
return {'ok'}
