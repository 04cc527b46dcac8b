"""The tier controller: the daemon side of exists / set / get across L2 (arena) and L3 (backend).

Steps of the life of a page it owns (README, "Life of a page"):
  2. ``reserve``  slots for every pool of a set call (or "present" / "in flight" / "no space")
  4. ``commit``   publishes all pools' pages of the call at once, then hands them to L3 (5.)
  6. ``exists``   hit semantics over L2 then L3 (``hits.py``)
  7. ``lease``    pins slots for a get; pages only L3 has are loaded into the arena first by the
                  I/O workers while the request waits (parked), the control loop keeps serving
  8. eviction happens inside ``PageIndex.reserve`` when a class is full

Only the control loop calls into this object (single thread); the I/O workers only run backend
calls and hand finished jobs back through ``IOWorkers.collect``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from hicached import protocol as P
from hicached.backends.base import L3Backend, NullBackend
from hicached.errors import PageSizeMismatch, ProtocolError, UnknownPool
from hicached.hits import intersect_endpoints, leading_run
from hicached.index import Entry, PageIndex, TableId
from hicached.leases import LeaseTable
from hicached.workers import IOJob, IOWorkers

log = logging.getLogger(__name__)


def namespace_digest(namespace: str) -> str:
    """Stable, filesystem-safe id of a namespace string (never Python's ``hash``)."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32]


class PoolSpec(NamedTuple):
    page_bytes: int
    stride: int


@dataclass
class Session:
    """One connected client: its namespace (fixed at the handshake) and registered pools."""

    id: int
    namespace: str
    ns: str  # digest
    pid: int
    name: str
    pools: dict[str, PoolSpec] = field(default_factory=dict)

    def spec(self, pool: str) -> PoolSpec:
        try:
            return self.pools[pool]
        except KeyError:
            raise UnknownPool(
                f"pool {pool!r} is not registered by this client (registered: "
                f"{sorted(self.pools)}); call register_mem_host_pool_v2 first"
            ) from None


@dataclass
class ParkedGet:
    """A Lease waiting for L3 loads; answered through ``reply`` once ``jobs`` is empty."""

    session: Session
    msg: P.Lease
    reply: Callable[[P.Leased], None]
    jobs: set[int] = field(default_factory=set)


class Controller:
    """L2 bookkeeping plus L3 write-through and loads. See the module docstring."""

    def __init__(self, index: PageIndex, leases: LeaseTable, backend: L3Backend | None,
                 workers: IOWorkers | None, clock: Callable[[], float]):
        self.index = index
        self.leases = leases
        self.backend = backend or NullBackend()
        self.workers = workers
        self.clock = clock
        self.sessions: dict[int, Session] = {}
        self.geometry: dict[TableId, int] = {}  # (ns, pool) -> page_bytes, fixed once seen
        self._session_ids = itertools.count(1)
        self._loading: dict[tuple[TableId, str], IOJob] = {}
        self.counters = {"hits": 0, "misses": 0, "l3_loads": 0, "l3_writes": 0,
                         "l3_write_failures": 0, "l3_writes_dropped": 0, "no_space": 0}

    @property
    def has_l3(self) -> bool:
        return not isinstance(self.backend, NullBackend) and self.workers is not None

    # ------------------------------------------------------------ sessions and pools

    def open_session(self, hello: P.Hello) -> Session:
        if not hello.namespace:
            raise ProtocolError("namespace must be a non-empty string")
        s = Session(next(self._session_ids), hello.namespace, namespace_digest(hello.namespace),
                    hello.pid, hello.client_name)
        self.sessions[s.id] = s
        return s

    def close_session(self, sid: int) -> None:
        if self.sessions.pop(sid, None) is not None:
            self.leases.drop_session(sid)

    def reap_dead_sessions(self) -> int:
        """Drop sessions whose client process is gone (same host); returns how many."""
        dead = []
        for s in self.sessions.values():
            try:
                os.kill(s.pid, 0)
            except ProcessLookupError:
                dead.append(s.id)
            except PermissionError:
                pass  # alive, another user
        for sid in dead:
            log.info("client pid %d is gone: releasing its reservations and leases",
                     self.sessions[sid].pid)
            self.close_session(sid)
        return len(dead)

    def register_pool(self, s: Session, pool: str, page_bytes: int) -> None:
        if not pool:
            raise ProtocolError("pool name must be non-empty")
        stride = self.index.alloc.check_page_bytes(page_bytes)
        table = (s.ns, pool)
        known = self.geometry.setdefault(table, page_bytes)
        if known != page_bytes:
            raise PageSizeMismatch(
                f"pool {pool!r} of this namespace has pages of {known} bytes, "
                f"client registered {page_bytes} bytes (same namespace must mean same geometry)"
            )
        s.pools[pool] = PoolSpec(page_bytes, stride)

    # ------------------------------------------------------------ exists

    def _present(self, ns: str, pool: str, keys: list[str]) -> list[bool]:
        """Per key: in L2 (committed) or in L3."""
        table = self.index.tables.get((ns, pool))
        have = [k in table for k in keys] if table else [False] * len(keys)
        if self.has_l3 and not all(have):
            missing = [i for i, h in enumerate(have) if not h]
            for i, h in zip(missing, self.backend.exists(ns, pool, [keys[i] for i in missing])):
                have[i] = bool(h)
        return have

    def exists(self, s: Session, msg: P.Exists) -> P.ExistsResult:
        s.spec(msg.anchor)
        for q in msg.pools:
            s.spec(q.pool)
        kv_pages = leading_run(self._present(s.ns, msg.anchor, msg.keys))
        keys = msg.keys[:kv_pages]
        pools = [(q.pool, q.policy, q.window, self._present(s.ns, q.pool, keys)) for q in msg.pools]
        try:
            final, hits, restorable = intersect_endpoints(kv_pages, pools)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        if kv_pages:
            hits[msg.anchor] = kv_pages
        return P.ExistsResult(msg.req_id, final, hits, restorable)

    # ------------------------------------------------------------ set: reserve, commit

    def reserve(self, s: Session, msg: P.Reserve) -> P.Reserved:
        specs = [s.spec(t.pool) for t in msg.transfers]
        r = self.leases.new_reservation(s.id, self.clock())
        offsets = []
        for p, (t, spec) in enumerate(zip(msg.transfers, specs)):
            table = (s.ns, t.pool)
            committed = self.index.table(table)
            row = []
            for i, key in enumerate(t.keys):
                e = committed.get(key)
                if e is not None:
                    self.index.touch(e)
                    row.append(P.SLOT_PRESENT)
                elif self.index.get_pending(table, key) is not None:
                    row.append(P.SLOT_INFLIGHT)
                else:
                    e = self.index.reserve(table, key, spec.page_bytes, spec.stride)
                    if e is None:
                        self.counters["no_space"] += 1
                        row.append(P.SLOT_NO_SPACE)
                    else:
                        r.slots.append((p, i, e))
                        row.append(e.offset)
            offsets.append(row)
        if not r.slots:
            self.leases.take_reservation(r.id, s.id)
            return P.Reserved(msg.req_id, 0, offsets)
        return P.Reserved(msg.req_id, r.id, offsets)

    def commit(self, s: Session, msg: P.Commit) -> P.Committed:
        stored = [[False] * len(row) for row in msg.ok]
        r = self.leases.take_reservation(msg.reservation_id, s.id)
        if r is None:
            return P.Committed(msg.req_id, stored)  # expired (or foreign): nothing published
        done: list[Entry] = []
        for p, i, e in r.slots:
            ok = not msg.abort and p < len(msg.ok) and i < len(msg.ok[p]) and msg.ok[p][i]
            if ok:
                self.index.commit(e)
                stored[p][i] = True
                done.append(e)
            else:
                self.index.abort(e)
        if done and self.has_l3:
            self._write_through(done)
        return P.Committed(msg.req_id, stored)

    def _write_through(self, entries: list[Entry]) -> None:
        """Step 5: send committed pages L3 lacks to the writer thread (pinned until written)."""
        by_table: dict[TableId, list[Entry]] = {}
        for e in entries:
            if not e.in_l3:
                by_table.setdefault(e.table, []).append(e)
        for (ns, pool), group in by_table.items():
            there = self.backend.exists(ns, pool, [e.key for e in group])
            todo = []
            for e, have in zip(group, there):
                if have:
                    e.in_l3 = True
                else:
                    todo.append(e)
            if not todo:
                continue
            job = IOJob("put", ns, pool, [e.key for e in todo], [e.offset for e in todo],
                        todo[0].page_bytes, todo)
            for e in todo:
                self.index.pin(e)
            if not self.workers.submit(job):
                for e in todo:
                    self.index.unpin(e)
                self.counters["l3_writes_dropped"] += len(todo)

    # ------------------------------------------------------------ get: lease, release

    def lease(self, s: Session, msg: P.Lease, reply: Callable[[P.Leased], None],
              load: bool = True) -> P.Leased | None:
        """Lease every present page; park the request (answer later via ``reply``) when some
        pages are being loaded from L3."""
        for t in msg.transfers:
            s.spec(t.pool)
        parked = ParkedGet(s, msg, reply)
        offsets: list[list[int]] = []
        entries: list[Entry] = []
        for t in msg.transfers:
            table = (s.ns, t.pool)
            committed = self.index.tables.get(table) or {}
            row = []
            missing = []
            for i, key in enumerate(t.keys):
                e = committed.get(key)
                if e is not None:
                    entries.append(e)
                    row.append(e.offset)
                else:
                    row.append(P.SLOT_MISS)
                    missing.append(i)
            if missing and load:
                self._start_loads(s, t, table, missing, parked)
            offsets.append(row)
        if parked.jobs:
            for e in entries:  # keep what is already here while the rest loads
                self.index.touch(e)
            return None
        return self._grant(s, msg.req_id, entries, offsets)

    def _start_loads(self, s: Session, t: P.PoolKeys, table: TableId, missing: list[int],
                     parked: ParkedGet) -> None:
        if not self.has_l3:
            return
        spec = s.spec(t.pool)
        keys = [t.keys[i] for i in missing]
        new: list[Entry] = []
        for key, there in zip(keys, self.backend.exists(s.ns, t.pool, keys)):
            job = self._loading.get((table, key))
            if job is not None:  # someone else's load of the same page: wait for it too
                job.waiters.append(parked)
                parked.jobs.add(id(job))
            elif there and self.index.get_pending(table, key) is None:
                e = self.index.reserve(table, key, spec.page_bytes, spec.stride)
                if e is not None:
                    new.append(e)
        if not new:
            return
        job = IOJob("get", s.ns, t.pool, [e.key for e in new], [e.offset for e in new],
                    spec.page_bytes, new, waiters=[parked])
        if not self.workers.submit(job):
            for e in new:
                self.index.abort(e)
            return
        parked.jobs.add(id(job))
        for e in new:
            self._loading[(table, e.key)] = job

    def _grant(self, s: Session, req_id: int, entries: list[Entry], offsets: list[list[int]]
               ) -> P.Leased:
        """Lease ``entries``. Counts pages served from L2 (a page loaded from L3 for this request
        is served from L2 too; ``l3_loads`` counts the loads)."""
        hits = len(entries)
        self.counters["hits"] += hits
        self.counters["misses"] += sum(len(row) for row in offsets) - hits
        if not entries:
            return P.Leased(req_id, 0, offsets)
        for e in entries:
            self.index.touch(e)
            e.hits += 1
        g = self.leases.new_lease(s.id, entries, self.clock())
        return P.Leased(req_id, g.id, offsets)

    def release(self, s: Session, lease_ids: list[int]) -> None:
        for lid in lease_ids:
            self.leases.release(lid, s.id)

    # ------------------------------------------------------------ I/O completions

    def on_io_done(self) -> None:
        """Apply finished L3 jobs: loaded pages become L2 pages; parked gets are answered."""
        for job in self.workers.collect():
            if job.kind == "put":
                for e, ok in zip(job.entries, job.result):
                    e.in_l3 = e.in_l3 or ok
                    self.index.unpin(e)
                ok_n = sum(job.result)
                self.counters["l3_writes"] += ok_n
                self.counters["l3_write_failures"] += len(job.result) - ok_n
                continue
            for e, ok in zip(job.entries, job.result):
                del self._loading[(e.table, e.key)]
                if ok:
                    e.in_l3 = True
                    self.index.commit(e)
                    self.counters["l3_loads"] += 1
                else:
                    self.index.abort(e)
            for parked in job.waiters:
                parked.jobs.discard(id(job))
                if not parked.jobs and parked.session.id in self.sessions:
                    parked.reply(self.lease(parked.session, parked.msg, parked.reply, load=False))

    # ------------------------------------------------------------ maintenance

    def flush(self, tier: str) -> int:
        """Drop unpinned L2 pages (``l2``), every L3 page (``l3``) or both (``all``)."""
        if tier not in ("l2", "l3", "all"):
            raise ProtocolError(f"unknown tier {tier!r}; valid: ['l2', 'l3', 'all']")
        n = 0
        if tier in ("l2", "all"):
            for table in list(self.index.tables.values()):
                n += self.index.drop(list(table.values()))
        if tier in ("l3", "all"):
            n += self.backend.clear()
        return n

    def stats(self) -> dict:
        pools: dict[str, int] = {}
        for (_, pool), table in self.index.tables.items():
            pools[pool] = pools.get(pool, 0) + len(table)
        return {
            "l2_pages": len(self.index),
            "l2_pages_by_pool": pools,
            "l2_used_bytes": self.index.alloc.used_bytes(),
            "arena_free_slabs": self.index.alloc.free_slab_count,
            "evictions": self.index.evictions,
            "reservations": len(self.leases.reservations),
            "leases": len(self.leases.leases),
            "expired_reservations": self.leases.expired_reservations,
            "expired_leases": self.leases.expired_leases,
            "sessions": len(self.sessions),
            "l3_backend": self.backend.name,
            "l3": self.backend.stats(),
            **self.counters,
        }

