"""Lua scripts of the Redis index (see :mod:`kvdepot.metadata.index.redis` for the layout).

Each script is atomic on the server. On Redis Cluster a script call may only
touch one slot, so the per-chunk scripts are *vectorised*: they take any number
of items and return one result per item. The index calls them once per item
(one slot each) on a cluster and once per batch on a single server, with the
same code and the same semantics.

Chunk fields are ``"n:<node>" -> "<tier> <epoch>"``; pending allocations are
``"<batch>:<deadline ms>:<node>"`` strings (a batch name holds no colon).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

Cmd = tuple[Any, ...]


class Script:
    """A Lua script called by EVALSHA (the index loads it on every primary)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def cmd(self, keys: Sequence[Any], args: Sequence[Any]) -> Cmd:
        """The EVALSHA command calling this script with ``keys`` and ``args``."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


# Redis's own clock in milliseconds, so that all metadata replicas agree.
_NOW = "local t = redis.call('TIME')\nlocal now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# Moves a node's current key set into its gc set (KEYS[3] -> KEYS[4]).
_RETIRE = """
local function retire()
  if redis.call('EXISTS', KEYS[3]) == 0 then return end
  if redis.call('EXISTS', KEYS[4]) == 1 then
    redis.call('SUNIONSTORE', KEYS[4], KEYS[4], KEYS[3])
    redis.call('DEL', KEYS[3])
  else
    redis.call('RENAME', KEYS[3], KEYS[4])
  end
end
"""

# -- node scripts: KEYS are one node's lease, epoch, keys, gc (one slot) --------

# ARGV: lease ms, address, grpc address, tiers json, instance, force ('1' or
# '0'), chunk keys... A live lease of another instance refuses the
# registration (unless forced): {0, its address, its lease's PTTL}, nothing
# changed. Else {1, new epoch} ({2, new epoch, old address} where a live lease
# of another instance was taken over). The new epoch is above every earlier
# one, and above the clock in ms, so that even after a partial index loss reset
# the counter it never repeats an old epoch. The old key set is retired (the
# caller cleans it up), so the key set always covers every chunk field the
# current epoch wrote.
REGISTER = Script(
    _NOW
    + _RETIRE
    + """
local held = redis.call('HMGET', KEYS[1], 'inst', 'address')
local took = nil
if held[2] and (held[1] or '') ~= ARGV[5] then
  if ARGV[6] ~= '1' then return {0, held[2], redis.call('PTTL', KEYS[1])} end
  took = held[2]
end
local e = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if e < now then e = now end
local es = string.format('%d', e)
redis.call('SET', KEYS[2], es)
retire()
for i = 7, #ARGV, 4000 do
  redis.call('SADD', KEYS[3], unpack(ARGV, i, math.min(i + 3999, #ARGV)))
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', es, 'address', ARGV[2], 'grpc', ARGV[3], 'tiers', ARGV[4],
  'inst', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if took then return {2, es, took} end
return {1, es}
"""
)

# KEYS: lease. ARGV: lease ms, tiers json ('' keeps them), transfer rates json
# ('' keeps them), the heartbeating registration's epoch ('' or '0': not
# checked). The epoch, 0 if the lease is gone (it is never revived: the node
# must register again), or minus the lease's epoch where that is not the one
# given (another instance registered since; the lease is not renewed).
HEARTBEAT = Script(
    """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e then return 0 end
if ARGV[4] and ARGV[4] ~= '' and ARGV[4] ~= '0' and ARGV[4] ~= e then return -tonumber(e) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'tiers', ARGV[2]) end
if ARGV[3] and ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'xfer', ARGV[3]) end
return e
"""
)

# KEYS: lease, keys. ARGV: chunk keys... Adds them to the live epoch's key set
# (before their chunk fields are written); the epoch, or nil if the node is dead.
CLAIM = Script(
    """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e then return false end
for i = 1, #ARGV, 4000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 3999, #ARGV)))
end
return e
"""
)

# KEYS: lease, keys. ARGV: epoch, chunk keys... Removes them from the key set;
# returns how many of them (duplicates counted) the epoch held.
FORGET = Script(
    """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
local n = 0
for i = 2, #ARGV do
  if redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 1 then n = n + 1 end
end
for i = 2, #ARGV, 4000 do
  redis.call('SREM', KEYS[2], unpack(ARGV, i, math.min(i + 3999, #ARGV)))
end
return n
"""
)

# Retires a dead node's key set; returns its last epoch, or -1 if the node
# registered again meanwhile.
REAP = Script(
    _RETIRE
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
retire()
return redis.call('GET', KEYS[2]) or '0'
"""
)

# -- registry scripts: KEYS[1] is the registry hash ------------------------------

# ARGV: node, epoch. Keeps the highest epoch seen.
NODES_SET = Script(
    """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v or tonumber(v) < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""
)

# ARGV: node, epoch. 1 if the entry (of that epoch or older) was deleted: of
# several reapers, exactly one gets 1 and counts the node as expired.
NODES_DEL = Script(
    """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and tonumber(v) <= tonumber(ARGV[2]) then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
"""
)

# -- vectorised chunk scripts: any number of items, one result each --------------

# KEYS: chunks. ARGV: field, epoch, then (size, tier) per chunk. Adds a replica
# of each; 1 where the chunk was created.
ADD = Script(
    """
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('HSETNX', KEYS[i], 'size', ARGV[1 + 2 * i])
  redis.call('HSET', KEYS[i], ARGV[1], ARGV[2 + 2 * i] .. ' ' .. ARGV[2])
end
return out
"""
)

# KEYS: chunks. ARGV: field, bound. Deletes the field where an epoch below
# ``bound`` wrote it: 2 where that emptied (and deleted) the chunk, 1 where
# only the field went, 0 where nothing changed.
DROP = Script(
    """
local out = {}
for i = 1, #KEYS do
  out[i] = 0
  local v = redis.call('HGET', KEYS[i], ARGV[1])
  if v and tonumber(string.match(v, ' (%d+)$')) < tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[i], ARGV[1])
    out[i] = 1
    if redis.call('HLEN', KEYS[i]) <= 1 then
      redis.call('DEL', KEYS[i])
      out[i] = 2
    end
  end
end
return out
"""
)

# KEYS: pending allocations. ARGV: batch, ttl ms, backstop ms, then a node per
# key. 1 where the key is now allocated to this batch, 0 where another live
# allocation holds it. The deadline is checked here, not left to Redis's
# expiry, so that an expired allocation stays countable until a reaper sees it.
ALLOC = Script(
    _NOW
    + """
local out = {}
for i = 1, #KEYS do
  local v = redis.call('GET', KEYS[i])
  local b, d
  if v then b, d = string.match(v, '^([^:]*):(%d+):') end
  if v and b ~= ARGV[1] and tonumber(d) > now then
    out[i] = 0
  else
    if b ~= ARGV[1] then
      local deadline = string.format('%d', now + tonumber(ARGV[2]))
      redis.call('SET', KEYS[i], ARGV[1] .. ':' .. deadline .. ':' .. ARGV[3 + i], 'PX', ARGV[3])
    end
    out[i] = 1
  end
end
return out
"""
)

# KEYS: (chunk, pending) per item. ARGV: node, field, "tier epoch", epoch, then
# a size per item. Drops the node's allocation and adds the replica; per item
# 2 * (chunk created) + (replica new to this epoch).
COMMIT = Script(
    """
local out = {}
for i = 1, #KEYS / 2 do
  local c, p = KEYS[2 * i - 1], KEYS[2 * i]
  local v = redis.call('GET', p)
  if v and string.match(v, '^[^:]*:%d+:(.*)$') == ARGV[1] then redis.call('DEL', p) end
  local created = redis.call('HSETNX', c, 'size', ARGV[4 + i])
  local old = redis.call('HGET', c, ARGV[2])
  redis.call('HSET', c, ARGV[2], ARGV[3])
  out[i] = created * 2 + 1
  if old and string.match(old, ' (%d+)$') == ARGV[4] then out[i] = created * 2 end
end
return out
"""
)

# KEYS: pending allocations. ARGV: node. 1 where the node's allocation went.
REVOKE = Script(
    """
local out = {}
for i = 1, #KEYS do
  out[i] = 0
  local v = redis.call('GET', KEYS[i])
  if v and string.match(v, '^[^:]*:%d+:(.*)$') == ARGV[1] then
    redis.call('DEL', KEYS[i])
    out[i] = 1
  end
end
return out
"""
)

# KEYS: pending allocations. ARGV: batch. 1 where the batch still held the key
# (it was never committed nor revoked): an expired allocation.
EXPIRE_ALLOC = Script(
    """
local out = {}
for i = 1, #KEYS do
  out[i] = 0
  local v = redis.call('GET', KEYS[i])
  if v and string.match(v, '^([^:]*):') == ARGV[1] then
    redis.call('DEL', KEYS[i])
    out[i] = 1
  end
end
return out
"""
)

# ARGV: groups of consecutive commands of one shape: the command, the count of
# its further arguments, those, then the group's keys, each ended by a
# newline (neither key prefixes nor node ids hold whitespace). A read-only
# pipeline as one script call: one argument and one reply for hundreds of
# commands, as redis-py spends far more per argument and per reply than Redis
# spends per command. Single server only: the keys span slots and, passed
# this way, are not declared (which only Redis Cluster requires).
READ_BATCH = Script(
    """
local out, k, a = {}, 0, 1
while a <= #ARGV do
  local cmd, n = ARGV[a], tonumber(ARGV[a + 1])
  local keys, pos = ARGV[a + 2 + n], 1
  while pos <= #keys do
    local e = string.find(keys, '\\n', pos, true)
    k = k + 1
    out[k] = redis.call(cmd, string.sub(keys, pos, e - 1), unpack(ARGV, a + 2, a + 1 + n))
    pos = e + 1
  end
  a = a + 3 + n
end
return out
"""
)

# KEYS: chunks. ARGV: field, epoch, tier. Where the field is a replica of that
# epoch, sets its tier (keeping the epoch); 1 where it changed.
RETIER = Script(
    """
local out = {}
for i = 1, #KEYS do
  out[i] = 0
  local v = redis.call('HGET', KEYS[i], ARGV[1])
  if v and string.match(v, ' (%d+)$') == ARGV[2] and v ~= ARGV[3] .. ' ' .. ARGV[2] then
    redis.call('HSET', KEYS[i], ARGV[1], ARGV[3] .. ' ' .. ARGV[2])
    out[i] = 1
  end
end
return out
"""
)

ALL = (
    REGISTER,
    HEARTBEAT,
    CLAIM,
    FORGET,
    REAP,
    NODES_SET,
    NODES_DEL,
    ADD,
    DROP,
    ALLOC,
    COMMIT,
    REVOKE,
    EXPIRE_ALLOC,
    READ_BATCH,
    RETIER,
)
