-- Give back jobs another worker handed this one that it has not claimed within the grace
-- (it stayed full): to the queue's front, in the order they were handed, for any worker.
-- KEYS: alive, handed, wip, queue; ARGV: token, cutoff ms (handed before it go back)
-- Returns how many went back.
local alive, handed, wip, queue = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if lease(alive) ~= ARGV[1] then return 0 end
return give_back(handed, wip, queue, ARGV[2], 256)  -- the rest at the next beat
