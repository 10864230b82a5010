"""Lua scripts of the Redis index (see :mod:`kvdepot.metadata.index.redis` for the layout).

Each script is atomic on the server. On Redis Cluster a script call may only
touch one slot, so the per-chunk scripts are *vectorised*: they take any number
of items and return one result per item. The index calls them once per item
(one slot each) on a cluster and once per batch on a single server, with the
same code and the same semantics.

A chunk is a field of its bucket hash: the key's bytes after the bucket's
whole bytes -> a record of 6 bytes of size, then 7 bytes per replica: the
registration's epoch (6 bytes) and the tier code (1 byte), all big-endian.
Vectorised chunk scripts take their per-item fields, sizes and tiers as
columns: one argument each, the items' values concatenated at a fixed width.
Pending allocations are ``"<batch>:<deadline ms>:<node>"`` strings (a batch
name holds no colon).
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

# A record's replicas: 7 bytes each after the 6 bytes of size.
_RECORD = """
local function find(v, reg)
  for i = 7, #v, 7 do
    if string.sub(v, i, i + 5) == reg then return i end
  end
  return nil
end
local function col(s, i, w) return string.sub(s, (i - 1) * w + 1, i * w) end
"""

# -- registrations: KEYS on the registrations' own slot ----------------------------

# KEYS: last epoch handed out, epoch -> node map. ARGV: node, floor. A new
# registration epoch: above every epoch handed out, the clock in ms and the
# floor (the node's own last epoch), so that it never repeats, even after an
# index loss reset the counter. Mapped to its node before it can name a replica.
REG_NEW = Script(
    _NOW
    + """
local e = tonumber(redis.call('GET', KEYS[1]) or '0') + 1
if e < now then e = now end
if e <= tonumber(ARGV[2]) then e = tonumber(ARGV[2]) + 1 end
local es = string.format('%d', e)
redis.call('SET', KEYS[1], es)
redis.call('HSET', KEYS[2], es, ARGV[1])
return es
"""
)

# KEYS: ended registrations. ARGV: epoch, its replica count ('-1': unknown),
# node. Records that the registration ended, when first told (a count told
# later replaces an unknown one).
DEAD_ADD = Script(
    _NOW
    + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and (tonumber(ARGV[2]) < 0 or not string.find(v, '^%d+ %-1 ')) then return 0 end
local t = v and string.match(v, '^(%d+) ') or string.format('%d', now)
redis.call('HSET', KEYS[1], ARGV[1], t .. ' ' .. ARGV[2] .. ' ' .. ARGV[3])
return 1
"""
)

# KEYS: last epoch, map, ended registrations. What a sweep may delete:
# {last epoch, now ms, mapped epochs, ended registrations (flat hash)}.
SNAPSHOT = Script(
    _NOW
    + """
local last = redis.call('GET', KEYS[1]) or '0'
return {last, string.format('%d', now), redis.call('HKEYS', KEYS[2]),
  redis.call('HGETALL', KEYS[3])}
"""
)

# KEYS: map, ended registrations, swept counts. ARGV: epoch. Forgets an ended
# registration the sweep has cleared: {its ended record, replicas swept}, or
# nil where another replica did already.
RETIRE = Script(
    """
local d = redis.call('HGET', KEYS[2], ARGV[1])
if not d then return false end
local n = redis.call('HGET', KEYS[3], ARGV[1]) or '0'
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return {d, n}
"""
)

# -- node scripts: KEYS are one node's lease and registration record (one slot) ----

# KEYS: lease, record, digest. ARGV: lease ms, address, grpc address, tiers json,
# instance, force ('1' or '0'), the new epoch (from REG_NEW). A live lease of
# another instance refuses the registration (unless forced): {0, its address,
# its lease's PTTL}, nothing changed. An epoch not above the node's last one:
# {3, that one} (ask REG_NEW again with it as the floor). Else {1, the ended
# registration's epoch or '', its replica count, ''} ({2, …, old address}
# where a live lease of another instance was taken over). The replicas of
# the ended registration stop counting at once: their epoch is not the lease's.
# The node's digest starts again from nothing.
REGISTER = Script(
    """
local held = redis.call('HMGET', KEYS[1], 'inst', 'address')
local took = ''
if held[2] and (held[1] or '') ~= ARGV[5] then
  if ARGV[6] ~= '1' then return {0, held[2], redis.call('PTTL', KEYS[1])} end
  took = held[2]
end
local rec = redis.call('HMGET', KEYS[2], 'epoch', 'chunks')
if rec[1] and tonumber(rec[1]) >= tonumber(ARGV[7]) then return {3, rec[1]} end
local old, count = '', '0'
if rec[1] and rec[2] then old, count = rec[1], rec[2] end
redis.call('HSET', KEYS[2], 'epoch', ARGV[7], 'chunks', '0')
redis.call('DEL', KEYS[1])
if KEYS[3] then redis.call('DEL', KEYS[3]) end
redis.call('HSET', KEYS[1], 'epoch', ARGV[7], 'address', ARGV[2], 'grpc', ARGV[3],
  'tiers', ARGV[4], 'inst', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if took ~= '' then return {2, old, count, took} end
return {1, old, count, ''}
"""
)

# KEYS: lease[, digest]. ARGV: lease ms, tiers json ('' keeps them), transfer
# rates json ('' keeps them), the heartbeating registration's epoch ('' or
# '0': not checked)[, the node's held chunks and its digest's whole cell (16
# bytes)]. The epoch, 0 if the lease is gone (it is never revived: the node
# must register again), or minus the lease's epoch where that is not the one
# given (another instance registered since; the lease is not renewed). With
# the digest: {the epoch, the index's whole cell of the node}, and the lease
# keeps the held count and whether the cells were equal ('held', 'sync').
HEARTBEAT = Script(
    """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e then return 0 end
if ARGV[4] and ARGV[4] ~= '' and ARGV[4] ~= '0' and ARGV[4] ~= e then return -tonumber(e) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'tiers', ARGV[2]) end
if ARGV[3] and ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'xfer', ARGV[3]) end
if not KEYS[2] then return tonumber(e) end
local d = redis.call('GETRANGE', KEYS[2], 0, 15)
if #d < 16 then d = d .. string.rep('\\0', 16 - #d) end
redis.call('HSET', KEYS[1], 'held', ARGV[5], 'sync', d == ARGV[6] and '1' or '0')
return {tonumber(e), d}
"""
)

# KEYS: lease, record. ARGV: epoch, lease ms ('0': not renewed), replicas the
# registration gained (or lost). Where the lease carries that epoch: renews
# it, adds to its count and returns {1, count}; else {0} (lease gone) or
# {-1, the lease's epoch}.
PAGE = Script(
    """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e then return {0} end
if e ~= ARGV[1] then return {-1, e} end
if ARGV[2] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
local n = redis.call('HINCRBY', KEYS[2], 'chunks', ARGV[3])
return {1, n}
"""
)

# KEYS: lease, record[, digest]. ARGV: dead epoch (from the registry). Where
# that registration's lease is gone and it was not reaped yet: marks it reaped
# (and deletes its digest) and returns its replica count; else -1 (reaped
# already, or registered again).
REAP = Script(
    """
if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then return -1 end
local rec = redis.call('HMGET', KEYS[2], 'epoch', 'chunks')
if rec[1] ~= ARGV[1] or not rec[2] then return -1 end
redis.call('HDEL', KEYS[2], 'chunks')
if KEYS[3] then redis.call('DEL', KEYS[3]) end
return tonumber(rec[2])
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

# ARGV: node, epoch. 1 if the entry (of that epoch or older) was deleted.
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

# KEYS: a bucket per item. ARGV: epoch (6 bytes), field width, then columns of
# fields, sizes (6 bytes) and tier codes (1 byte). Adds each replica of the
# registration (a replica it had gets the tier given); per item
# 2 * (chunk created) + (replica new to the registration).
PAGE_ADD = Script(
    _RECORD
    + """
local reg, w, fs, ss, ts = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local out = {}
for i = 1, #KEYS do
  local f, t = col(fs, i, w), string.sub(ts, i, i)
  if redis.call('HSETNX', KEYS[i], f, col(ss, i, 6) .. reg .. t) == 1 then
    out[i] = 3
  else
    local v = redis.call('HGET', KEYS[i], f)
    local p = find(v, reg)
    out[i] = 0
    if not p then
      redis.call('HSET', KEYS[i], f, v .. reg .. t)
      out[i] = 1
    elseif string.sub(v, p + 6, p + 6) ~= t then
      redis.call('HSET', KEYS[i], f, string.sub(v, 1, p + 5) .. t .. string.sub(v, p + 7))
    end
  end
end
return out
"""
)

# KEYS: (bucket, pending) per item. ARGV: node, epoch (6 bytes), tier code,
# field width, then columns of fields and sizes. Drops the node's allocation
# and adds the replica (on the tier given); per item 2 * (chunk created) +
# (replica new to the registration).
COMMIT = Script(
    _RECORD
    + """
local reg, t, w, fs, ss = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local out = {}
for i = 1, #KEYS / 2 do
  local b, p, f = KEYS[2 * i - 1], KEYS[2 * i], col(fs, i, w)
  local a = redis.call('GET', p)
  if a and string.match(a, '^[^:]*:%d+:(.*)$') == ARGV[1] then redis.call('DEL', p) end
  local v = redis.call('HGET', b, f)
  if not v then
    redis.call('HSET', b, f, col(ss, i, 6) .. reg .. t)
    out[i] = 3
  else
    local at = find(v, reg)
    out[i] = 0
    if not at then
      redis.call('HSET', b, f, v .. reg .. t)
      out[i] = 1
    elseif string.sub(v, at + 6, at + 6) ~= t then
      redis.call('HSET', b, f, string.sub(v, 1, at + 5) .. t .. string.sub(v, at + 7))
    end
  end
end
return out
"""
)

# KEYS: a bucket per item. ARGV: epoch (6 bytes), field width, fields column.
# Deletes the registration's replica: 2 where that left the chunk without
# replicas (and deleted it), 1 where only the replica went, 0 where none was.
DROP = Script(
    _RECORD
    + """
local reg, w, fs = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local out = {}
for i = 1, #KEYS do
  local f = col(fs, i, w)
  local v = redis.call('HGET', KEYS[i], f)
  local p = v and find(v, reg)
  out[i] = 0
  if p then
    if #v == 13 then
      redis.call('HDEL', KEYS[i], f)
      out[i] = 2
    else
      redis.call('HSET', KEYS[i], f, string.sub(v, 1, p - 1) .. string.sub(v, p + 7))
      out[i] = 1
    end
  end
end
return out
"""
)

# KEYS: a bucket per item. ARGV: epoch (6 bytes), tier code, field width,
# fields column. Where the registration has a replica, sets its tier; 1 where
# that changed it.
RETIER = Script(
    _RECORD
    + """
local reg, t, w, fs = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local out = {}
for i = 1, #KEYS do
  local f = col(fs, i, w)
  local v = redis.call('HGET', KEYS[i], f)
  local p = v and find(v, reg)
  out[i] = 0
  if p and string.sub(v, p + 6, p + 6) ~= t then
    redis.call('HSET', KEYS[i], f, string.sub(v, 1, p + 5) .. t .. string.sub(v, p + 7))
    out[i] = 1
  end
end
return out
"""
)

# KEYS: buckets. ARGV: the last epoch handed out when the caller read the
# registrations, the epochs (6 bytes each, concatenated) of those that may
# still hold replicas then (live ones, and any not known to have ended).
# Deletes every replica of an epoch up to the last that is not kept: of an
# ended registration, or of one forgotten since. {chunks deleted (no replica
# left), then epoch (6 bytes), replicas deleted, for each epoch that lost some}.
# With ARGV[3] (a count > 0) it deletes nothing and answers {bucket, field,
# epoch} of up to that many replicas it would delete: the departure history
# records them before they go, so that a reader never finds one in neither.
SWEEP = Script(
    """
local last, seen = tonumber(ARGV[1]), {}
local want, lost = tonumber(ARGV[3] or '0'), {}
for i = 1, #ARGV[2], 6 do seen[string.sub(ARGV[2], i, i + 5)] = false end
local function ended(r)
  local v = seen[r]
  if v == nil then
    local a, b, c, d, e, f = string.byte(r, 1, 6)
    v = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f <= last
    seen[r] = v
  end
  return v
end
local dropped, chunks = {}, 0
for k = 1, #KEYS do
  local h = redis.call('HGETALL', KEYS[k])
  for j = 1, #h, 2 do
    local v, gone = h[j + 1], false
    for i = 7, #v, 7 do
      if ended(string.sub(v, i, i + 5)) then gone = true end
    end
    if gone then
      local kept = string.sub(v, 1, 6)
      for i = 7, #v, 7 do
        local r = string.sub(v, i, i + 5)
        if ended(r) then
          dropped[r] = (dropped[r] or 0) + 1
          if want > 0 then
            lost[#lost + 1] = KEYS[k]
            lost[#lost + 1] = h[j]
            lost[#lost + 1] = r
            if #lost >= 3 * want then return lost end
          end
        else kept = kept .. string.sub(v, i, i + 6) end
      end
      if want > 0 then  -- read only: told before they go
      elseif #kept == 6 then
        redis.call('HDEL', KEYS[k], h[j])
        chunks = chunks + 1
      else
        redis.call('HSET', KEYS[k], h[j], kept)
      end
    end
  end
end
if want > 0 then return lost end
local out = {chunks}
for r, n in pairs(dropped) do
  out[#out + 1] = r
  out[#out + 1] = n
end
return out
"""
)

# -- pending allocations ----------------------------------------------------------

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

# KEYS: pending allocations. ARGV: batch. The allocation's node where the
# batch still held the key (it was never committed nor revoked): an expired
# allocation; else 0.
EXPIRE_ALLOC = Script(
    """
local out = {}
for i = 1, #KEYS do
  out[i] = 0
  local v = redis.call('GET', KEYS[i])
  if v and string.match(v, '^([^:]*):') == ARGV[1] then
    redis.call('DEL', KEYS[i])
    out[i] = string.match(v, '^[^:]*:[^:]*:(.*)$') or ''
  end
end
return out
"""
)

# KEYS: one per command. ARGV: groups of consecutive commands of one shape:
# the command, how many commands, how many arguments each takes after its
# key, then those arguments, command by command. A read-only pipeline as one
# script call: one reply for hundreds of commands, as redis-py spends far
# more per reply than Redis spends per command. Single server only: the keys
# span slots.
READ_BATCH = Script(
    """
local out, k, a = {}, 0, 1
while a <= #ARGV do
  local cmd, n, m = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  for j = 1, n do
    k = k + 1
    out[k] = redis.call(cmd, KEYS[k], unpack(ARGV, a, a + m - 1))
    a = a + m
  end
end
return out
"""
)

# -- inventory digests (kvdepot.wire.digest): KEYS on one node's slot -------------
# A node's digest is a string of int64 cells (BITFIELD, big-endian): its whole
# count and sum, then each group's, then each bucket's (16 bytes a cell pair).
# Cells are only ever added to (OVERFLOW WRAP: sums are modulo 2^64): Lua's
# numbers are doubles, so the scripts pass int64s through as strings and
# compare cells as bytes.

_CELLS = """
local function cells(k, at, n)
  local s = redis.call('GETRANGE', k, at, at + n - 1)
  if #s < n then s = s .. string.rep('\\0', n - #s) end
  return s
end
local function incr(k, ops)
  for i = 1, #ops, 400 do
    redis.call('BITFIELD', k, 'OVERFLOW', 'WRAP', unpack(ops, i, math.min(#ops, i + 399)))
  end
end
"""

# KEYS: lease, record, digest. ARGV: epoch, replicas gained (or lost), then
# (cell index, delta) pairs. Where the lease carries that epoch: adds to the
# registration's count and to the cells; 1, else 0 (the deltas are dropped
# with the registration).
NODE_DELTA = Script(
    _CELLS
    + """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
if ARGV[2] ~= '0' then redis.call('HINCRBY', KEYS[2], 'chunks', ARGV[2]) end
local ops = {}
for i = 3, #ARGV, 2 do
  ops[#ops + 1] = 'INCRBY'
  ops[#ops + 1] = 'i64'
  ops[#ops + 1] = '#' .. ARGV[i]
  ops[#ops + 1] = ARGV[i + 1]
end
incr(KEYS[3], ops)
return 1
"""
)

# KEYS: lease, digest. ARGV: epoch, the node's 64 group cells (1024 bytes),
# offset of the groups' cells, of the buckets'. Where the lease carries that
# epoch: {1, the groups (from 0) whose cells differ, those groups' bucket
# cells concatenated}; else {0} (lease gone) or {-1, the lease's epoch}.
DIGEST_DIFF = Script(
    _CELLS
    + """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e then return {0} end
if e ~= ARGV[1] then return {-1, e} end
local mine, theirs, out, found = cells(KEYS[2], tonumber(ARGV[3]), 1024), ARGV[2], {}, {}
for g = 0, 63 do
  if string.sub(mine, g * 16 + 1, g * 16 + 16) ~= string.sub(theirs, g * 16 + 1, g * 16 + 16) then
    found[#found + 1] = g
    out[#out + 1] = cells(KEYS[2], tonumber(ARGV[4]) + g * 1024, 1024)
  end
end
return {1, found, table.concat(out)}
"""
)

# KEYS: lease, record, digest. ARGV: epoch, the cell indexes of a bucket's
# count, of its group's count, the bucket's cell pair as it was read (16
# bytes), then the count and sum deltas that make it right. Where the lease
# carries that epoch and the bucket's cells are still as read: adds the
# deltas to the bucket's, its group's and the whole cells and the count to
# the registration's; 1, else 0.
DIGEST_FIX = Script(
    _CELLS
    + """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
if cells(KEYS[3], tonumber(ARGV[2]) * 8, 16) ~= ARGV[4] then return 0 end
local ops = {}
for _, at in ipairs({tonumber(ARGV[2]), tonumber(ARGV[3]), 0}) do
  for _, v in ipairs({{at, ARGV[5]}, {at + 1, ARGV[6]}}) do
    ops[#ops + 1] = 'INCRBY'
    ops[#ops + 1] = 'i64'
    ops[#ops + 1] = '#' .. string.format('%d', v[1])
    ops[#ops + 1] = v[2]
  end
end
incr(KEYS[3], ops)
redis.call('HINCRBY', KEYS[2], 'chunks', ARGV[5])
return 1
"""
)

# KEYS: buckets. ARGV: epoch (6 bytes). Per bucket, the fields of the chunks
# that registration has a replica of.
BUCKET_KEYS = Script(
    """
local reg, out = ARGV[1], {}
for k = 1, #KEYS do
  local h, mine = redis.call('HGETALL', KEYS[k]), {}
  for j = 1, #h, 2 do
    local v = h[j + 1]
    for i = 7, #v, 7 do
      if string.sub(v, i, i + 5) == reg then
        mine[#mine + 1] = h[j]
        break
      end
    end
  end
  out[k] = mine
end
return out
"""
)

ALL = (
    REG_NEW,
    DEAD_ADD,
    SNAPSHOT,
    RETIRE,
    REGISTER,
    HEARTBEAT,
    PAGE,
    REAP,
    NODES_SET,
    NODES_DEL,
    PAGE_ADD,
    COMMIT,
    DROP,
    RETIER,
    SWEEP,
    ALLOC,
    REVOKE,
    EXPIRE_ALLOC,
    READ_BATCH,
    NODE_DELTA,
    DIGEST_DIFF,
    DIGEST_FIX,
    BUCKET_KEYS,
)
