"""The slot protocol of the 3FS backend: how a batch of slots is written and read back.

A slot on disk (``hf3fs_format``):  [ .. | head stamp | page bytes | trail stamp | .. ]

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
sequence number is the generation). With ``checksum`` the stamp also carries the page's CRC-32.

Scratch per slot (``SCRATCH_PER_PAGE`` bytes at ``k * SCRATCH_PER_PAGE`` for the k-th slot):
    [0, 64) head   [64, 128) trail   [128, 192) head read again
"""

from __future__ import annotations

import os
import zlib
from typing import NamedTuple

from hicached.arena import Arena
from hicached.backends.hf3fs.fds import FdTable
from hicached.backends.hf3fs.format import (
    HAS_CRC,
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

SCRATCH_PER_PAGE = 3 * STAMP_BYTES


class Failures(NamedTuple):
    """Per batch: ops that failed or came back short (``read``), slots that did not verify;
    ``dead``: the reads whose slot surely no longer holds the pointer's page (its head names
    another page, or the segment ends before it), as opposed to an I/O error or a torn read."""

    read: int
    verify: int
    dead: tuple[int, ...] = ()


def write_slots(io: SlotIO, arena: Arena, writes: list[tuple[int, int, int, Stamp]],
                checksum: bool) -> list[bool]:
    """Write ``writes`` = [(fd, slot_off, arena_off, stamp)]; True per slot when both phases
    completed. ``stamp.data_crc`` / ``flags`` are filled here when ``checksum``."""
    scratch = io.scratch("put")
    heads, bodies = [], []
    for n, (fd, slot_off, arena_off, stamp) in enumerate(writes):
        if checksum:
            stamp = stamp._replace(data_crc=zlib.crc32(arena.view(arena_off, stamp.page_bytes)),
                                   flags=stamp.flags | HAS_CRC)
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


def read_slots(io: SlotIO, arena: Arena, reads: list[tuple[int, Pointer, int]], page_bytes: int
               ) -> tuple[list[bool], Failures]:
    """Read ``reads`` = [(fd, pointer, arena_off)] into the arena and verify each slot; True
    per slot whose bytes in the arena are exactly the page the pointer names."""
    scratch = io.scratch("get")
    ops = [IOOp(fd, ptr.slot_off + HEAD_OFF, (
        Part(SCRATCH, k * SCRATCH_PER_PAGE, STAMP_BYTES), Part(ARENA, arena_off, page_bytes),
        Part(SCRATCH, k * SCRATCH_PER_PAGE + STAMP_BYTES, STAMP_BYTES)))
        for k, (fd, ptr, arena_off) in enumerate(reads)]
    short = bad = 0
    dead: list[int] = []
    heads: dict[int, tuple[bytes, Stamp]] = {}
    for k, r in enumerate(io.submit("get", False, ops)):
        if r != page_bytes + 2 * STAMP_BYTES:
            short += 1
            if 0 <= r < STAMP_BYTES:  # the file ends before the slot (truncated)
                dead.append(k)
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
    for k, r in zip(again, io.submit("get", False, checks)):
        base = k * SCRATCH_PER_PAGE + 2 * STAMP_BYTES
        raw, head = heads[k]
        if r != STAMP_BYTES or scratch[base:base + STAMP_BYTES] != raw or (
                head.flags & HAS_CRC and head.data_crc != zlib.crc32(
                    arena.view(reads[k][2], page_bytes))):
            bad += r == STAMP_BYTES
            short += r != STAMP_BYTES
            continue
        ok[k] = True
    return ok, Failures(short, bad, tuple(dead))


def read_pointed(io: SlotIO, arena: Arena, fds: FdTable, root: str, own_uuid: bytes,
                 reads: list[tuple[Pointer, int]], page_bytes: int, counters: dict
                 ) -> tuple[list[bool], set[int]]:
    """Open the segments of ``reads`` = [(pointer, arena offset)] and ``read_slots`` them
    (counting size mismatches and failures in ``counters``). Returns per read whether it
    verified, and the reads whose slot surely no longer holds the pointer's page
    (``Failures.dead``, or the segment file is gone)."""
    ok = [False] * len(reads)
    dead: set[int] = set()
    gone: set[tuple] = set()  # segments whose file is not there
    items, handles = [], {}
    try:
        for n, (ptr, arena_off) in enumerate(reads):
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
                items.append((n, handles[key].fd, ptr, arena_off))
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
    return ok, dead
