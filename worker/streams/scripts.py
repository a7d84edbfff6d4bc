"""The Lua scripts of the worker: each makes one check-then-write step atomic on the server.

Each script runs on one Redis node, so on Cluster all of its KEYS must share a slot (the callers
check with ``worker.keys.same_slot`` and fall back to separate commands when they do not). Every
script that writes checks ownership first where a ``consumer`` is given: a worker that was paused
past the claim idle time must not answer (or dead-letter) an entry another consumer took over.

==================  =============================  ===========================================
script              KEYS                           ARGV
==================  =============================  ===========================================
:data:`RESULT_ACK`  reply stream, job stream       group, entry id, payload, maxlen, consumer,
                                                   reply TTL in s
:data:`DEAD_ACK`    dead stream, job stream        group, entry id, maxlen, consumer, result
                    [, reply stream]               payload, result maxlen, reply TTL in s,
                                                   field/value pairs...
:data:`RENEW`       job stream                     group, consumer, entry ids...
:data:`FORGET`      job stream                     group, consumer
:data:`HANDBACK`    job stream, hand-back hash     group, consumer, idle ms, hash TTL in ms,
                                                   entry ids...
==================  =============================  ===========================================
"""

from __future__ import annotations

#: Result write + ack in one atomic step.
#:
#: KEYS: reply stream, job stream. ARGV: group, entry id, payload, maxlen, consumer ('' = no
#: ownership check), reply TTL in s ('0' = none).
#:
#: Returns ``{1, result id}`` when written and acked, ``{2, holder}`` when another consumer
#: holds the entry (nothing done), ``{0, error}`` when the reply stream is unusable (wrong type,
#: OOM, ...): the entry stays pending, so a result is never acked away unwritten. A reply stream
#: with no TTL gets one (a late result after its client closed must not leave a key behind
#: forever); a TTL the client set is left alone.
RESULT_ACK = """
if ARGV[5] ~= '' then
  local p = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p > 0 and p[1][2] ~= ARGV[5] then return {2, p[1][2]} end
end
local id = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[3])
if type(id) == 'table' and id.err then return {0, id.err} end
if ARGV[6] ~= '0' and redis.call('TTL', KEYS[1]) == -1 then
  redis.call('EXPIRE', KEYS[1], ARGV[6])
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return {1, id}
"""

#: Dead-letter + (optional) producer's ``dead_letter`` result + ack in one atomic step.
#:
#: KEYS: dead stream, job stream[, reply stream]. ARGV: group, entry id, maxlen, consumer
#: ('' = no ownership check), result payload ('' for none), result maxlen, reply TTL in s, then
#: the dead letter's field/value pairs.
#:
#: Returns ``{1, note}`` when done (``note`` is the error of a result that could not be written:
#: that does not stop the dead-lettering), ``{2, holder}`` when another consumer holds the entry
#: (nothing done), ``{0, error}`` when the dead-letter ``XADD`` failed (the entry stays pending).
DEAD_ACK = """
if ARGV[4] ~= '' then
  local p = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p > 0 and p[1][2] ~= ARGV[4] then return {2, p[1][2]} end
end
local args = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*'}
for i = 8, #ARGV do args[#args + 1] = ARGV[i] end
local id = redis.pcall(unpack(args))
if type(id) == 'table' and id.err then return {0, id.err} end
local note = ''
if KEYS[3] and ARGV[5] ~= '' then
  local r = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'payload', ARGV[5])
  if type(r) == 'table' and r.err then
    note = r.err
  elseif ARGV[7] ~= '0' and redis.call('TTL', KEYS[3]) == -1 then
    redis.call('EXPIRE', KEYS[3], ARGV[7])
  end
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return {1, note}
"""

#: Lease renewal: reset the idle time (``XCLAIM ... JUSTID``, no delivery count bump) of the
#: given ids this consumer still owns, atomically with the ownership check, so another
#: consumer's ``XAUTOCLAIM`` cannot slip between the check and the claim.
#:
#: KEYS: job stream. ARGV: group, consumer, entry ids... Returns the renewed ids.
RENEW = """
local out = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = ARGV[i]
  end
end
return out
"""

#: Forget this consumer (``XGROUP DELCONSUMER``) when it holds nothing.
#:
#: KEYS: job stream. ARGV: group, consumer. Returns 1 when deleted, 0 when it still holds
#: entries, -1 when the stream or group is gone.
FORGET = """
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if type(p) == 'table' and p.err then return -1 end
if #p > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

#: Hand entries this consumer read but never started back to the group (a draining worker).
#:
#: KEYS: job stream, hand-back hash (``worker.keys.handback_key``). ARGV: group, consumer, idle
#: ms, hash TTL in ms, entry ids... Each id this consumer still owns gets ``XCLAIM ... IDLE
#: <idle ms> RETRYCOUNT <deliveries - 1> JUSTID``: it stays in this consumer's pending list but
#: looks idle far past any claim idle time, so the next ``XAUTOCLAIM`` of another worker takes it,
#: and the delivery that never ran is taken back from its count (the other worker's claim adds it
#: again), so a hand-back never moves a job toward isolation or the dead-letter stream. Then
#: ``HINCRBY`` of the consumer's field in the hand-back hash (+ ``PEXPIRE``) tells the other
#: workers to look now. Returns the ids handed back (an id another consumer took over is left
#: alone).
HANDBACK = """
local out = {}
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    local n = tonumber(p[1][4]) - 1
    if n < 0 then n = 0 end
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3],
               'RETRYCOUNT', n, 'JUSTID')
    out[#out + 1] = ARGV[i]
  end
end
if #out > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return out
"""

__all__ = ["DEAD_ACK", "FORGET", "HANDBACK", "RENEW", "RESULT_ACK"]
