-- Write a batch of chunks (every row's output since the last write) in one call.
-- KEYS: alive
-- ARGV: token, stream_ttl, then per chunk: id, seq, data, expire (1 = refresh the log's TTL)
-- Returns {'lease'} | {'ok', problems} | {'oom', index of the first chunk not written,
-- problems}; problems: a flat list of id, what ('dup' and 'ok' are not reported).
local token, ttl = ARGV[1], tonumber(ARGV[2])
if lease(KEYS[1]) ~= token then return {'lease'} end
local problems = {}
for i = 3, #ARGV, 4 do
  local id = ARGV[i]
  local how = write_chunk(id, ARGV[i + 1], ARGV[i + 2], ttl, ARGV[i + 3] == '1')
  if how == 'oom' then return {'oom', (i - 3) / 4 + 1, problems} end
  if how ~= 'ok' and how ~= 'dup' then
    problems[#problems + 1] = id
    problems[#problems + 1] = how
  end
end
return {'ok', problems}
