"""Adopting the arena a previous daemon left: its committed pages are L2 hits again.

A daemon stops (SIGTERM with ``on_stop = "keep"``, or a crash at any instant) and leaves
``<arena>`` (the page bytes), ``<arena>.meta`` (the journal: ``journal.py``) and maybe
``<arena>.presence``. The next daemon of the same state dir and geometry adopts them
(``Daemon.__init__`` decides: ``decide``), in this order:

1. The old presence file is marked closed (``presence.close_left``) before any slot is
   touched: a client of the old daemon stops reading tags there and joins the new one (which
   makes a new presence file: a new inode, so clients re-map).
2. The arena is mapped as it is (no re-allocation, no pre-fault), the journal read
   (``Journal.kept``: valid records in commit order; a torn one is counted and dropped), its
   records cleared, and a new incarnation begun: this daemon's slot tags start above every
   tag of the old one (``journal.first_gen``).
3. The index is rebuilt through its own operations, one path with a client's set: every table
   registered (``table_id``, ``mark_trailing``), each page's slot claimed
   (``SlabAllocator.claim``: its own slot is the one the next ``alloc`` gives) and reserved
   (``PageIndex.reserve``), chains linked (``link``: a parent is the adopted record of the
   namespace whose key fingerprint the child's record names),
   and all committed (``commit_many`` in commit order: recency, policy, quotas' bytes per
   namespace, the presence table and the journal follow, as for any set). Write-back pages the
   journal does not know in L3 are handed to the L3 tier as committed (``on_commit``: dirty
   again, so they are written).
4. Fences: a client of the old daemon may still copy into a slot it was handed (a
   reservation, a set-ahead slot) for up to half a reservation TTL after it got it. The
   journal stamps each slab when a slot of it is handed out (``Journal.handed_out``); every
   slot not adopted of a slab stamped within the last half TTL is fenced for half a TTL
   (``LeaseTable.fence_until``: unbound, pinned slots, freed when the fence ends), a slab with
   no adopted page as one slab-sized slot. Slots of other slabs were last handed out long
   enough ago that no old client writes them. Not fenced: adopted pages an old client was
   reading under a lease when its daemon died (a lease is not journaled); such a page is
   evicted and its slot reused only when the new daemon needs room, and the old client's copy
   finished long before in every case but a client stalled mid-copy across the whole restart;
   step 5 keeps that case right.
5. Reads of old clients: a client of the old daemon may still copy *from* the slots of a get
   it was leased, for up to half a lease TTL after it sent the get (``client/get.py``
   discards a get that took longer). Leases are not journaled, so every adopted page is
   pinned until half a lease TTL after the adoption (``LeaseTable.hold``: a lease of no
   session, ended by the sweep; ``read_window`` says how long), counted in ``/stats``
   ``adoption.held_pages`` and ``leases``. That is enough: every lease the old daemon granted
   was granted before it died, so before this adoption began, and its reads end within half
   a TTL of it; a pinned page is never evicted, flushed or its slot reused, so no writer is
   handed a slot an old client may still read. After a clean stop the window ends half a TTL
   after the recorded stop time (a stop long ago pins nothing). Why a pin rather than fencing
   an adopted slot when it is freed: eviction picks unpinned pages, so pressure evicts the
   pages set since the restart instead of draining the adopted ones into fences that no one
   can use before the same instant; the adopted pages stay hits meanwhile. A set that finds
   only pinned pages gets the answer it gets under any clients' leases (no room).

What is dropped, and counted by reason (``Adopted.dropped``): ``torn`` (check mismatch),
``long_key`` (a key longer than ``KEY_BYTES``: not inline in the record), ``table`` (a table
the journal could not name), ``slot`` (a record whose slot does not fit the arena or its
slab's class), ``duplicate`` (a key of a table seen twice: the first in commit order wins).
Counters of the past (hits, evictions, requests) start at zero; what is held comes back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from hicached.daemon.index import IN_L3, Entry, PageIndex
from hicached.daemon.journal import GRAIN, Kept
from hicached.daemon.slabs import stride_for
from hicached.errors import ArenaError

BATCH = 4096  # pages committed in one call while adopting


@dataclass
class Adopted:
    """What adoption did (``/stats``'s ``adoption``; zeros and a reason on a cold start)."""

    pages: int = 0
    bytes: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    cold_reason: str | None = None
    kept_on_stop: bool = False  # this daemon keeps the arena at a clean stop (on_stop = keep)
    clean: bool = False  # the previous daemon stopped cleanly (not a crash)
    fenced_slots: int = 0
    held_s: float = 0.0  # adopted pages pinned this long for old clients' reads (step 5)
    stopped_at: float = 0.0  # wall clock of the previous daemon's clean stop (0: a crash)
    geometry: dict[tuple[str, str], int] = field(default_factory=dict)  # table -> page bytes

    def stats(self) -> dict:
        """The ``/stats`` body of ``adoption``."""
        return {"pages": self.pages, "bytes": self.bytes, "dropped": dict(self.dropped),
                "seconds": round(self.seconds, 4), "cold_reason": self.cold_reason,
                "kept_on_stop": self.kept_on_stop,
                "held_pages": self.pages if self.held_s > 0 else 0,
                "held_s": round(self.held_s, 3)}

    def line(self) -> str:
        """The start-up log line."""
        if self.cold_reason is not None:
            return f"starting cold: {self.cold_reason}"
        dropped = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"
        return (f"adopted the kept arena ({'clean stop' if self.clean else 'after a crash'}): "
                f"{self.pages} pages, {self.bytes / (1 << 30):.2f} GiB in {self.seconds:.2f} s; "
                f"dropped: {dropped}; {self.fenced_slots} slots fenced")


def adopt(index: PageIndex, kept: Kept, fence, half_ttl_s: float,
          now: float | None = None) -> tuple[Adopted, list[Entry]]:
    """Rebuild ``index`` (fresh, empty) from ``kept`` (module docstring, steps 3 and 4);
    returns what was adopted and the adopted entries (for the L3 tier: those not in L3).
    ``fence(entries, seconds)``: keep those unbound slots from writers that long."""
    t0 = time.perf_counter()
    now = time.time() if now is None else now
    out = Adopted(clean=kept.clean, stopped_at=kept.stopped_at if kept.clean else 0.0)
    dropped = out.dropped
    if kept.torn:
        dropped["torn"] = kept.torn
    tables = []
    for t in kept.tables:
        if t is None:
            tables.append(None)
            continue
        ns, pool, trailing = t
        try:
            index.table_id((ns, pool))
        except ValueError:
            tables.append(None)
            continue
        if trailing:
            index.mark_trailing((ns, pool))
        tables.append((ns, pool))
    recs = kept.records
    alloc = index.alloc
    capacity = alloc.capacity_bytes
    entries: list[Entry] = []
    chain: list[tuple[int, int]] = []  # per entry: (parent's fingerprint, depth)
    at: dict[tuple[str, int], str] = {}  # (ns, the writer's key fingerprint) -> key
    seen: set[tuple[tuple[str, str], str]] = set()
    in_l3: list[bool] = []
    cols = [recs[name].tolist() for name in ("key_len", "table", "offset", "stride",
                                             "page_bytes", "flags", "fp", "parent",
                                             "depth")]
    raw = recs["key"].tolist()  # (bytes, trailing NULs stripped: cut at key_len below)

    def drop(why: str) -> None:
        dropped[why] = dropped.get(why, 0) + 1

    for n, tid, off, stride, page_bytes, flag, fp, parent, depth, kb in zip(*cols, raw):
        if not n:
            drop("long_key")
            continue
        table = tables[tid] if tid < len(tables) else None
        if table is None:
            drop("table")
            continue
        if (stride < GRAIN or stride != stride_for(page_bytes) or off < 0
                or off + stride > capacity or off % 64):
            drop("slot")
            continue
        try:
            key = kb.ljust(n, b"\0")[:n].decode()
        except UnicodeDecodeError:
            drop("slot")
            continue
        if (table, key) in seen:
            drop("duplicate")
            continue
        try:
            alloc.claim(off, stride)
        except ArenaError:
            drop("slot")
            continue
        e = index.reserve(table, key, page_bytes, stride)
        if e is None or e.slot_offset != off:  # (a fingerprint collision: 2^-64)
            if e is not None:
                index.abort(e)
            drop("duplicate")
            continue
        seen.add((table, key))
        entries.append(e)
        chain.append((parent, depth))
        in_l3.append(bool(flag & IN_L3))
        at[(table[0], fp)] = key
        out.geometry.setdefault(table, page_bytes)
    _link(index, entries, chain, at)
    for lo in range(0, len(entries), BATCH):
        index.commit_many(entries[lo:lo + BATCH])
    for e, known in zip(entries, in_l3):
        if known:
            e.in_l3 = True
    out.pages = len(entries)
    out.bytes = sum(e.page_bytes for e in entries)
    out.fenced_slots = _fence_handed_out(index, kept.stamps, now, half_ttl_s, fence)
    out.seconds = time.perf_counter() - t0
    return out, entries


def read_window(clean: bool, stopped_at: float, half_lease_s: float, now: float) -> float:
    """Seconds from ``now`` (wall clock) during which a client of the previous daemon may still
    read a slot leased to it (step 5): half a lease TTL after its clean stop at ``stopped_at``,
    or after ``now`` when it crashed (the instant of a crash is not known)."""
    if not clean:
        return half_lease_s
    return max(0.0, min(half_lease_s, stopped_at + half_lease_s - now))


def _link(index: PageIndex, entries: list[Entry], chain: list[tuple[int, int]],
          at: dict[tuple[str, int], str]) -> None:
    """The adopted keys' chains, before their commits (as a set links its pending keys): a
    run of entries each the child of the one before goes in one ``link`` call."""
    run: list[str] = []
    head: tuple[str, str | None, int] | None = None  # (ns, the run's parent, its depth)
    last_depth = -1

    def flush() -> None:
        if run and head is not None and (head[1] is not None or head[2] >= 0):
            index.link(head[0], run, head[1], head[2])

    for e, (parent, depth) in zip(entries, chain):
        ns = e.table[0]
        up = at.get((ns, parent)) if parent else None
        if (run and head is not None and head[0] == ns and up == run[-1]
                and (depth == last_depth + 1 if depth >= 0 else last_depth < 0)):
            run.append(e.key)
        elif not (run and run[-1] == e.key and head is not None and head[0] == ns):
            flush()  # (a key's page of another pool: linked with its first)
            run, head = [e.key], (ns, up, depth)
        last_depth = depth
    flush()


def _fence_handed_out(index: PageIndex, stamps: np.ndarray, now: float, half_ttl_s: float,
                      fence) -> int:
    """Fence the free slots of every slab stamped within ``half_ttl_s`` of ``now`` (step 4);
    the slots fenced."""
    alloc = index.alloc
    fenced: list[Entry] = []
    for s in np.flatnonzero(stamps > now - half_ttl_s).tolist():
        slab = alloc.slabs[s]
        if slab.stride == 0:  # no page adopted there: the whole slab, one slot
            alloc.claim(slab.offset, alloc.slab_bytes)
            e = index.reserve_unbound("", alloc.slab_bytes)
            if e is not None:
                fenced.append(e)
            continue
        if not slab.free:
            continue
        alloc.claim(slab.offset + slab.free[-1] * slab.stride, slab.stride)  # its slab on top:
        for _ in range(len(slab.free)):  # the next allocations of the class take its slots
            e = index.reserve_unbound("", slab.stride)
            if e is not None:
                fenced.append(e)
    if fenced:
        fence(fenced, half_ttl_s)
    return len(fenced)
