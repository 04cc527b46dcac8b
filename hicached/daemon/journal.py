"""The journal of committed slots: what each committed arena slot holds, kept beside the arena
in shared memory (``<arena>.meta``), so that the next daemon can adopt the arena (``adoption.py``).

The arena lives in /dev/shm and outlives the daemon; what dies with the process is the index.
The journal is the part of the index a successor needs: for every committed slot, the key,
its table (namespace, pool), page bytes, stride, slot tag, chain parent and depth, and a commit
sequence. It is not the presence table (fingerprints only, and it may overflow).

    file    | header 4096 B | tables: MAX_TABLES x 256 B | slab stamps: slabs x f64 |
            | records: arena_bytes // GRAIN x 128 B |
    header  u64 words: magic, layout, arena bytes, slab bytes, grain, incarnation, state
            (RUNNING / CLEAN), stop time (f64 bits), tables used
    table   used, trailing (its pool holds states), ns length, pool length, ns, pool
    stamp   per slab: the wall-clock time a slot of it was last handed out (``handed_out``):
            after a crash, the slots a client of the old daemon may still write
    record  per GRAIN bytes of arena: the committed page whose slot starts in that span

    record  seq u64 | gen i64 | offset i64 | fp u64 | parent u64 | depth i32 | page_bytes u32
            | stride u32 | table u16 | key_len u8 | flags u8 | key 64 B | check u64

A chain is journaled as the writing process's key-table fingerprints (``Records.fp``: Python's
hash, seeded per process): the key's own (``fp``) and its parent's (``parent``, 0: none). A
successor links a record to the adopted record of its namespace whose ``fp`` is its
``parent``; every valid record was written by one process, since a successor journals what it
adopts again. A parent L2 does not hold names none, as today.

Why one record per ``GRAIN`` (4 KiB) of arena: a slot of stride >= GRAIN starts in a span of its
own (two such slots are at least GRAIN apart), so ``offset // GRAIN`` names it with no table to
search or grow, and the file's size is fixed by the arena's (128 B per 4 KiB: 3.1 %; room is
checked with the arena's, ``room.py``). Pages of a smaller stride (below a 4 KiB page of a
real model: tests and toy pools) are not journaled: they are never adopted (a restart loses
them, as before this journal).

What must stay true, and why a torn record is never adopted:

- **Valid from commit, in one numpy pass per call** (``write``, from ``Commits``; a few pages one
  by one, ``write_one``), before the presence table shows the pages and before the commit is
  answered: a commit a client was told of, or saw, is in the journal. The record's ``check`` (a
  multiply-sum over its other words, never 0) is zeroed first, the body written, ``check`` written
  last. A run of reservations (``Reservations``) writes its records' fixed part (key, table, slot,
  tag, sizes: what it has in hand) at once with the check 0 (``write_fixed``), and its commit only
  the rest and the check (``write_rest``): the same order of writes, cut in two, the record not
  valid in between (half the numpy calls of a commit). A daemon killed at any instant leaves each
  record either whole (its check matches) or not (check 0, or a body that does not match): such a
  slot is dropped. A process dying loses none of its stores to shared memory (they are the page
  cache's), so the order of writes is the whole argument; the checksum also turns away a record of
  another layout and random bytes.
- **Cleared before its slot is freed** (``clear``, from ``Records.free_page``; ``clear_many``,
  from ``Records.free_pages``, every record of an eviction's pass before its first slot is
  freed): eviction, flush, slab reclaim all free slots there, and a slot is handed out again only
  after it is freed. So a valid record always names a slot whose bytes are the committed page's:
  a committed slot is never written (clients write only reserved slots), and it is reserved again
  only after its record is cleared. Hence adopted pages are not verified against a hash: a crash cannot leave a
  committed page's bytes wrong, and a page whose commit was cut off has no valid record.
- **Flags** (in L3) are one byte outside the checksum (a byte store is never torn): ``in_l3``
  follows the index's flag, so write-back pages not yet written are written after adoption.
- **Recency**: ``seq`` is the commit tick (a crash restores commit order); a clean stop
  (``stop``) writes every committed page's exact last use.
- **Slot tags**: a cold daemon's generations start at random (as before this journal); a
  successor that adopts starts ``GEN_GAP`` above the newest tag the journal holds
  (``first_gen``): the old daemon's tags after its newest held commit (reservations, binds,
  pages committed and evicted since) would need 2**40 generations to reach it, so no tag an old
  client saw is valid again. The header's incarnation counts the daemons that used the file.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time
from array import array
from typing import NamedTuple

import numpy as np

from hicached.arena import adopt_mapped, create_mapped, keep_mapped, release_mapped
from hicached.daemon.entry import IN_L3, KEY_BYTES
from hicached.errors import ConfigError

MAGIC = int.from_bytes(b"HCJRNL01", "little")
LAYOUT = 1  # bumped whenever the file's format or the index's meaning of it changes
GRAIN = 4096  # arena bytes per record: pages of at least this stride are journaled
HEADER_BYTES = 4096
MAX_TABLES = 4096  # (namespace, pool) pairs a journal names; later ones are not journaled
TABLE_BYTES = 256
NS_BYTES, POOL_BYTES = 64, 184
GEN_GAP = 1 << 40  # an adopting daemon's first generation above the newest kept tag
RUNNING, CLEAN = 0, 1
H_MAGIC, H_LAYOUT, H_ARENA, H_SLAB, H_GRAIN, H_INCARNATION, H_STATE, H_STOPPED, H_TABLES = \
    range(9)

RECORD = np.dtype([
    ("seq", "<u8"), ("gen", "<i8"), ("offset", "<i8"), ("fp", "<u8"), ("parent", "<u8"),
    ("depth", "<i4"), ("page_bytes", "<u4"), ("stride", "<u4"), ("table", "<u2"),
    ("key_len", "u1"), ("flags", "u1"), ("key", f"S{KEY_BYTES}"), ("check", "<u8")])
assert RECORD.itemsize == 128
_WORDS = 15  # the words the check covers (all but ``check``; ``flags`` masked out)
_FLAGS_WORD, _FLAGS_MASK = 6, np.uint64(~(0xFF << 56) & (2**64 - 1))  # byte 55 of 48..55
_MULT = (np.arange(1, 2 * _WORDS, 2, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
_MULT_LIST = [int(m) for m in _MULT]
_M64 = (1 << 64) - 1
TABLE = np.dtype([("used", "u1"), ("trailing", "u1"), ("ns_len", "u1"), ("pool_len", "u1"),
                  ("_pad", "u4"), ("ns", f"S{NS_BYTES}"), ("pool", f"S{POOL_BYTES}")])
assert TABLE.itemsize == TABLE_BYTES


def file_bytes(arena_bytes: int, slab_bytes: int) -> int:
    """Bytes of the journal of an arena of this geometry (checked with the arena's room)."""
    return (HEADER_BYTES + MAX_TABLES * TABLE_BYTES + (arena_bytes // slab_bytes) * 8
            + (arena_bytes // GRAIN) * RECORD.itemsize)


def checks(body: np.ndarray) -> np.ndarray:
    """The ``check`` of each record of ``body`` (uint64 words, shape (n, 16)): a multiply-sum
    of its first 15 words, the flags byte left out; never 0 (0 marks a record not valid).
    (One product of matrices, its flags byte's share taken back: sums wrap modulo 2**64.)"""
    out = body[:, :_WORDS] @ _MULT
    out -= (body[:, _FLAGS_WORD] & ~_FLAGS_MASK) * _MULT[_FLAGS_WORD]
    out ^= out >> np.uint64(29)
    return np.maximum(out, 1, out=out)  # (0 -> 1)


def check_of(words: list[int]) -> int:
    """``checks`` of one record's first 15 words (Python ints), computed in Python."""
    w = list(words)
    w[_FLAGS_WORD] &= ~(0xFF << 56) & _M64
    x = sum(a * m for a, m in zip(w, _MULT_LIST)) & _M64
    x ^= x >> 29
    return x or 1


CRASH_ENV = "HICACHED_TEST_CRASH_AT"  # read by the CLI only (``ops/phases.py``)


class CrashPoint:
    """A test's SIGKILL of the daemon at a named instant of the journal's writes, off unless a
    test sets ``HICACHED_TEST_CRASH_AT=POINT[:N]`` (the CLI reads it; ``Daemon(crash_at=)``):

        commit   the Nth commit call's records are written, their checks not yet
        free     the Nth slot's record is cleared, the slot not yet freed (an eviction, a
                 flush, an abort)

    so that a test kills a daemon mid-commit, mid-eviction or mid-flush deterministically."""

    POINTS = ("commit", "free")

    def __init__(self, spec: str):
        name, _, count = spec.partition(":")
        if name not in self.POINTS or (count and not count.isdigit()) or count == "0":
            raise ConfigError(f"{CRASH_ENV}={spec!r}: expected POINT or POINT:N (N >= 1), "
                              f"POINT one of {list(self.POINTS)}")
        self.name = name
        self.left = int(count or 1)

    def reach(self, name: str) -> None:
        """The journal is at point ``name``: the process dies here the Nth time."""
        if name == self.name:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGKILL)


class Kept(NamedTuple):
    """What a journal held when it was opened (``Journal.kept``): the valid records in commit
    order, the tables, the slab stamps, how the last daemon stopped, and the records dropped."""

    records: np.ndarray  # RECORD, sorted by seq
    tables: list[tuple[str, str, bool] | None]  # journal table id -> (ns, pool, trailing)
    stamps: np.ndarray  # f64 per slab: the last hand-out of a slot of it (wall clock)
    clean: bool
    stopped_at: float
    torn: int  # records whose check did not match


def first_gen(kept: Kept | None) -> int | None:
    """Where an adopting daemon's slot generations start: ``GEN_GAP`` above the newest tag of
    ``kept`` (None: at random, a cold start or nothing kept)."""
    if kept is None or not len(kept.records):
        return None
    return int(kept.records["gen"].max()) + GEN_GAP


class Journal:
    """The journal file (module docstring). ``create`` makes a fresh one for a fresh arena;
    ``adopt`` opens the one a previous daemon left (geometry checked: ``mismatch``). Written
    only by the control loop: ``write`` (commit; or ``write_fixed`` at a run of reservations
    and ``write_rest`` at its commit), ``clear`` (before a free), ``set_in_l3``,
    ``handed_out`` (the allocator), ``stop`` (a clean exit). Not thread-safe."""

    def __init__(self, path: str, buf: mmap.mmap, arena_bytes: int, slab_bytes: int,
                 crash: CrashPoint | None = None):
        self.path = path
        self.crash = crash  # a test's kill at a named point (None: none)
        self.arena_bytes = arena_bytes
        self.slab_bytes = slab_bytes
        self._buf = buf
        self.header = np.frombuffer(buf, np.uint64, HEADER_BYTES // 8)
        at = HEADER_BYTES
        self.tables = np.frombuffer(buf, TABLE, MAX_TABLES, at)
        at += MAX_TABLES * TABLE_BYTES
        nslabs = arena_bytes // slab_bytes
        self.stamps = np.frombuffer(buf, np.float64, nslabs, at)
        at += nslabs * 8
        n = arena_bytes // GRAIN
        self.records = np.frombuffer(buf, RECORD, n, at)
        self.words = np.frombuffer(buf, np.uint64, n * 16, at).reshape(n, 16)
        self._check = memoryview(self.words).cast("B").cast("Q")  # one word a store
        self._flags = memoryview(np.frombuffer(buf, np.uint8, n * 128, at))
        self._stamp = memoryview(self.stamps)
        self._tids: dict[tuple[str, str], int] = {}  # (ns, pool) -> journal table id
        self.tables_used = int(self.header[H_TABLES])
        for t in range(self.tables_used):
            row = self.tables[t]
            if row["used"]:
                self._tids[(row["ns"][:row["ns_len"]].decode(),
                            row["pool"][:row["pool_len"]].decode())] = t
        self.closed = False

    # ------------------------------------------------------------ making and opening

    @classmethod
    def create(cls, path: str, arena_bytes: int, slab_bytes: int, incarnation: int,
               mode: int = 0o600, crash: CrashPoint | None = None) -> Journal:
        """A fresh, empty journal (replacing a stale one), for a fresh arena of this geometry;
        ArenaError as ``arena.create_mapped``."""
        buf = create_mapped(path, file_bytes(arena_bytes, slab_bytes), mode, "arena journal")
        j = cls(path, buf, arena_bytes, slab_bytes, crash)
        h = j.header
        h[H_MAGIC], h[H_LAYOUT], h[H_ARENA], h[H_SLAB] = MAGIC, LAYOUT, arena_bytes, slab_bytes
        h[H_GRAIN], h[H_INCARNATION], h[H_STATE] = GRAIN, incarnation, RUNNING
        return j

    @staticmethod
    def mismatch(path: str, arena_bytes: int, slab_bytes: int) -> str | None:
        """Why the journal at ``path`` cannot be adopted by a daemon of this geometry (one
        line naming the numbers), or None when it can."""
        try:
            with open(path, "rb") as f:
                head = f.read(9 * 8)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return f"no journal {path} beside the arena"
        except OSError as e:
            return f"cannot read the journal {path}: {e}"
        if len(head) < 9 * 8:
            return f"journal {path} is truncated ({size} bytes)"
        w = struct.unpack("<9Q", head)
        if w[H_MAGIC] != MAGIC or w[H_LAYOUT] != LAYOUT or w[H_GRAIN] != GRAIN:
            return (f"journal {path} has layout {w[H_LAYOUT]} (grain {w[H_GRAIN]}), this "
                    f"daemon writes layout {LAYOUT} (grain {GRAIN})")
        if w[H_ARENA] != arena_bytes:
            return (f"l2_size changed: the kept arena has {w[H_ARENA]} bytes, this daemon asks "
                    f"for {arena_bytes}")
        if w[H_SLAB] != slab_bytes:
            return (f"slab_size changed: the kept arena has slabs of {w[H_SLAB]} bytes, this "
                    f"daemon asks for {slab_bytes}")
        want = file_bytes(arena_bytes, slab_bytes)
        if size != want:
            return f"journal {path} has {size} bytes, expected {want}"
        return None

    @staticmethod
    def incarnation_at(path: str) -> int:
        """The incarnation of the journal at ``path`` (0: none, or not of this format): a
        cold start counts on from it, so its tags differ from those of every daemon before."""
        try:
            with open(path, "rb") as f:
                head = f.read(9 * 8)
        except OSError:
            return 0
        if len(head) < 9 * 8:
            return 0
        w = struct.unpack("<9Q", head)
        return w[H_INCARNATION] if w[H_MAGIC] == MAGIC and w[H_INCARNATION] < 1 << 22 else 0

    @classmethod
    def adopt(cls, path: str, arena_bytes: int, slab_bytes: int,
              crash: CrashPoint | None = None) -> Journal:
        """The journal a previous daemon left at ``path`` (``mismatch`` said None), mapped and
        locked; its incarnation is counted up and its state set RUNNING by ``begin``."""
        buf = adopt_mapped(path, file_bytes(arena_bytes, slab_bytes), "arena journal")
        return cls(path, buf, arena_bytes, slab_bytes, crash)

    @property
    def incarnation(self) -> int:
        """The daemons that used this file (this one included, once ``begin`` ran)."""
        return int(self.header[H_INCARNATION])

    def kept(self) -> Kept:
        """The valid records (commit order), the tables, the stamps, how it stopped."""
        h = self.header
        valid = self.words[:, 15] != 0
        idx = np.flatnonzero(valid)
        good = checks(self.words[idx]) == self.words[idx, 15]
        torn = int(len(idx) - np.count_nonzero(good))
        recs = self.records[idx[good]].copy()
        recs = recs[np.argsort(recs["seq"], kind="stable")]
        tables: list[tuple[str, str, bool] | None] = []
        for t in range(self.tables_used):
            row = self.tables[t]
            tables.append((row["ns"][:row["ns_len"]].decode(),
                           row["pool"][:row["pool_len"]].decode(), bool(row["trailing"]))
                          if row["used"] else None)
        stopped = float(np.array([h[H_STOPPED]], np.uint64).view(np.float64)[0])
        return Kept(recs, tables, self.stamps.copy(), int(h[H_STATE]) == CLEAN, stopped, torn)

    def begin(self) -> None:
        """This daemon takes the journal over (after adopting what ``kept`` said): a new
        incarnation, RUNNING (a crash from now on is seen as one), the stamps reset."""
        self.header[H_INCARNATION] += 1
        self.header[H_STATE] = RUNNING
        self.stamps[:] = 0

    def reset(self) -> None:
        """Forget every record and table (the arena's bytes are not adopted): a new
        incarnation all the same, so tags stay unique."""
        self.words[:] = 0
        self.tables[:] = np.zeros(1, TABLE)
        self.header[H_TABLES] = 0
        self._tids.clear()
        self.tables_used = 0
        self.begin()

    # ------------------------------------------------------------ the control loop's writes

    def table(self, ns: str, pool: str, trailing: bool = False) -> int:
        """The journal id of table (ns, pool), given on first use; -1 when it cannot be named
        (``MAX_TABLES`` used, or names too long): its pages are not journaled."""
        t = self._tids.get((ns, pool))
        if t is not None:
            if trailing and not self.tables[t]["trailing"]:
                self.tables["trailing"][t] = 1
            return t
        nsb, poolb = ns.encode(), pool.encode()
        if self.tables_used >= MAX_TABLES or len(nsb) > NS_BYTES or len(poolb) > POOL_BYTES:
            return -1
        t = self.tables_used
        self.tables[t] = (1, int(trailing), len(nsb), len(poolb), 0, nsb, poolb)
        self.tables_used = t + 1
        self.header[H_TABLES] = t + 1
        self._tids[(ns, pool)] = t
        return t

    def write(self, offsets: np.ndarray, body: np.ndarray) -> None:
        """Journal committed pages: records ``body`` (uint64 words, shape (n, 16); the last
        word ignored) at ``offsets`` (int64, strides >= GRAIN). Check zeroed, body written,
        check written last."""
        idx = offsets // GRAIN
        words = self.words
        words[idx, 15] = 0
        words[idx, :15] = body[:, :15]
        if self.crash is not None:
            self.crash.reach("commit")
        words[idx, 15] = checks(body)

    def write_fixed(self, offsets: np.ndarray, body: np.ndarray) -> None:
        """Slots just reserved at ``offsets``: their records' fixed part, ``body`` (uint64
        words, shape (n, 16); ``seq``, ``parent``, ``depth``, ``flags`` and ``check`` 0), the
        check zeroed first (it is already: a slot's record is cleared before its slot is
        freed). Not valid until ``write_rest`` writes the rest and the check at commit."""
        idx = offsets // GRAIN
        words = self.words
        words[idx, 15] = 0
        words[idx, :15] = body[:, :15]

    def write_rest(self, offsets: np.ndarray, seq: np.ndarray, parent: np.ndarray,
                   depth: np.ndarray, flags: np.ndarray) -> None:
        """Journal committed pages whose fixed part ``write_fixed`` wrote at their
        reservation: the rest of each record, then its check (last)."""
        idx = offsets // GRAIN
        recs = self.records
        recs["seq"][idx] = seq
        recs["parent"][idx] = parent
        recs["depth"][idx] = depth
        recs["flags"][idx] = flags
        if self.crash is not None:
            self.crash.reach("commit")
        words = self.words
        words[idx, 15] = checks(words[idx])

    def write_one(self, offset: int, words: list[int]) -> None:
        """``write`` of one record (its first 15 words as Python ints), without numpy: a
        commit of a few pages costs ~5 us a page here, where a numpy pass costs ~30."""
        at = (offset // GRAIN) * 16
        mv = self._check
        mv[at + 15] = 0
        mv[at:at + 15] = array("Q", words)
        if self.crash is not None:
            self.crash.reach("commit")
        mv[at + 15] = check_of(words)

    def clear(self, offset: int) -> None:
        """The slot at ``offset`` (stride >= GRAIN) is about to be freed: its record is no
        longer valid (before the free: the slot may be handed out right after)."""
        self._check[(offset // GRAIN) * 16 + 15] = 0
        if self.crash is not None:
            self.crash.reach("free")

    def clear_many(self, offsets: np.ndarray) -> None:
        """``clear`` of each of ``offsets`` (int64; strides >= GRAIN) at once. A test's kill at
        ``free`` counts each record (``crash``: cleared one by one)."""
        if self.crash is not None:
            for offset in offsets.tolist():
                self.clear(offset)
            return
        self.words[offsets // GRAIN, 15] = 0

    def set_in_l3(self, offset: int, on: bool) -> None:
        """The page at ``offset`` is (not) known to be in L3 (one byte: never torn)."""
        at = (offset // GRAIN) * 128 + 55
        f = self._flags[at]
        self._flags[at] = f | IN_L3 if on else f & ~IN_L3 & 0xFF

    def handed_out(self, slab_index: int) -> None:
        """A slot of slab ``slab_index`` was handed out now (a reservation, a set-ahead slot)."""
        self._stamp[slab_index] = time.time()

    def stop(self, used: np.ndarray, offsets: np.ndarray) -> None:
        """A clean stop that keeps the arena: the committed pages at ``offsets`` were last used
        at ticks ``used`` (their exact recency for the successor); the state CLEAN."""
        if len(offsets):
            idx = offsets // GRAIN
            valid = self.words[idx, 15] != 0
            idx, used = idx[valid], used[valid]
            self.words[idx, 15] = 0
            self.records["seq"][idx] = used.astype(np.uint64)
            self.words[idx, 15] = checks(self.words[idx])
        self.header[H_STOPPED] = np.array([time.time()], np.float64).view(np.uint64)[0]
        self.header[H_STATE] = CLEAN

    def close(self, keep: bool) -> None:
        """Unmap (the views stay valid until dropped); ``keep``: leave the file for the next
        daemon, else remove it. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        # the views dropped, the map goes with them (and with it the lock its file
        # descriptor, duplicated by mmap, holds): a successor in this process may take it
        self.header = self.tables = self.stamps = self.records = self.words = None
        self._check = self._flags = self._stamp = None
        self._buf = None
        if keep:
            keep_mapped(self.path)
        else:
            release_mapped(self.path)


class NullJournal:
    """No journal (pages never adopted): the index's calls cost nothing."""

    def table(self, ns: str, pool: str, trailing: bool = False) -> int:
        return -1

    def write(self, offsets: np.ndarray, body: np.ndarray) -> None:
        pass

    def write_one(self, offset: int, words: list[int]) -> None:
        pass

    def write_fixed(self, offsets: np.ndarray, body: np.ndarray) -> None:
        pass

    def write_rest(self, offsets: np.ndarray, seq: np.ndarray, parent: np.ndarray,
                   depth: np.ndarray, flags: np.ndarray) -> None:
        pass

    def clear(self, offset: int) -> None:
        pass

    def clear_many(self, offsets: np.ndarray) -> None:
        pass

    def set_in_l3(self, offset: int, on: bool) -> None:
        pass

    def handed_out(self, slab_index: int) -> None:
        pass
