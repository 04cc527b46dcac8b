"""The slot protocol of the 3FS backend: how a batch of slots is written and read back.

A slot on disk (``format.py``):  [ .. | head stamp | page bytes | trail stamp | .. ]

Write, two phases, each one batch on the "put" lane, the second only after the first returned:
    1. every head stamp (new generation): from now on the slot no longer verifies as its old
       page, before a single page byte changes;
    2. page bytes (from the arena) + trail stamp, one vectored op per slot.
Read, two phases on the "get" lane:
    1. one vectored op per slot: head -> scratch, page -> arena, trail -> scratch; the head must
       match the pointer (slot, generation, size, key hash, segment tag) and the trail must
       carry the head's fields;
    2. after every phase-1 op completed: the head again, byte for byte the same.
A page read that saw any byte of a later write sees that write's head in phase 2 (the writer
stamped it first), so a torn or recycled slot is a miss, never wrong bytes (a seqlock whose
sequence number is the generation).

Both stamps carry ``page_digest(seed, page bytes)``, the seed naming the page (namespace, pool,
key, size: ``integrity.identity_seed``, given per slot by the caller). The writer hashes each
page from the arena as it stamps it; a reader hashes each page right after its op brought it
into the arena (``IOOp.done``, on the reader's thread) and compares once phase 2 found the head
unchanged. Then a mismatch is no race with a writer: the slot's bytes changed under intact
stamps (bit rot, another key's page written there), so it is ``corrupt``. A slot whose stamps
carry no hash (written before hashes: ``format.HAS_HASH``) is ``unchecked``. Both are misses
and ``dead`` (the caller drops the pointer and stores the page again); nothing unverified is
ever a hit.

Scratch per slot (``SCRATCH_PER_PAGE`` bytes at ``k * SCRATCH_PER_PAGE`` for the k-th slot):
    [0, 64) head   [64, 128) trail   [128, 192) head read again
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

from hicached.arena import Arena
from hicached.backends.hf3fs.fds import FdTable
from hicached.backends.hf3fs.format import (
    HAS_HASH,
    HEAD_MAGIC,
    HEAD_OFF,
    PAGE_OFF,
    STAMP_BYTES,
    TRAIL_MAGIC,
    Pointer,
    Stamp,
    pack_stamp,
    segment_tag,
    unpack_stamp,
)
from hicached.backends.hf3fs.io import ARENA, SCRATCH, IOOp, Part, SlotIO
from hicached.backends.integrity import page_digest

SCRATCH_PER_PAGE = 3 * STAMP_BYTES


class Failures(NamedTuple):
    """Per batch: ops that failed or came back short (``read``), slots whose stamps did not
    verify (``verify``: torn, recycled); ``dead``: the reads whose slot surely no longer holds
    the pointer's page (its head names another page, the segment ends inside the slot, or one
    of the next two); ``corrupt``: stable stamps, page bytes that do not match their hash;
    ``unchecked``: a slot of the format without hashes."""

    read: int
    verify: int
    dead: tuple[int, ...] = ()
    corrupt: tuple[int, ...] = ()
    unchecked: tuple[int, ...] = ()


def write_slots(io: SlotIO, arena: Arena, writes: list[tuple[int, int, int, Stamp, int]]
                ) -> list[bool]:
    """Write ``writes`` = [(fd, slot_off, arena_off, stamp, seed)]; True per slot when both
    phases completed. ``stamp.data_hash`` / ``flags`` are filled here: the page's digest under
    ``seed`` (its identity), hashed as its stamps are made (the head that carries it must be
    on disk before any page byte is written, so this is as late as a page can be hashed)."""
    scratch = io.scratch("put")
    heads, bodies = [], []
    for n, (fd, slot_off, arena_off, stamp, seed) in enumerate(writes):
        stamp = stamp._replace(data_hash=page_digest(seed, arena.view(arena_off,
                                                                      stamp.page_bytes)),
                               flags=stamp.flags | HAS_HASH)
        base = n * SCRATCH_PER_PAGE
        scratch[base:base + STAMP_BYTES] = pack_stamp(HEAD_MAGIC, stamp)
        scratch[base + STAMP_BYTES:base + 2 * STAMP_BYTES] = pack_stamp(TRAIL_MAGIC, stamp)
        heads.append(IOOp(fd, slot_off + HEAD_OFF, (Part(SCRATCH, base, STAMP_BYTES),)))
        bodies.append(IOOp(fd, slot_off + PAGE_OFF, (
            Part(ARENA, arena_off, stamp.page_bytes),
            Part(SCRATCH, base + STAMP_BYTES, STAMP_BYTES))))
    ok = [r == op.nbytes for r, op in zip(io.submit("put", True, heads), heads)]
    todo = [n for n, good in enumerate(ok) if good]
    for n, r in zip(todo, io.submit("put", True, [bodies[n] for n in todo])):
        ok[n] = r == bodies[n].nbytes
    return ok


def stamp_matches(s: Stamp, ptr: Pointer) -> bool:
    """Does the stamp describe the page ``ptr`` names?"""
    return (s.slot == ptr.slot and s.gen == ptr.gen and s.page_bytes == ptr.page_bytes
            and s.key_hash == ptr.key_hash
            and s.seg_tag == segment_tag(ptr.node_uuid, ptr.seg))


def _hash_into(digests: list, k: int, view, seed: int) -> None:
    digests[k] = page_digest(seed, view)


def read_slots(io: SlotIO, arena: Arena, reads: list[tuple[int, Pointer, int, int]],
               page_bytes: int) -> tuple[list[bool], Failures]:
    """Read ``reads`` = [(fd, pointer, arena_off, seed)] into the arena and verify each slot;
    True per slot whose bytes in the arena are exactly the page the pointer names, with the
    digest its stamps carry under ``seed`` (the identity of the page the caller asks for)."""
    scratch = io.scratch("get")
    digests: list[int | None] = [None] * len(reads)
    ops = [IOOp(fd, ptr.slot_off + HEAD_OFF, (
        Part(SCRATCH, k * SCRATCH_PER_PAGE, STAMP_BYTES), Part(ARENA, arena_off, page_bytes),
        Part(SCRATCH, k * SCRATCH_PER_PAGE + STAMP_BYTES, STAMP_BYTES)),
        functools.partial(_hash_into, digests, k, arena.view(arena_off, page_bytes), seed))
        for k, (fd, ptr, arena_off, seed) in enumerate(reads)]
    short = bad = 0
    dead: list[int] = []
    heads: dict[int, tuple[bytes, Stamp]] = {}
    for k, r in enumerate(io.submit("get", False, ops)):
        if r != page_bytes + 2 * STAMP_BYTES:
            short += 1
            if r >= 0:  # the file ends before or inside the slot (cut short): never there
                dead.append(k)  # again (segments are sized once, at creation)
            continue
        raw = bytes(scratch[k * SCRATCH_PER_PAGE:k * SCRATCH_PER_PAGE + 2 * STAMP_BYTES])
        head = unpack_stamp(HEAD_MAGIC, raw)  # magic and CRC checked
        if head is not None and not stamp_matches(head, reads[k][1]):
            dead.append(k)  # the slot holds another page now
        if (head is None or raw[STAMP_BYTES:STAMP_BYTES + 4] != TRAIL_MAGIC
                or raw[4:STAMP_BYTES - 4] != raw[STAMP_BYTES + 4:-4]  # trail: same fields
                or not stamp_matches(head, reads[k][1])):
            bad += 1
            continue
        heads[k] = (raw[:STAMP_BYTES], head)
    again = list(heads)
    checks = [IOOp(reads[k][0], reads[k][1].slot_off + HEAD_OFF, (
        Part(SCRATCH, k * SCRATCH_PER_PAGE + 2 * STAMP_BYTES, STAMP_BYTES),)) for k in again]
    ok = [False] * len(reads)
    corrupt: list[int] = []
    unchecked: list[int] = []
    for k, r in zip(again, io.submit("get", False, checks)):
        base = k * SCRATCH_PER_PAGE + 2 * STAMP_BYTES
        raw, head = heads[k]
        if r != STAMP_BYTES:
            short += 1
        elif scratch[base:base + STAMP_BYTES] != raw:
            bad += 1  # a writer recycled the slot meanwhile: a torn read, not a bad copy
        elif not head.flags & HAS_HASH:
            unchecked.append(k)
        elif digests[k] != head.data_hash:
            corrupt.append(k)
        else:
            ok[k] = True
    return ok, Failures(short, bad, tuple(dead + unchecked + corrupt), tuple(corrupt),
                        tuple(unchecked))


def read_pointed(io: SlotIO, arena: Arena, fds: FdTable, root: str, own_uuid: bytes,
                 reads: list[tuple[Pointer, int, int]], page_bytes: int, counters: dict
                 ) -> tuple[list[bool], Failures]:
    """Open the segments of ``reads`` = [(pointer, arena offset, seed)] and ``read_slots`` them
    (counting size mismatches and failures in ``counters``). Returns per read whether it
    verified, and the ``Failures`` with indexes into ``reads``: ``dead`` also holds the reads
    whose segment file is gone."""
    ok = [False] * len(reads)
    dead: set[int] = set()
    gone: set[tuple] = set()  # segments whose file is not there
    items, handles = [], {}
    fails = Failures(0, 0)
    try:
        for n, (ptr, arena_off, seed) in enumerate(reads):
            if ptr.page_bytes != page_bytes:
                counters["size_mismatches"] += 1
                continue
            key = (ptr.node_uuid, ptr.seg)
            if key not in handles:
                try:
                    handles[key] = fds.acquire(key, os.path.join(root, ptr.segment_relpath()),
                                               writable=ptr.node_uuid == own_uuid)
                except FileNotFoundError:
                    handles[key] = None  # segment gone (retired, cleared): a miss
                    gone.add(key)
                except OSError:
                    handles[key] = None
            if key in gone:
                dead.add(n)
            if handles[key] is not None:
                items.append((n, handles[key].fd, ptr, arena_off, seed))
        ok_items, fails = read_slots(io, arena, [t[1:] for t in items], page_bytes)
        counters["read_failures"] += fails.read
        counters["verify_failures"] += fails.verify
    finally:
        for h in handles.values():
            if h is not None:
                fds.release(h)
    for (n, *_), good in zip(items, ok_items):
        ok[n] = good
    dead.update(items[k][0] for k in fails.dead)
    return ok, fails._replace(dead=tuple(sorted(dead)),
                              corrupt=tuple(items[k][0] for k in fails.corrupt),
                              unchecked=tuple(items[k][0] for k in fails.unchecked))
