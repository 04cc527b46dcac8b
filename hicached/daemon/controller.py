"""The tier controller: the daemon side of exists / set / get across L2 (arena) and L3 (backend).

Steps of the life of a page it owns (docs/life-of-a-page.md):
  2. ``reserve``  slots for every pool of a set call (or "present" / "in flight" / "no space")
  4. ``commit``   publishes all pools' pages of the call at once, then hands them to L3 (5.)
                  (both ``SetControl``, in ``set_control.py``: the controller's ``sets``)
  6. ``exists``   hit semantics over L2 then L3 (``hits.py``); keys L2 lacks and L3 is not known
                  to hold are looked up on the prober thread while the request is parked.
                  (Clients answer what L2 alone can from the presence table: ``presence.py``)
  7. ``lease``    pins slots for a get; pages only L3 has are loaded into the arena first by the
                  I/O workers while the request waits (parked), the control loop keeps serving
  8. eviction happens inside ``PageIndex.reserve`` (``reserve_many``) when a class is full
     ``wait_stored`` answers once named pages are in L3 (``StoreWaits``, ``store_waits.py``:
                  the PD prefill's "ready" to another node; the controller's ``store_waits``)

The controller is built with its parts, each an object of its own module: the sessions
(``SessionControl``), the set path (``SetControl``), the store waits (``StoreWaits``), the
parked requests (``Parking``), the L2 flush (``L2Flush``), the slicer of huge calls
(``Slicer``); the reclaimer is the index's (``PageIndex.reclaimer``). It owns the get and
exists paths, the pools' geometry, the counters and the books; it answers parked requests when
their L3 jobs are done.

Only the control loop calls into this object (single thread); the I/O workers only run backend
calls and hand finished jobs back through ``IOWorkers.collect``.

Answer first, keep the books after: what an answer does not depend on (a lease's touches, hits
and policy queueing; a reserve's links) may be queued with ``later`` and run by ``keep_books``
once the answer is sent (``server.py``), so a client does not wait for it. The loop reads no
other message in between, so the index ends in exactly the state of running it at once; what
protects the pages a client copies (a lease's pins, a reservation's slots) is never deferred.
With ``books`` None (tests, tools that drive this object directly) ``later`` runs at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from hicached import protocol as P
from hicached.daemon.flushing import L2Flush
from hicached.daemon.index import Entry, PageIndex, TableId
from hicached.daemon.kv_events import NullKVEvents, check_event_hash
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.leases import LeaseTable
from hicached.daemon.parking import Parking
from hicached.daemon.session_control import SessionControl
from hicached.daemon.sessions import ParkedExists, ParkedGet, ParkedStore, PoolSpec, Session
from hicached.daemon.set_control import SetControl
from hicached.daemon.slicing import (
    CHEAP_CHUNKS,
    Slicer,
    Steps,
    as_answer,
    call_keys,
    drive,
    fit_chunk,
    key_chunks,
)
from hicached.daemon.store_waits import StoreWaits
from hicached.errors import PageSizeMismatch, ProtocolError, UnknownSession
from hicached.hits import TRAILING, intersect_endpoints_array, leading_run_array

log = logging.getLogger(__name__)


class Controller:
    """L2 bookkeeping; L3 through the ``L3Tier``. See the module docstring.

    ``quotas``, ``ahead_session_bytes``, ``ahead_total_bytes``: the set path's bounds
    (``SetControl``); ``kv_events``: where pools declare their events (``kv_events.py``);
    ``books``: a list to keep the books after each answer (the daemon's), None to keep them at
    once (tests, tools); ``slicer``: the daemon's (None: one of its own that never yields to
    waiting requests). The reclaimer (``reclaim``) is the index's (``PageIndex.reclaimer``)."""

    def __init__(self, index: PageIndex, leases: LeaseTable, tier: L3Tier,
                 clock: Callable[[], float], get_wait_s: float = 5.0, *, quotas=None,
                 ahead_session_bytes: int = 0, ahead_total_bytes: int = 0,
                 kv_events: NullKVEvents | None = None,
                 books: list[tuple[Callable[..., None], tuple]] | None = None,
                 slicer: Slicer | None = None):
        self.index = index
        self.leases = leases
        self.tier = tier
        self.clock = clock
        self.get_wait_s = get_wait_s
        self.geometry: dict[TableId, int] = {}  # (ns, pool) -> page_bytes, fixed once seen
        self.counters = {"hits": 0, "misses": 0, "no_space": 0, "get_wait_timeouts": 0,
                         "exists_wait_timeouts": 0, "partial_answers": 0, "shared_gets": 0,
                         "store_waits": 0, "store_wait_timeouts": 0}
        # the last Leased answer and, per transfer, the rows it served from pages loaded from
        # L3 that nobody had read yet (L3 hits to the metrics, though in L2 when asked)
        self.first_l3_reads: tuple[object, list[list[int]]] = (None, [])
        # bookkeeping queued for after the answer (``later``); None: run at once. The daemon
        # gives a list and calls ``keep_books`` after every answer and loop step
        self.books = books
        self.kv_events = kv_events or NullKVEvents()  # KV events for routers (kv_events.py)
        self.sessions = SessionControl(index, leases, clock)
        self.parking = Parking()  # requests waiting for L3 or for another client's commit
        self.sets = SetControl(index, leases, tier, self.sessions, self.parking, self.counters,
                               clock, self.later, self._wake_pending, quotas,
                               ahead_session_bytes, ahead_total_bytes)
        self.store_waits = StoreWaits(index, tier, self.parking, self.sessions, self.geometry,
                                      self.counters, clock)
        self.flusher = L2Flush(tier)  # flushes of L2, in slices of the loop (flushing.py)
        self.slicer = slicer or Slicer()  # huge calls, in slices of the loop (slicing.py)
        # evicting ahead in idle turns (the daemon's share: the index's reclaimer)
        self.reclaim = index.reclaimer

    def reload(self, get_wait_s: float, namespace_quotas: dict, set_ahead_bytes: int) -> None:
        """SIGHUP: the get wait, the namespaces' quotas and the set-ahead bound per session."""
        self.get_wait_s = get_wait_s
        self.sets.reload(namespace_quotas, set_ahead_bytes)

    # ------------------------------------------------------------ answer first, books after

    def later(self, fn: Callable[..., None], *args) -> None:
        """``fn(*args)`` once the answer being built is sent (``keep_books``), in the order
        queued; at once while ``books`` is None. ``fn`` must not change the answer."""
        if self.books is None:
            fn(*args)
        else:
            self.books.append((fn, args))

    def keep_books(self) -> None:
        """Run the bookkeeping ``later`` queued (the loop calls it before reading another
        message); a bug in one step is logged and costs that step only."""
        books = self.books
        i = 0
        while i < len(books):  # (a step may queue more)
            fn, args = books[i]
            i += 1
            try:
                fn(*args)
            except Exception:
                log.exception("internal error keeping the books (%s)",
                              getattr(fn, "__name__", fn))
        books.clear()

    # ------------------------------------------------------------ namespaces and pools

    def namespaces(self) -> list[dict]:
        """Each namespace that holds L2 bytes, has a client or a quota: its name, L2 bytes,
        sessions, and quota (None: none) with the quota's own evictions and rejections."""
        quotas = {q["digest"]: q for q in self.sets.quotas.snapshot()}
        sessions: dict[str, int] = {}
        for s in self.sessions.values():
            sessions[s.ns] = sessions.get(s.ns, 0) + 1
        held = {d for d, n in self.index.ns_bytes.items() if n > 0}
        out = []
        for d in held | set(sessions) | set(quotas):
            q = quotas.get(d, {})
            name = q.get("namespace") or self.sessions.ns_names.get(d, f"<{d}>")
            out.append({"namespace": name,
                        "used_bytes": self.index.ns_bytes.get(d, 0),
                        "sessions": sessions.get(d, 0), "quota_bytes": q.get("quota_bytes"),
                        "evictions": q.get("evictions", 0), "rejections": q.get("rejections", 0)})
        return sorted(out, key=lambda n: n["namespace"])


    def know_geometry(self, geometry: dict[tuple[str, str], int]) -> None:
        """The page bytes of tables whose pages were adopted (``adoption.py``): a client that
        registers one of those pools with other page bytes is refused as for a live pool."""
        for table, page_bytes in geometry.items():
            self.geometry.setdefault(table, page_bytes)

    def register_pool(self, s: Session, pool: str, page_bytes: int, event_hash: str = "",
                      tokens_per_page: int = 0) -> int:
        """Check and record a session's pool (its KV events: ``kv_events.py``, the latest
        declaration wins); its bit in the namespace's presence masks."""
        if not pool or pool in (".", "..") or any(c in pool for c in "/\\\0"):
            # L3 backends name files and objects after the pool: "../<other namespace>/kv"
            # would reach another namespace's pages on a directory store
            raise ProtocolError(f"pool name {pool!r} must be non-empty, not '.' or '..', and "
                                "hold no '/', '\\' or NUL")
        stride = self.index.alloc.check_page_bytes(page_bytes)
        check_event_hash(event_hash, tokens_per_page)
        table = (s.ns, pool)
        try:
            tid = self.index.table_id(table)
            bit = self.index.pool_bit(table)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        known = self.geometry.setdefault(table, page_bytes)
        if known != page_bytes:
            raise PageSizeMismatch(
                f"pool {pool!r} of this namespace has pages of {known} bytes, "
                f"client registered {page_bytes} bytes (same namespace must mean same geometry)"
            )
        s.pools[pool] = PoolSpec(page_bytes, stride)
        self.kv_events.declare(tid, table, s.namespace, event_hash, tokens_per_page)
        return bit

    # ------------------------------------------------------------ exists

    def _missing(self, ns: str, pool: str, keys: list[str], masks: np.ndarray) -> list[str]:
        """Those of ``keys`` (their ``PageIndex.presence`` ``masks``) ``pool`` lacks in L2."""
        in_l2 = (masks & self.index.pool_bit((ns, pool))) != 0
        return [keys[i] for i in np.flatnonzero(~in_l2).tolist()]

    def _present(self, ns: str, pool: str, keys: list[str], masks: np.ndarray,
                 in_l3: set[str] | tuple) -> tuple[np.ndarray, np.ndarray]:
        """Per key, as bool arrays: (in L2 committed, in L2 or L3). ``masks``: the keys'
        ``PageIndex.presence``; ``in_l3``: the keys L2 lacks that are in L3."""
        in_l2 = (masks & self.index.pool_bit((ns, pool))) != 0
        have = in_l2
        if in_l3 and not in_l2.all():
            have = in_l2.copy()
            miss = np.flatnonzero(~in_l2)
            have[miss] = [keys[i] in in_l3 for i in miss.tolist()]
        return in_l2, have

    def exists(self, s: Session, msg: P.Exists, reply: Callable[[P.ExistsResult], None]
               ) -> P.ExistsResult | None:
        """Hit semantics over L2 and L3. Keys L2 lacks that this daemon neither knows to be in
        L3 nor found missing from it lately (``L3Tier.sort_out``) are looked up by the prober
        thread (``L3Tier.probe``) while the control loop goes on: the request is then parked
        and answered through ``reply``. A pool must be registered in the namespace, by this
        session or another (a vLLM scheduler asks about the pools its workers register)."""
        return drive(self.exists_steps(s, msg, reply))

    def exists_steps(self, s: Session, msg: P.Exists, reply: Callable[[P.ExistsResult], None],
                     chunk: int | None = None) -> Steps:
        """``exists``, its keys looked up in L2 ``chunk`` at a time (None: all at once),
        yielding between two (``slicing.py``): each key as L2 holds it when its chunk is looked
        up, the chunks from the first key on (a commit in slices publishes the deep end of its
        chain first: a prefix reaches into its pages only once all of them are there). What
        follows the lookups (the answer, L3's share) runs at once."""
        for pool in (msg.anchor, *(q.pool for q in msg.pools)):
            if (s.ns, pool) not in self.geometry:
                s.spec(pool)  # UnknownPool
        keys = msg.key_list()
        if not chunk or len(keys) <= chunk:
            masks = self.index.presence(s.ns, keys)  # one lookup a key for every pool
        else:
            parts, lo, step = [], 0, chunk
            while lo < len(keys):
                if lo:
                    yield
                    if s.id not in self.sessions:
                        raise UnknownSession(f"session {s.id} ended while its Exists of "
                                             f"{len(keys)} keys was worked")
                hi = min(len(keys), lo + step)
                t0 = time.perf_counter()
                parts.append(self.index.presence(s.ns, keys[lo:hi]))
                step = fit_chunk(chunk * CHEAP_CHUNKS, hi - lo, time.perf_counter() - t0)
                lo = hi
            masks = np.concatenate(parts)
        in_l3: dict[str, set[str]] = {}
        if self.tier.attached:
            parked = None
            for pool in dict.fromkeys([msg.anchor, *(q.pool for q in msg.pools)]):
                table = (s.ns, pool)
                in_l3[pool], ask = self.tier.sort_out(table,
                                                      self._missing(s.ns, pool, keys, masks))
                if ask:
                    parked = parked or ParkedExists(s, msg, keys, reply,
                                                    self.clock() + self.get_wait_s)
                    job = self.tier.probe(table, ask, parked)
                    if job is not None:
                        parked.probes.append(job)
                        parked.jobs.add(id(job))
            if parked is not None and parked.jobs:
                self.parking.park(parked)
                return None
        return self._exists_answer(s, msg, keys, masks, in_l3)

    def _exists_answer(self, s: Session, msg: P.Exists, all_keys: list[str],
                       masks: np.ndarray, in_l3: dict[str, set[str]]) -> P.ExistsResult:
        kv_l2, kv_have = self._present(s.ns, msg.anchor, all_keys, masks,
                                       in_l3.get(msg.anchor, ()))
        kv_pages = leading_run_array(kv_have)
        keys, masks = all_keys[:kv_pages], masks[:kv_pages]
        found = [(q, *self._present(s.ns, q.pool, keys, masks, in_l3.get(q.pool, ())))
                 for q in msg.pools]
        try:
            final, hits, restorable = intersect_endpoints_array(
                kv_pages, [(q.pool, q.policy, q.window, have) for q, _, have in found])
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        if kv_pages:
            hits[msg.anchor] = kv_pages
        if final and self.tier.attached and self.tier.prefetch_enabled:
            self._prefetch(s, msg.anchor, all_keys, kv_l2, 0, final)
            for q, in_l2, _ in found:
                start = max(0, final - q.window) if q.policy == TRAILING else 0
                self._prefetch(s, q.pool, keys, in_l2, start, final)
        return P.ExistsResult(msg.req_id, final, hits, restorable)

    def _answer_exists(self, parked: ParkedExists) -> None:
        """A parked Exists: the answer with what the prober said (L2 as it is now)."""
        self.parking.settle(parked)
        s, msg = parked.session, parked.msg
        if s.id not in self.sessions:
            return
        keys, masks = parked.keys, self.index.presence(s.ns, parked.keys)
        in_l3: dict[str, set[str]] = {}
        for pool in dict.fromkeys([msg.anchor, *(q.pool for q in msg.pools)]):
            in_l3[pool] = self.tier.sort_out((s.ns, pool),
                                             self._missing(s.ns, pool, keys, masks))[0]
        for job in parked.probes:  # an unfinished one (deadline): its keys are not in L3
            if len(job.result) == len(job.keys):
                in_l3[job.pool].update(k for k, have in zip(job.keys, job.result) if have)
        try:
            answer = self._exists_answer(s, msg, keys, masks, in_l3)
        except ProtocolError as e:
            answer = P.Error(msg.req_id, e.code, str(e))
        parked.reply(answer)

    def _prefetch(self, s: Session, pool: str, keys: list[str], in_l2: np.ndarray, start: int,
                  end: int) -> None:
        """Start pulling pages start..end-1 of ``pool`` that only L3 has (they are known to be
        there: ``exists`` just found them restorable)."""
        todo = [keys[start + i] for i in np.flatnonzero(~in_l2[start:end]).tolist()]
        if todo:
            # the pool's geometry in the namespace: this session may only ask about it
            page_bytes = self.geometry[(s.ns, pool)]
            self.tier.load((s.ns, pool), todo, page_bytes,
                           self.index.alloc.check_page_bytes(page_bytes), known_in_l3=True)

    def _wake_pending(self, e: Entry) -> None:
        """``e`` was committed or aborted: the gets that waited for it may be answered."""
        for parked in self.parking.waiting_on(e):
            if parked.answered:
                continue
            parked.jobs.discard(id(e))
            if (not parked.jobs or parked.msg.stream) and not parked.building:
                self._answer_parked(parked)

    # ------------------------------------------------------------ get: lease, release

    def lease(self, s: Session, msg: P.Lease, reply: Callable[[P.Leased], None]
              ) -> P.Leased | None:
        """Lease every present page; park the request (answer later via ``reply``) while pages
        only L3 has are loaded, or loads of its keys are in flight."""
        return drive(self.lease_steps(s, msg, reply))

    def lease_steps(self, s: Session, msg: P.Lease, reply: Callable[[P.Leased], None],
                    chunk: int | None = None) -> Steps:
        """``lease``; a call of more than ``chunk`` keys (None: never) looks its keys up a
        chunk at a time, yielding between two (``slicing.py``): first, when L3 or another
        client's writes may be waited for, to find what is missing (loads and waits start
        chunk by chunk; the call parks if any are left), then to lease what is present
        (``_lease_present_steps``)."""
        for t in msg.transfers:
            s.spec(t.pool)
        parked = ParkedGet(s, msg, reply, self.clock() + self.get_wait_s)
        if chunk and sum(len(t.keys) for t in msg.transfers) > chunk:
            return (yield from self._lease_sliced(s, msg, parked, chunk))
        present = False
        found: list[list[Entry | None]] | None = []  # the pages of each transfer, while valid
        for t in msg.transfers:
            got = self.index.get_many((s.ns, t.pool), t.keys)
            missing = [k for k, e in zip(t.keys, got) if e is None]
            present = present or len(missing) < len(t.keys)
            if found is not None:
                found.append(got)
            if missing and msg.load:  # a page another client is writing: wait for its commit
                self._wait_for_writers(parked, (s.ns, t.pool), missing)
            if missing:
                found = None  # a load may evict pages found before: look again when answering
                spec = s.spec(t.pool)
                parked.jobs |= self.tier.load((s.ns, t.pool), missing, spec.page_bytes,
                                              spec.stride, waiter=parked,
                                              start=msg.load)
        if parked.jobs and not (msg.stream and present):
            self.parking.park(parked)
            return None
        self.parking.settle(parked)  # answered now: the loads it joined must not answer it again
        return self._lease_present(s, msg, found=found)

    def _lease_sliced(self, s: Session, msg: P.Lease, parked: ParkedGet, chunk: int) -> Steps:
        """``lease_steps`` of a call of more than ``chunk`` keys. Its loads and waits may end
        while it looks for more (``parked.building``: none answers it before it parks)."""
        chunks = key_chunks([t.keys for t in msg.transfers], chunk)
        if self.tier.attached or (msg.load and any((s.ns, t.pool) in self.index.pending
                                                   for t in msg.transfers)):
            present = False
            parked.building = True
            try:
                for n, parts in enumerate(chunks):
                    if n:
                        yield
                        if s.id not in self.sessions:
                            raise UnknownSession(f"session {s.id} ended while its Lease was "
                                                 "worked")
                    for p, at in parts:
                        t = msg.transfers[p]
                        table = (s.ns, t.pool)
                        keys = [t.keys[i] for i in at]
                        missing = [k for k, e in zip(keys, self.index.get_many(table, keys))
                                   if e is None]
                        present = present or len(missing) < len(keys)
                        if missing and msg.load:
                            self._wait_for_writers(parked, table, missing)
                        if missing:
                            spec = s.spec(t.pool)
                            parked.jobs |= self.tier.load(table, missing, spec.page_bytes,
                                                          spec.stride, waiter=parked,
                                                          start=msg.load)
            except BaseException:
                self.parking.settle(parked)  # (what it waits for must not answer it)
                raise
            parked.building = False
            if parked.jobs and not (msg.stream and present):
                self.parking.park(parked)
                return None
        self.parking.settle(parked)
        return (yield from self._lease_present_steps(s, msg, chunk=chunk, chunks=chunks))

    def _wait_for_writers(self, parked: ParkedGet, table: TableId, keys: list[str]) -> None:
        pend = self.index.pending.get(table)  # live handles
        if not pend:
            return
        for key in keys:
            e = pend.get(key)
            # not its own pages: the same client's commit cannot overtake its get (one socket,
            # and a client holds its lock while it waits for an answer)
            if (e is not None and e.owner != parked.session.id
                    and (table, key) not in self.tier.loading):
                self.parking.wait_for_commit(e, parked)

    def _lease_present(self, s: Session, msg: P.Lease, final: bool = False,
                       found: list[list[Entry | None]] | None = None) -> P.Leased:
        """Lease the pages of ``msg`` that are in L2 now; the others are misses (or, for a
        stream not answered at its deadline, ``SLOT_LOADING`` while their load is in flight).
        ``found``: the pages of each transfer, looked up since the last change of L2."""
        offsets: list[list[int]] = []
        tags: list[list[int]] = []
        entries: list[Entry] = []
        loading = self.tier.loading if msg.stream and not final else {}
        partial = False
        from_l3: list[list[int]] = []
        for p, t in enumerate(msg.transfers):
            table = (s.ns, t.pool)
            row, tag_row, l3_row = [], [0] * len(t.keys), []
            got = found[p] if found else self.index.get_many(table, t.keys)
            for i, (key, e) in enumerate(zip(t.keys, got)):
                if e is not None:  # (looked up just now: in its slot)
                    entries.append(e)
                    row.append(e.slot_offset)
                    tag_row[i] = e.gen
                    if e.from_l3:  # prefetched: its first read is an L3 hit
                        e.from_l3 = False
                        l3_row.append(i)
                elif (table, key) in loading:
                    row.append(P.SLOT_LOADING)
                    partial = True
                else:
                    row.append(P.SLOT_MISS)
            offsets.append(row)
            tags.append(tag_row)
            from_l3.append(l3_row)
        self.counters["partial_answers"] += partial
        answer = self._grant(s, msg.req_id, entries, offsets, tags)
        self.first_l3_reads = (answer, from_l3)  # for the metrics of this answer
        return answer

    def _lease_present_steps(self, s: Session, msg: P.Lease, final: bool = False,
                             chunk: int | None = None, chunks: list | None = None) -> Steps:
        """``_lease_present`` a chunk of keys at a time (``key_chunks``: every transfer's
        positions of a key in one chunk, so a key's pages of every pool are leased together),
        yielding between two (None: all at once). Each chunk's pages are pinned, touched and
        counted as it is looked up, under the lease the answer names (registered from the
        first chunk that found pages on: the pins go with the session if it ends; renewed at
        each resume); a page evicted or committed between two chunks is seen as it is when its
        chunk comes."""
        if not chunk or sum(len(t.keys) for t in msg.transfers) <= chunk:
            return self._lease_present(s, msg, final)
        loading = self.tier.loading if msg.stream and not final else {}
        offsets = [[P.SLOT_MISS] * len(t.keys) for t in msg.transfers]
        tags = [[0] * len(t.keys) for t in msg.transfers]
        from_l3: list[list[int]] = [[] for _ in msg.transfers]
        partial, misses = False, 0
        g = None  # the lease, once a chunk found pages
        for n, parts in enumerate(chunks or key_chunks([t.keys for t in msg.transfers], chunk)):
            if n:
                yield
                if s.id not in self.sessions or (
                        g is not None and self.leases.leases.get(g.id) is not g):
                    raise UnknownSession(f"session {s.id} ended while its Lease was worked")
                if g is not None:
                    g.deadline = self.clock() + self.leases.lease_ttl_s
            entries: list[Entry] = []
            for p, at in parts:
                t = msg.transfers[p]
                table = (s.ns, t.pool)
                keys = [t.keys[i] for i in at]
                row, tag_row, l3_row = offsets[p], tags[p], from_l3[p]
                for i, key, e in zip(at, keys, self.index.get_many(table, keys)):
                    if e is not None:  # (looked up just now: in its slot)
                        entries.append(e)
                        row[i] = e.slot_offset
                        tag_row[i] = e.gen
                        if e.from_l3:  # prefetched: its first read is an L3 hit
                            e.from_l3 = False
                            l3_row.append(i)
                    elif (table, key) in loading:
                        row[i] = P.SLOT_LOADING
                        partial = True
                    else:
                        misses += 1
            if entries:
                self.index.read_many(entries)  # touched, a hit each, pinned for the lease
                if g is None:
                    g = self.leases.new_lease(s.id, entries, self.clock(), pinned=True)
                else:
                    g.entries.extend(entries)
                if self.tier.writes.selective:
                    self.later(self._on_hits, entries)
        self.counters["partial_answers"] += partial
        self.counters["misses"] += misses
        if g is not None:
            self.counters["hits"] += len(g.entries)
            g.deadline = self.clock() + self.leases.lease_ttl_s
            answer = P.Leased(msg.req_id, g.id, offsets, tags)
        else:
            answer = P.Leased(msg.req_id, 0, offsets, tags)
        self.first_l3_reads = (answer, [sorted(row) for row in from_l3])
        return answer

    def _answer_parked(self, parked: ParkedGet | ParkedExists | ParkedStore,
                       final: bool = False) -> None:
        """Answer a parked request; a bug in building its answer costs this request only, and
        its client hears an ``Error`` instead of waiting for its deadline (as ``_handle``)."""
        try:
            if isinstance(parked, ParkedExists):
                self._answer_exists(parked)
                return
            if isinstance(parked, ParkedStore):
                self.store_waits.answer(parked, final)
                return
            self.parking.settle(parked)
            if parked.session.id not in self.sessions:
                return
            chunk = self.slicer.chunk(call_keys(parked.msg))
            if chunk is None:
                parked.reply(self._lease_present(parked.session, parked.msg, final))
                return
            self.slicer.start(self._lease_present_steps(parked.session, parked.msg, final,
                                                        chunk),
                              lambda result: parked.reply(as_answer(parked.msg, result)),
                              what="Lease (its late answer)")
        except Exception as e:
            log.exception("internal error answering a parked %s", type(parked.msg).__name__)
            self.parking.settle(parked)
            parked.reply(P.Error(parked.msg.req_id, "internal", f"{type(e).__name__}: {e}"))

    def expire_parked(self, now: float) -> None:
        """Answer requests that waited ``get_wait_s`` for L3: what is loaded now is served (a
        get), keys the store has not answered for are absent (an exists)."""
        for parked in self.parking.due(now):
            if not isinstance(parked, ParkedStore):  # (counted when answered StoreTimeout)
                self.counters["get_wait_timeouts" if isinstance(parked, ParkedGet)
                              else "exists_wait_timeouts"] += 1
            self._answer_parked(parked, final=True)

    def next_parked_deadline(self) -> float | None:
        return self.parking.next_deadline()

    def _grant(self, s: Session, req_id: int, entries: list[Entry], offsets: list[list[int]],
               tags: list[list[int]]) -> P.Leased:
        """Lease ``entries``. Counts pages served from L2 (a page loaded from L3 for this request
        is served from L2 too; ``l3_loads`` counts the loads)."""
        hits = len(entries)
        self.counters["hits"] += hits
        self.counters["misses"] += sum(off == P.SLOT_MISS for row in offsets for off in row)
        if not entries:
            return P.Leased(req_id, 0, offsets, tags)
        if self.books is None:
            self.index.read_many(entries)  # touched, a hit each, pinned for the lease
        else:  # pinned now; touched and a hit each once the answer is sent
            self.index.pin_many(entries)
            self.books.append((self.index.read_many, (entries, False)))
        g = self.leases.new_lease(s.id, entries, self.clock(), pinned=True)
        if self.tier.writes.selective:  # after the lease pinned them: a selective write-through may
            self.later(self._on_hits, entries)  # start (after their hits are counted)
        return P.Leased(req_id, g.id, offsets, tags)

    def _on_hits(self, entries: list[Entry]) -> None:
        for e in entries:
            self.tier.writes.on_hit(e)

    def release(self, s: Session, lease_ids: list[int]) -> None:
        for lid in lease_ids:
            self.leases.release(lid, s.id)

    def release_steps(self, s: Session, lease_ids: list[int], chunk: int | None = None
                      ) -> Steps:
        """``release``; a lease of more than ``chunk`` pages (None: never) is taken from the
        table at once and its pages unpinned a chunk at a time, yielding between two."""
        if not chunk:
            return self.release(s, lease_ids)
        first = True
        for lid in lease_ids:
            g = self.leases.take_lease(lid, s.id)
            if g is None:
                continue
            entries, step = g.entries, chunk
            while entries:  # from the end (the order of unpins does not matter), letting go
                if not first:  # of each chunk's pages as it goes: no pause at the end
                    yield
                first = False
                t0 = time.perf_counter()
                self.index.unpin_many(entries[-step:])
                del entries[-step:]
                step = fit_chunk(chunk * CHEAP_CHUNKS, step, time.perf_counter() - t0)

    def released_then(self, s: Session, lease_ids: list[int], chunk: int | None,
                      steps: Steps) -> Steps:
        """``steps`` after the leases a request carries are released (piggybacked: as a
        Release sent before it)."""
        yield from self.release_steps(s, lease_ids, chunk)
        return (yield from steps)

    def call_size(self, msg) -> int:
        """What a request costs the loop, in keys (``slicing.Slicer.chunk``): the keys it
        names, the slots of the reservation a Commit publishes, the pages of the leases it
        ends."""
        n = call_keys(msg)
        if type(msg) is P.Commit:
            r = self.leases.reservations.get(msg.reservation_id)
            n = max(n, len(r.slots) if r is not None else 0)
        for lid in msg.lease_ids if type(msg) is P.Release else getattr(msg, "release", ()):
            g = self.leases.leases.get(lid)
            n += len(g.entries) if g is not None else 0
        return n

    def read_unleased(self, s: Session, msg: P.Release) -> list[Entry]:
        """Pages of ``s``'s namespace read without a lease (``Release.touched``, at most
        ``P.MAX_TOUCHED`` pairs) are hits, as leased ones would be; returns those still in L2."""
        entries = self.index.tagged(msg.touched[:2 * P.MAX_TOUCHED], s.ns)
        self.counters["hits"] += len(entries)
        self.counters["shared_gets"] = min(self.counters["shared_gets"] + msg.shared_gets,
                                           P.COUNT_MAX)
        for e in entries:
            self.index.touch(e)
            e.hits += 1
            self.tier.writes.on_hit(e)
        return entries

    # ------------------------------------------------------------ I/O completions

    def on_io_done(self) -> None:
        """Apply finished L3 jobs; answer parked gets whose loads are all done."""
        for parked, job_id, loaded, follow in self.tier.collect():
            if parked.answered:
                continue
            parked.jobs |= follow  # the loads a lookup started for it
            parked.jobs.discard(job_id)
            if parked.building:  # (a sliced get still looking: it answers or parks itself)
                continue
            if not parked.jobs or (loaded and self._stream_now(parked)):
                self._answer_parked(parked)

    def _stream_now(self, parked: ParkedGet | ParkedExists | ParkedStore) -> bool:
        """A streamed get answers as each load lands, once no lookup of its keys is in flight
        (the pages a lookup finds are loading; those it does not find are misses)."""
        return (isinstance(parked, ParkedGet) and parked.msg.stream
                and parked.jobs.isdisjoint(self.tier.finding))

    # ------------------------------------------------------------ maintenance

    def flush_l2(self, done: Callable[[int], None], ns: str | None = None) -> None:
        """Drop unpinned L2 pages (``ns``: those of that namespace digest; dirty ones under
        write_back are written first), in slices of the loop (``flushing.L2Flush``);
        ``done(pages dropped)`` runs on the loop at the end."""
        self.flusher.request(done, ns)
