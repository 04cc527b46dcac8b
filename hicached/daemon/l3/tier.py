"""The L3 tier: the attached backend, the I/O workers and the policies that move pages between
the arena (L2) and the backend (L3).

    write policy              when a committed L2 page is sent to L3 (only pages L3 lacks: the
                              writer thread asks L3 which it has, off the control loop)
    write_through             at commit
    write_through_selective   when its gets reach ``threshold`` hits
    write_back                when L2 needs its room: a dirty page (L2 holds the only copy) is
                              pinned, so eviction passes over it; under pressure (dirty pages
                              above half the arena, or a reservation found no space) the least
                              recently used dirty pages are written until dirty pages are below
                              DIRTY_TARGET of the arena, and once written they are clean and
                              evictable

    loads                     a get for pages only L3 has reserves slots and queues one batched
                              load; the get waits (parked by the controller) for it. Keys not
                              known to be in L3 (``known_in_l3``) are first looked up by a
                              ``find`` job on the prober thread; its answer starts their loads.
                              Keys the store lacked are not asked again by an exists for
                              ``ABSENT_TTL_S`` (``absent_in_l3``): a hybrid model's sparse state
                              pools miss most keys, and asking the store for them at every
                              exists would cost a store round trip each time. One this daemon
                              writes is forgotten there; one another node writes meanwhile is
                              an exists miss till then. A get does not trust that memory: it
                              names keys its client has reason to think stored (an exists just
                              said so, or another node confirmed them: the PD decode loads the
                              pages its prefill's ``WaitStored`` confirmed), so keys L2 lacks
                              and not known to be in L3 are always looked up (a get of a truly
                              absent key pays one lookup on the prober thread)
    stored waits              ``writes.store_now`` (``writes.py``): a ``WaitStored`` has named pages
                              written now whatever the policy and joins their put jobs
    lookups                   ``probe``: the controller's exists asks the store the same way,
                              off the control loop, and answers when the prober has
    prefetch                  an exists that finds pages only in L3 starts the same loads with
                              nobody waiting; a get that follows joins the loads in flight
    audit                     the store is asked now and then whether it still holds the copies
                              of the pages L2 evicts next (``l3/audit.py``)

Attach / detach swap the backend while clients run: jobs carry the backend they were queued
for, so in-flight writes finish against the old one (and do not mark pages as stored in the new
one) and loads in flight still land in L2. A detached backend is closed, off the control loop,
once its last job is collected. A backend that raises is a miss, never an error to a client.

The tier owns the backend, the loads and lookups and what it remembers of the store's keys
(``known_in_l3``, ``absent_in_l3``, the pages' ``in_l3``). It builds, with itself, its write
half (``L3Writes``, ``writes.py``: the write policies, the dirty pages, the put completions;
callers reach it as ``tier.writes``) and its audit (``L3Audit``, ``audit.py``), and hands each
the jobs of theirs it collects. Only the control loop calls this object.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from hicached.backends.base import L3Backend, NullBackend
from hicached.daemon.index import Entry, PageIndex, TableId
from hicached.daemon.kv_events import NullKVEvents, l3_medium
from hicached.daemon.l3.audit import AUDIT_S, L3Audit
from hicached.daemon.l3.keymemory import KeyMemory
from hicached.daemon.l3.workers import IOJob, IOWorkers
from hicached.daemon.l3.writes import L3Writes
from hicached.errors import HicachedError, ProtocolError
from hicached.settings import WRITE_POLICIES

log = logging.getLogger(__name__)

KNOWN_IN_L3 = 65536  # keys remembered as stored in L3 (a load of one skips the exists call)
ABSENT_IN_L3 = 65536  # keys remembered as missing from L3 ...
ABSENT_TTL_S = 2.0  # ... for this long: an exists or get of one meanwhile is a miss unasked


class Woken(NamedTuple):
    """A waiter whose job finished: ``loaded`` (a load, so pages may have landed), ``follow``
    (ids of the loads that job started for it: what a ``find`` found)."""

    waiter: Any
    job_id: int
    loaded: bool
    follow: set[int]


class L3Tier:
    """See the module docstring."""

    def __init__(self, index: PageIndex, workers: IOWorkers, backend: L3Backend | None = None,
                 write_policy: str = "write_through", threshold: int = 2, prefetch: bool = True,
                 load_chunk_bytes: int = 64 << 20, audit_s: float | None = None,
                 kv_events: NullKVEvents | None = None):
        """``kv_events``: told of pages stored in and removed from L3 (``kv_events.py``)."""
        self.index = index
        # the audit of the L3 copies L2 evicts next (audit.py)
        self.auditor = L3Audit(self, index, AUDIT_S if audit_s is None else audit_s)
        self.workers = workers
        self.backend: L3Backend = backend or NullBackend()
        self.kv_events = kv_events or NullKVEvents()  # stored / removed in L3
        # the write policies, the dirty pages and the put completions (writes.py)
        self.writes = L3Writes(self, index, self.kv_events)
        self.set_policies(write_policy, threshold, prefetch)
        self.load_chunk_bytes = load_chunk_bytes
        self.loading: dict[tuple[TableId, str], IOJob] = {}  # a get job, or a find's lookup
        self.finding: set[int] = set()  # ids of the find jobs in flight
        self._jobs_of: dict[int, int] = {}  # id(backend) -> jobs in flight
        self._retired: list[L3Backend] = []  # detached, closed when their jobs are collected
        self._parked: list[L3Backend] = []  # detached ``slow_close`` ones, open and idle
        self._exists_failing = False
        # (table, key) of pages this daemon stored in or loaded from L3, newest last: a get
        # that misses L2 loads them without asking the store first (a store round trip on the
        # control loop); should L3 have dropped one since, the load is a miss like any other
        self.known_in_l3 = KeyMemory(KNOWN_IN_L3)
        # (table, key) the store said it lacks -> until when (monotonic) that answer stands
        self.absent_in_l3 = KeyMemory(ABSENT_IN_L3)
        self.clock = time.monotonic
        self.counters = {"l3_loads": 0, "l3_load_failures": 0, "l3_writes": 0,
                         "l3_write_failures": 0, "l3_writes_dropped": 0, "l3_errors": 0,
                         "prefetched_pages": 0, "write_backs": 0, "l3_probes_dropped": 0,
                         "l3_dirty_dropped": 0, "l3_copies_lost": 0, "l3_forced_writes": 0}

    # ------------------------------------------------------------ backend and policies

    @property
    def attached(self) -> bool:
        return not isinstance(self.backend, NullBackend)

    def set_policies(self, write_policy: str | None = None, threshold: int | None = None,
                     prefetch: bool | None = None) -> None:
        if write_policy:
            if write_policy not in WRITE_POLICIES:
                raise ProtocolError(f"unknown write policy {write_policy!r}; "
                                    f"valid: {list(WRITE_POLICIES)}")
            if getattr(self, "write_policy", None) == "write_back" and write_policy != "write_back":
                # dirty pages must not stay pinned under another policy
                self.writes.write_back_all()
            self.write_policy = write_policy
        if threshold is not None:
            if threshold < 1:
                raise ProtocolError(f"write_through_threshold must be >= 1, got {threshold}")
            self.threshold = threshold
        if prefetch is not None:
            self.prefetch_enabled = bool(prefetch)

    def attach(self, backend: L3Backend) -> None:
        """Install an opened backend (the previous one must have been detached)."""
        assert not self.attached, "detach first"
        self.forget_l3_copies()
        self.backend = backend
        self._exists_failing = False
        self.writes.on_attach()
        log.info("L3 backend %s attached (write policy %s)", backend.name, self.write_policy)

    def detach(self) -> bool:
        """Stop using the backend; L2 keeps its pages. False if none was attached."""
        if not self.attached:
            return False
        old = self.backend
        self.backend = NullBackend()
        self.writes.on_detach(old.name)
        self.forget_l3_copies()
        self._retired.append(old)
        self._close_idle_retired()
        log.info("L3 backend %s detached", old.name)
        return True

    def forget_l3_copies(self, dirty_again: bool = False, ns: str | None = None) -> None:
        """Count on no page being in L3 (a detach; a store that may have lost its pages; ``ns``:
        no page of that namespace digest, whose pages were cleared). ``dirty_again``: under
        write_back, L2's pages known stored are dirty again, as L2 may hold their only copy
        (their writes ask the store first, sending only what it lacks)."""
        if ns is None:
            self.known_in_l3.clear()
            self.absent_in_l3.clear()
        else:
            self.known_in_l3.forget_namespace(ns)
            self.absent_in_l3.forget_namespace(ns)
        again = dirty_again and self.write_policy == "write_back" and self.attached
        # (one numpy pass: never a walk of every page on the loop: seconds at 1M pages)
        for e in self.index.forget_in_l3(handles=again, ns=ns):
            self.writes.make_dirty(e)

    def _close_idle_retired(self) -> None:
        for b in [b for b in self._retired if not self._jobs_of.get(id(b))]:
            self._retired.remove(b)
            self._jobs_of.pop(id(b), None)
            if getattr(b, "slow_close", False):  # its close stalls every thread: at the exit
                self._parked.append(b)
                log.info("L3 backend %s kept open, idle, until the daemon exits or attaches "
                         "it again (closing it now would stall the daemon)", b.name)
                continue
            threading.Thread(target=close_quietly, args=(b,), name="hicached-l3-close",
                             daemon=True).start()

    def unpark(self, name: str, opened_with: dict) -> L3Backend | None:
        """A detached ``slow_close`` backend of ``name``, open with these options, taken back
        for an attach (``Operations.attach_backend``): no new client, no close."""
        for b in self._parked:
            if b.name == name and getattr(b, "opened_with", None) == opened_with:
                self._parked.remove(b)
                return b
        return None

    def status(self) -> dict[str, Any]:
        return {"backend": self.backend.name, "attached": self.attached,
                "parked": [b.name for b in self._parked],
                "write_policy": self.write_policy, "write_through_threshold": self.threshold,
                "prefetch": self.prefetch_enabled, "dirty_pages": len(self.writes.dirty),
                "loading_pages": len(self.loading), "jobs_in_flight": self.workers.in_flight,
                "writing_bytes": self.writes.writing_bytes,
                "degraded": self.degraded, **self.counters}

    @property
    def degraded(self) -> bool:
        """The store fails: its lookups, its last writes, or its own breaker (Mooncake's
        ``guard.Breaker``) say so. Its pages are misses meanwhile; ``/ready`` says so."""
        if not self.attached:
            return False
        breaker = getattr(self.backend, "breaker", None)
        return (self._exists_failing or self.writes.failing
                or bool(getattr(breaker, "degraded", False)))

    def backend_stats(self) -> dict:
        try:
            return self.backend.stats()
        except Exception as e:  # noqa: BLE001 - stats must never take the stats call down
            return {"error": f"{type(e).__name__}: {e}"}

    # ------------------------------------------------------------ lookups

    def is_known(self, table: TableId, key: str) -> bool:
        """Did this daemon store ``key`` in L3 or load it from there (recently)?"""
        return (table, key) in self.known_in_l3

    def sort_out(self, table: TableId, keys: Iterable[str], trust_absent: bool = True
                 ) -> tuple[set[str], list[str]]:
        """(those of ``keys`` known to be in L3, those the store must be asked about: neither
        known to be in L3 nor, if ``trust_absent``, found missing from it within
        ``ABSENT_TTL_S``)."""
        known, now = self.known_in_l3.of(table), self.clock()
        absent = self.absent_in_l3.of(table) if trust_absent else {}
        have: set[str] = set()
        ask = []
        for key in keys:
            if key in known:
                have.add(key)
            elif absent.get(key, 0.0) <= now:
                ask.append(key)
        return have, ask

    def probe(self, table: TableId, keys: Sequence[str], waiter: Any) -> IOJob | None:
        """Ask the store, on the prober thread, which of ``keys`` it has; ``collect`` hands
        ``waiter`` the finished job (its ``result``: one bool per key). None when no backend is
        attached or the prober's queue is full: the caller counts the keys as misses."""
        if not self.attached or not keys:
            return None
        ns, pool = table
        job = IOJob("exists", ns, pool, list(keys), [], 0, [], waiters=[waiter],
                    backend=self.backend)
        if not self.submit_job(job):
            self.counters["l3_probes_dropped"] += 1
            return None
        return job

    def _probe_done(self, job: IOJob, current: bool) -> None:
        """An exists / find answer is in: remember the keys the store has; a store that failed
        (or was detached meanwhile) has none."""
        if job.error:
            self.counters["l3_errors"] += 1
            if current and not self._exists_failing:
                log.warning("L3 %s exists failed (%s); answering misses", job.backend.name,
                            job.error)
                self._exists_failing = True
        elif current and self._exists_failing:
            log.info("L3 %s answers again", job.backend.name)
            self._exists_failing = False
        if not current:
            job.result = [False] * len(job.keys)
            return
        table = (job.ns, job.pool)
        absent, until = self.absent_in_l3, self.clock() + ABSENT_TTL_S
        for key, have in zip(job.keys, job.result):
            if have:
                self.remember(table, key)
            elif not job.error:  # a store that raised said nothing: not remembered
                absent[(table, key)] = until

    def remember(self, table: TableId, key: str) -> None:
        """The store holds ``key`` of ``table`` (written or found there)."""
        self.known_in_l3[(table, key)] = None
        self.absent_in_l3.pop((table, key))

    def forget_evicted(self, gone: list[tuple[str, str, str]] | None) -> None:
        """The store deleted these pages to make room (None: it may have lost any): exists no
        longer counts on them, and pages L2 still holds are no longer clean (under write_back
        they are dirty again: L2 holds their only copy)."""
        if gone is None:
            log.info("L3 %s may have lost pages: asking it again about every page",
                     self.backend.name)
            self.forget_l3_copies(dirty_again=True)
            return
        for ns, pool, key in gone:
            table = (ns, pool)
            self.known_in_l3.pop((table, key), None)
            e = self.index.get(table, key)
            if e is not None:
                self.writes.lost_copy(e)

    def submit_job(self, job: IOJob) -> bool:
        """Queue ``job`` for the I/O workers (False: their queue is full)."""
        if not self.workers.submit(job):
            return False
        self._jobs_of[id(job.backend)] = self._jobs_of.get(id(job.backend), 0) + 1
        return True

    # ------------------------------------------------------------ loads

    def load(self, table: TableId, keys: Sequence[str], page_bytes: int, stride: int,
             waiter: Any = None, known_in_l3: bool = False, start: bool = True) -> set[int]:
        """Start loading ``keys`` (missing from L2) into the arena, in jobs of at most
        ``load_chunk_bytes`` so a streaming get can copy the first pages while the rest load; join
        loads already in flight (only that with ``start=False``). Keys not known to be in L3
        (unless ``known_in_l3``) are first looked up by a ``find`` job on the prober thread,
        whose completion starts their loads, even those an exists found missing within
        ``ABSENT_TTL_S`` (see the module docstring). Returns the ids of the jobs ``waiter``
        (if any) now waits for. A key named twice is loaded once (into one slot: ``collect``
        applies each key of a job once)."""
        if not self.attached or not keys:
            return set()
        keys = list(dict.fromkeys(keys))
        ns, pool = table
        waits: set[int] = set()
        for key in keys:
            job = self.loading.get((table, key))
            if job is not None and waiter is not None and id(job) not in waits:
                job.waiters.append(waiter)
                waits.add(id(job))
        if not start:
            return waits
        todo = [k for k in keys if self._loadable(table, k)]
        waiters = [waiter] if waiter is not None else []
        if not known_in_l3:  # a get names its keys: the absent memory is not trusted
            known, ask = self.sort_out(table, todo, trust_absent=False)
            todo = [k for k in todo if k in known]  # the others found missing lately: misses
            if ask:
                find = IOJob("find", ns, pool, ask, [], page_bytes, [], waiters=list(waiters),
                             backend=self.backend, stride=stride)
                if self.submit_job(find):
                    for k in ask:
                        self.loading[(table, k)] = find
                    self.finding.add(id(find))
                    if waiters:
                        waits.add(id(find))
                else:  # the prober is swamped: those keys are misses this time
                    self.counters["l3_probes_dropped"] += 1
        return waits | self._start_loads(table, todo, page_bytes, stride, waiters)

    def _loadable(self, table: TableId, key: str) -> bool:
        return ((table, key) not in self.loading and self.index.get(table, key) is None
                and self.index.get_pending(table, key) is None)

    def _start_loads(self, table: TableId, keys: Sequence[str], page_bytes: int, stride: int,
                     waiters: list[Any]) -> set[int]:
        """Reserve slots for ``keys`` (known to be in L3) and queue their load jobs; the ids of
        the jobs queued."""
        ns, pool = table
        new: list[Entry] = []
        for key in keys:
            e = self.index.reserve(table, key, page_bytes, stride)
            if e is not None:
                new.append(e)
        ids: set[int] = set()
        per_job = max(1, self.load_chunk_bytes // page_bytes)
        for i in range(0, len(new), per_job):
            chunk = new[i:i + per_job]
            job = IOJob("get", ns, pool, [e.key for e in chunk], [e.offset for e in chunk],
                        page_bytes, chunk, waiters=list(waiters), backend=self.backend)
            if not self.submit_job(job):
                for e in new[i:]:
                    self.index.abort(e)
                break
            for e in chunk:
                self.loading[(table, e.key)] = job
            if waiters:
                ids.add(id(job))
            else:
                self.counters["prefetched_pages"] += len(chunk)
        return ids

    # ------------------------------------------------------------ completions

    def collect(self) -> list[Woken]:
        """Apply finished jobs; who waited for them (``Woken``)."""
        woken: list[Woken] = []
        jobs = self.workers.collect()
        gone: list | None = None
        if jobs and self.attached:  # what the store deleted (or may have lost) meanwhile
            try:
                gone = self.backend.take_evicted()
            except Exception:  # a backend's bug must not stop the loop
                log.exception("L3 %s: take_evicted failed", self.backend.name)
                gone = []
            self.forget_evicted(gone)
        for job in jobs:
            self._jobs_of[id(job.backend)] = self._jobs_of.get(id(job.backend), 1) - 1
            current = job.backend is self.backend
            if job.kind == "clear":
                self._clear_done(job)
                continue
            if job.kind == "put":
                self.writes.done(job, current)
                woken.extend(Woken(w, id(job), False, set()) for w in job.waiters)
                continue
            if job.kind == "audit":
                self.auditor.done(job, current)
                continue
            if job.kind in ("exists", "find"):
                self._probe_done(job, current)
                follow: set[int] = set()
                if job.kind == "find":
                    self.finding.discard(id(job))
                    follow = self._found(job)
                woken.extend(Woken(w, id(job), False, follow) for w in job.waiters)
                continue
            loaded = []
            for e, ok in zip(job.entries, job.result):
                del self.loading[(e.table, e.key)]
                if ok:
                    e.in_l3 = current
                    if current:
                        self.remember(e.table, e.key)
                    e.from_l3 = True
                    loaded.append(e)
                    self.counters["l3_loads"] += 1
                else:
                    self.known_in_l3.pop((e.table, e.key), None)  # ask the store next time
                    self.index.abort(e)
                    self.counters["l3_load_failures"] += 1
            self.index.commit_many(loaded)
            woken.extend(Woken(w, id(job), True, set()) for w in job.waiters)
        if gone:  # KV events: after the writes of these jobs (a write may evict its own pages)
            medium = l3_medium(self.backend.name)
            for ns, pool, key in gone:
                self.kv_events.removed((ns, pool), key, medium)
        self._close_idle_retired()
        return woken

    def _found(self, job: IOJob) -> set[int]:
        """A ``find`` finished: load the keys the store has, for the find's waiters."""
        table = (job.ns, job.pool)
        there = []
        for key, have in zip(job.keys, job.result):
            if self.loading.get((table, key)) is job:
                del self.loading[(table, key)]
                if have and self._loadable(table, key):
                    there.append(key)
        if not there or not self.attached:
            return set()
        return self._start_loads(table, there, job.page_bytes, job.stride, job.waiters)

    def clear(self, done: Callable[[int | Exception], None], ns: str | None = None) -> None:
        """Delete every L3 page (``ns``: every page of that namespace digest, which the backend
        must be able to find: ``L3Backend.clears_namespaces``), after the writes already queued
        (a clear on the writer thread, so no page written before it survives).
        ``done(count or exception)`` runs on the control loop; the pages are then no longer
        known to be in L3, so write policies send them again."""
        if not self.attached:
            done(0)
            return
        job = IOJob("clear", ns or "", "", [], [], 0, [], backend=self.backend, done=done)
        if not self.submit_job(job):
            done(HicachedError("L3 writer queue is full; try the clear again"))

    def _clear_done(self, job: IOJob) -> None:
        ns = job.ns or None  # (a namespace's clear: only its pages left L3)
        if job.backend is self.backend:  # KV events: the pages it was known to hold left it
            self.kv_events.cleared(self.known_in_l3.of, l3_medium(job.backend.name), ns)
        self.forget_l3_copies(ns=ns)
        n = job.result[0] if job.result else 0
        if isinstance(n, Exception):
            self.counters["l3_errors"] += 1
            log.warning("L3 %s clear failed: %s", job.backend.name, n)
        job.done(n)

    def close(self) -> None:
        """Detach and close every backend (daemon shutdown, after the workers stopped)."""
        for b in [*self._retired, *self._parked, self.backend]:
            close_quietly(b)
        self._retired.clear()
        self._parked.clear()
        self.backend = NullBackend()


def close_quietly(backend: L3Backend) -> None:
    try:
        backend.close()
    except Exception:
        log.exception("closing L3 backend %s failed", backend.name)
