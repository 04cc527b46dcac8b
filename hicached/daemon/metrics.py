"""Prometheus metrics and the ``/stats`` JSON of one daemon.

Two sources, one registry per daemon (a ``CollectorRegistry`` of its own, never the global one):

- the dispatch hook (``Daemon._handle`` calls ``on_request`` for every request, and
  ``on_parked_answer`` when a get that waited for L3 loads is answered) counts what the
  controller does not: requests and latency per op, page hits / misses per tier and pool,
  bytes handed to and from clients. Runs on the control loop: plain dict increments, plus one
  histogram observation.
- a collector that, at scrape time, takes one ``snapshot()`` on the control loop
  (``Daemon.call``) of the controller's, tier's, quotas' and I/O workers' counters.

Hit accounting of a get (pages):

    served from L2 right away                  l2 hit
    not in L2, loaded from L3 while it waited  l2 miss + l3 hit
    prefetched from L3 by an exists, first read l3 hit
    waited for while another client wrote it   l2 hit (it never came from L3)
    streamed get: still loading (SLOT_LOADING) l2 miss; served by the follow-up: l3 hit
    not served                                 l2 miss (+ l3 miss when an L3 backend is attached)

Every metric name starts with ``hicached_``. A daemon without an admin API uses ``NullMetrics``.
"""

from __future__ import annotations

import heapq
import time
import typing
from collections import OrderedDict
from types import MappingProxyType

from hicached import protocol as P
from hicached.errors import HicachedError

OPS = {cls: cls.__struct_config__.tag for cls in typing.get_args(P.Request)}
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_PARKED = 4096  # requests waiting for L3 remembered for accounting (the oldest are forgotten)
SCRAPE_TIMEOUT_S = 5.0
SLOW_KEPT = 10  # the slowest calls kept between two samples of the status page


class NullMetrics:
    """Metrics off (no admin API): the hooks do nothing, and a ``snapshot`` (``hicached status``
    over the socket) has the daemon's own counters but no per-request ones (hits, misses,
    bytes handed to clients: ``counted`` is False)."""

    counted = False
    requests = hits = misses = client_bytes = exists_keys = exists_hits = MappingProxyType({})

    def __init__(self, daemon=None):
        self.daemon = daemon

    def snapshot(self, orphans: bool = True) -> dict:
        """Every counter the views need, taken at once (call on the control loop); ``orphans``:
        see ``loop_stats``."""
        d = self.daemon
        pools: dict[str, dict[str, int]] = {}
        for (ns, pool), n in d.index.counts().items():
            p = pools.setdefault(pool, {"pages": 0, "bytes": 0})
            p["pages"] += n
            p["bytes"] += n * d.controller.geometry.get((ns, pool), 0)
        return {
            "stats": d.operations.loop_stats(orphans),
            "pools": pools,
            "arena_bytes": d.arena.size_bytes,
            "l3_bytes": {"l2_to_l3": d.workers.bytes_done["put"],
                         "l3_to_l2": d.workers.bytes_done["get"]},
            "namespaces": d.controller.namespaces(),
            "draining": d.draining,
            "requests": dict(self.requests),
            "hits": dict(self.hits),
            "misses": dict(self.misses),
            "client_bytes": dict(self.client_bytes),
            "exists_keys": dict(self.exists_keys),
            "exists_hits": dict(self.exists_hits),
            "counted": self.counted,
        }

    def status_sample(self, orphans: bool) -> tuple[dict, list[dict], float]:
        """One sample of the status page (``status.py``; call on the control loop): a snapshot,
        the slowest calls since the previous sample (``take_slow``), and the seconds the
        snapshot took on the loop."""
        t0 = time.perf_counter()
        snap = self.snapshot(orphans)
        return snap, self.take_slow(), time.perf_counter() - t0

    def take_slow(self) -> list[dict]:
        """The slowest calls since the last take, slowest first (none counted here)."""
        return []

    def on_request(self, msg, answer, t0: float) -> None:
        pass

    def on_parked_answer(self, msg, answer) -> None:
        pass

    def on_unleased(self, msg, entries) -> None:
        pass


class Metrics(NullMetrics):
    """See the module docstring. ``daemon`` is the ``server.Daemon`` measured."""

    counted = True

    def __init__(self, daemon):
        from prometheus_client import CollectorRegistry, Histogram

        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=False)
        self._latency = Histogram("hicached_request_duration_seconds",
                                  "Time from reading a request to sending its answer, per op",
                                  ["op"], registry=self.registry, buckets=LATENCY_BUCKETS_S)
        self._latency_of: dict = {}  # op -> histogram child (created at the op's first use)
        self.requests: dict[tuple[str, str], int] = {}  # (op, outcome) -> count
        self.hits: dict[tuple[str, str], int] = {}  # (tier, pool) -> pages
        self.misses: dict[tuple[str, str], int] = {}
        self.client_bytes = {"client_to_l2": 0, "l2_to_client": 0}
        self.exists_keys: dict[str, int] = {}  # anchor pool -> keys asked
        self.exists_hits: dict[str, int] = {}  # pool -> pages answered as restorable hits
        # id of a request waiting for L3 (a get's loads, a lookup) -> when it was read (t0)
        self._parked: OrderedDict[int, float] = OrderedDict()
        # the SLOW_KEPT slowest calls since take_slow: a min-heap of (seconds, seq, op, outcome,
        # unix time); a call no slower than _slow_floor (the heap's fastest, once full) is not
        # kept, so the common case costs one comparison
        self._slow: list[tuple[float, int, str, str, float]] = []
        self._slow_floor = 0.0
        self._slow_seq = 0
        self.registry.register(_Collector(self))

    # ------------------------------------------------------------ dispatch hook (control loop)

    def on_request(self, msg, answer, t0: float) -> None:
        """A request was handled: ``answer`` sent now, or None (fire and forget, or parked)."""
        op = OPS.get(type(msg), "invalid")
        if answer is None:
            if op in ("lease", "exists", "wait_stored"):
                self._park(msg, t0)
                return
            outcome = "ok"
        else:
            outcome = answer.code if type(answer) is P.Error else "ok"
        self._finish(op, outcome, t0)
        if type(msg) is P.ExistsTally and answer is None:  # (refused ones are not counted)
            self._count_tally(msg)
        match answer:
            case P.Leased():
                self._count_get(msg, answer)
            case P.Reserved():
                self._count_reserved(msg, answer)
            case P.ExistsResult():
                self._count_exists(msg, answer)

    def _count_exists(self, msg: P.Exists, answer: P.ExistsResult) -> None:
        n = msg.packed.count(0) + 1 if msg.packed else len(msg.keys)  # NUL-joined keys
        self.exists_keys[msg.anchor] = self.exists_keys.get(msg.anchor, 0) + n
        for pool, n in answer.pool_hits.items():
            self.exists_hits[pool] = self.exists_hits.get(pool, 0) + n

    def _count_tally(self, msg: P.ExistsTally) -> None:
        """Exists calls a client answered from the presence table: counted as exists requests
        with outcome ``shared``, their keys and hits as the daemon's own."""
        key = ("exists", "shared")
        self.requests[key] = min(self.requests.get(key, 0) + msg.calls, P.COUNT_MAX)
        for mine, theirs in ((self.exists_keys, msg.keys), (self.exists_hits, msg.hits)):
            for pool, n in theirs.items():
                mine[pool] = min(mine.get(pool, 0) + n, P.COUNT_MAX)

    def on_unleased(self, msg: P.Release, entries: list) -> None:
        """Pages a client read without a lease (``entries``, those still in L2): L2 hits of their
        pools, and the get calls that sent no request as lease requests with outcome ``shared``."""
        key = ("lease", "shared")
        self.requests[key] = min(self.requests.get(key, 0) + msg.shared_gets, P.COUNT_MAX)
        for e in entries:
            self._add(self.hits, "l2", e.table[1], 1)
            self.client_bytes["l2_to_client"] += e.page_bytes

    def on_parked_answer(self, msg, answer) -> None:
        """A request that waited for L3 (loads, lookups) is answered now."""
        t0 = self._parked.pop(id(msg), None)
        if t0 is None:
            return
        ok = type(answer) is not P.Error
        self._finish(OPS[type(msg)], "ok" if ok else answer.code, t0)
        if type(answer) is P.Leased:
            self._count_get(msg, answer)
        elif type(answer) is P.ExistsResult:
            self._count_exists(msg, answer)

    def _finish(self, op: str, outcome: str, t0: float) -> None:
        child = self._latency_of.get(op)
        if child is None:
            child = self._latency_of[op] = self._latency.labels(op)
        seconds = time.perf_counter() - t0
        child.observe(seconds)
        key = (op, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1
        if seconds > self._slow_floor:
            self._note_slow(op, outcome, seconds)

    def _note_slow(self, op: str, outcome: str, seconds: float) -> None:
        self._slow_seq += 1
        item = (seconds, self._slow_seq, op, outcome, time.time())
        if len(self._slow) < SLOW_KEPT:
            heapq.heappush(self._slow, item)
            if len(self._slow) < SLOW_KEPT:
                return
        else:
            heapq.heapreplace(self._slow, item)
        self._slow_floor = self._slow[0][0]

    def take_slow(self) -> list[dict]:
        """The ``SLOW_KEPT`` slowest calls answered since the last take, slowest first: op,
        outcome, milliseconds from reading the request to answering it, and when it was
        answered (unix time). No keys, no sessions. Starts the next round empty."""
        out = [{"op": op, "outcome": outcome, "ms": seconds * 1e3, "t": t}
               for seconds, _, op, outcome, t in sorted(self._slow, reverse=True)]
        self._slow, self._slow_floor = [], 0.0
        return out

    def _park(self, msg: P.Lease | P.Exists, t0: float) -> None:
        self._parked[id(msg)] = t0
        while len(self._parked) > MAX_PARKED:
            self._parked.popitem(last=False)

    def _page_bytes(self, session: int, pool: str) -> int:
        sess = self.daemon.controller.sessions.get(session)
        spec = sess.pools.get(pool) if sess else None
        return spec.page_bytes if spec else 0

    def _count_get(self, msg: P.Lease, answer: P.Leased) -> None:
        """A page served is an L3 hit when it was loaded from the attached L3 and this is its
        first read (``controller.first_l3_reads``: prefetched by an exists, or loaded while the
        get waited), else an L2 hit; a streamed get's ``SLOT_LOADING`` pages are counted by its
        follow-up (``load=False``)."""
        l3 = self.daemon.tier.attached
        got, from_l3 = self.daemon.controller.first_l3_reads
        for i, (t, row) in enumerate(zip(msg.transfers, answer.offsets)):
            missed = row.count(P.SLOT_MISS)
            served = len(row) - missed - row.count(P.SLOT_LOADING)
            # L3 hits: pages loaded from the attached L3 and read here for the first time (a
            # page waited for while another client wrote it came from L2, not L3)
            loaded = set(from_l3[i]) if got is answer and i < len(from_l3) else set()
            l3_hits = sum(1 for j in loaded if row[j] >= 0)
            if not msg.load:  # a stream's follow-up: its pages were L2 misses when first asked
                l2_hits, l2_misses = 0, 0
            else:
                l2_hits = served - l3_hits
                l2_misses = len(row) - l2_hits
            self._add(self.hits, "l2", t.pool, l2_hits)
            self._add(self.misses, "l2", t.pool, l2_misses)
            self._add(self.hits, "l3", t.pool, l3_hits)
            if l3:
                self._add(self.misses, "l3", t.pool, missed)
            self.client_bytes["l2_to_client"] += served * self._page_bytes(msg.session, t.pool)

    def _count_reserved(self, msg: P.Reserve, answer: P.Reserved) -> None:
        for t, row in zip(msg.transfers, answer.offsets):
            granted = (len(row) - row.count(P.SLOT_PRESENT) - row.count(P.SLOT_NO_SPACE)
                       - row.count(P.SLOT_INFLIGHT))
            self.client_bytes["client_to_l2"] += granted * self._page_bytes(msg.session, t.pool)

    @staticmethod
    def _add(counts: dict, tier: str, pool: str, n: int) -> None:
        if n:
            counts[(tier, pool)] = counts.get((tier, pool), 0) + n

    # ------------------------------------------------------------ views

    def render(self) -> bytes:
        """Prometheus text exposition (blocks until the control loop answers the snapshot)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def stats_json(snap: dict) -> dict:
    """``GET /stats``: per tier and pool, from one ``Metrics.snapshot()``."""
    st, tier = snap["stats"], snap["stats"]["l3_tier"]
    hits, misses = snap["hits"], snap["misses"]

    def total(counts: dict, tier_name: str) -> int:
        return sum(n for (t, _), n in counts.items() if t == tier_name)

    pools = {}
    for pool in sorted({p for _, p in (*hits, *misses)} | set(snap["pools"])):
        held = snap["pools"].get(pool, {"pages": 0, "bytes": 0})
        pools[pool] = {"l2_pages": held["pages"], "l2_bytes": held["bytes"],
                       **{f"{t}_{what}": counts.get((t, pool), 0)
                          for t in ("l2", "l3") for what, counts in (("hits", hits),
                                                                     ("misses", misses))}}
    return {
        "status": "draining" if snap["draining"] else "serving",
        "requests": st["requests"],
        "sessions": st["sessions"],
        "tiers": {
            "l2": {"pages": st["l2_pages"], "used_bytes": st["l2_used_bytes"],
                   "capacity_bytes": snap["arena_bytes"], "free_slabs": st["arena_free_slabs"],
                   "hits": total(hits, "l2"), "misses": total(misses, "l2"),
                   "evictions": st["evictions"], "no_space": st["no_space"],
                   "evictions_ahead": st.get("evictions_ahead", 0),
                   "eviction": st.get("eviction"), "orphan_bytes": st.get("l2_orphan_bytes"),
                   "leases": st["leases"], "reservations": st["reservations"],
                   "expired_leases": st["expired_leases"],
                   "expired_reservations": st["expired_reservations"],
                   "set_ahead_slots": st["set_ahead_slots"],
                   "set_ahead_bytes": st["set_ahead_bytes"],
                   "fenced_bytes": st["fenced_bytes"],
                   "parked_gets": st["parked_gets"], "parked_exists": st["parked_exists"],
                   "parked_store_waits": st["parked_store_waits"],
                   "flush": st["l2_flush"], "presence_table": st["presence"]},
            "l3": {**tier, "hits": total(hits, "l3"), "misses": total(misses, "l3"),
                   "backend_stats": st["l3"], **snap["l3_bytes"]},
        },
        "pools": pools,
        "adoption": st.get("adoption"),
        "bytes_moved": {**snap["client_bytes"], **snap["l3_bytes"]},
        "namespaces": snap["namespaces"],
        "counted": snap.get("counted", True),  # False: no admin API, no hit / miss counters
    }


class _Collector:
    """Reads one snapshot per scrape and turns it into metric families."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily as C
        from prometheus_client.core import GaugeMetricFamily as G

        try:
            snap = self.metrics.daemon.call(self.metrics.snapshot, SCRAPE_TIMEOUT_S)
        except HicachedError:  # stuck or stopping: say so instead of failing the scrape
            yield G("hicached_up", "1 when the control loop answered this scrape", value=0)
            return
        st, tier = snap["stats"], snap["stats"]["l3_tier"]
        yield G("hicached_up", "1 when the control loop answered this scrape", value=1)
        yield G("hicached_draining", "1 while shutting down", value=int(snap["draining"]))

        def labeled(cls, name, doc, labels, items):
            fam = cls(name, doc, labels=labels)
            for key, value in items:
                fam.add_metric(list(key) if isinstance(key, tuple) else [key], value)
            return fam

        yield labeled(C, "hicached_requests", "Requests answered, per op and outcome "
                      "(ok, the error code, or shared: an exists a client answered from the "
                      "presence table, a get that needed no request)", ["op", "outcome"], snap["requests"].items())
        yield C("hicached_frames", "Frames read from the control socket", value=st["requests"])
        yield labeled(C, "hicached_hits", "Pages served by gets, per tier and pool",
                      ["tier", "pool"], snap["hits"].items())
        yield labeled(C, "hicached_misses", "Pages gets asked for that a tier did not have",
                      ["tier", "pool"], snap["misses"].items())
        yield labeled(C, "hicached_exists_keys", "Keys asked by exists calls, per anchor pool",
                      ["pool"], snap["exists_keys"].items())
        yield labeled(C, "hicached_exists_hit_pages", "Pages exists answered as hits, per pool",
                      ["pool"], snap["exists_hits"].items())
        yield labeled(C, "hicached_bytes_moved", "Page bytes moved, per direction",
                      ["direction"], [*snap["client_bytes"].items(), *snap["l3_bytes"].items()])
        yield G("hicached_arena_bytes", "Size of the shared-memory arena",
                value=snap["arena_bytes"])
        yield G("hicached_arena_used_bytes", "Arena bytes held by pages", value=st["l2_used_bytes"])
        yield G("hicached_arena_free_slabs", "Arena slabs not given to any page size",
                value=st["arena_free_slabs"])
        flush = st["l2_flush"]
        yield G("hicached_l2_flush_slabs_left", "Arena slabs an L2 flush under way has yet to "
                "walk (0: none under way)",
                value=flush["slabs"] - flush["slab"] if flush else 0)
        table = st["presence"] or {"keys": 0, "slots": 0, "full": False}
        yield G("hicached_presence_keys", "Keys in the shared presence table (clients answer "
                "exists from it)", value=table["keys"])
        yield G("hicached_presence_slots", "Slots of that table (0: none)", value=table["slots"])
        yield G("hicached_presence_full", "1 when that table is full: every exists goes "
                "through the socket", value=int(table["full"]))
        yield labeled(G, "hicached_l2_pages", "Pages in L2, per pool", ["pool"],
                      [(p, v["pages"]) for p, v in snap["pools"].items()])
        yield labeled(G, "hicached_l2_bytes", "Page bytes in L2, per pool", ["pool"],
                      [(p, v["bytes"]) for p, v in snap["pools"].items()])
        for key, doc in (("evictions", "L2 pages evicted"),
                         ("evictions_ahead", "L2 pages evicted while the daemon was idle"),
                         ("no_space", "Keys a set could not store (arena or quota full)"),
                         ("expired_leases", "Leases released by their TTL"),
                         ("expired_reservations", "Reservations freed by their TTL"),
                         ("get_wait_timeouts", "Gets answered before their L3 loads finished"),
                         ("exists_wait_timeouts",
                          "Exists answered before the L3 store answered its lookup"),
                         ("store_waits", "WaitStored requests (pages awaited in L3)"),
                         ("store_wait_timeouts",
                          "WaitStored answered store_timeout: pages not in L3 by the deadline")):
            yield C(f"hicached_{key}", doc, value=st[key])
        for key, doc in (("sessions", "Connected clients"), ("leases", "Leases held"),
                         ("reservations", "Reservations open"),
                         ("set_ahead_bytes", "Arena bytes held as clients' set-ahead slots"),
                         ("fenced_bytes", "Arena bytes a stalled client may still write"),
                         ("parked_gets", "Gets waiting for L3 loads"),
                         ("parked_exists", "Exists waiting for an L3 lookup"),
                         ("parked_store_waits", "WaitStored requests waiting for L3 writes")):
            yield G(f"hicached_{key}", doc, value=st[key])
        kv = st["kv_events"]
        yield C("hicached_kv_events_published", "KV events sent to routers (kv_events_endpoint)",
                value=kv["published"])
        yield C("hicached_kv_events_dropped", "KV events dropped: the publisher's queue was "
                "full", value=kv["dropped"])
        yield from self._l3(tier, C, G)
        yield from self._l3_store(st.get("l3") or {}, C, G)
        yield from self._l3_integrity(tier["backend"], st.get("l3") or {}, C)
        yield from self._namespaces(snap["namespaces"], C, G)
        yield from self._adoption(st.get("adoption"), C, G)

    @staticmethod
    def _l3(tier: dict, C, G):
        info = G("hicached_l3_backend_info", "The L3 backend and write policy",
                 labels=["backend", "write_policy"])
        info.add_metric([tier["backend"], tier["write_policy"]], 1)
        yield info
        yield G("hicached_l3_attached", "1 when an L3 backend is attached",
                value=int(tier["attached"]))
        yield G("hicached_l3_degraded", "1 while the L3 backend fails (answered as misses)",
                value=int(tier["degraded"]))
        gauges = ("dirty_pages", "loading_pages", "jobs_in_flight", "writing_bytes")
        for key in gauges:  # levels, not counts
            yield G(f"hicached_l3_{key}", f"L3 tier: {key.replace('_', ' ')}",
                    value=tier.get(key, 0))
        skip = {"backend", "attached", "degraded", "write_policy", "write_through_threshold",
                "prefetch", *gauges}
        for key, value in tier.items():  # the tier's counters (l3_errors, l3_loads, ...)
            if key not in skip and isinstance(value, int) and not isinstance(value, bool):
                name = key if key.startswith("l3_") else f"l3_{key}"
                yield C(f"hicached_{name}", f"L3 tier counter {key}", value=value)

    @staticmethod
    def _l3_store(backend: dict, C, G):
        """What a store that keeps its own accounts (file, hf3fs) holds; absent otherwise."""
        for key, doc in (("pages", "Pages the L3 store holds (this node's share)"),
                         ("bytes", "Bytes the L3 store's pages take (this node's share)"),
                         ("capacity", "Bytes the L3 store may take (this node's share)")):
            value = backend.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                name = "capacity_bytes" if key == "capacity" else key
                yield G(f"hicached_l3_store_{name}", doc, value=value)
        if isinstance(backend.get("evictions"), int):
            yield C("hicached_l3_store_evictions", "Pages the L3 store deleted to make room",
                    value=backend["evictions"])

    @staticmethod
    def _l3_integrity(backend: str, stats: dict, C):
        """Copies that did not verify on load (``backends/integrity.py``): misses, removed."""
        failures = C("hicached_l3_integrity_failures", "L3 page copies whose checksum or "
                     "identity did not verify on load (a miss; the copy is dropped)",
                     labels=["backend", "pool"])
        for pool, n in sorted((stats.get("integrity_failures_by_pool") or {}).items()):
            failures.add_metric([backend, pool], n)
        yield failures

    @staticmethod
    def _namespaces(namespaces: list[dict], C, G):
        held = G("hicached_namespace_l2_bytes", "L2 bytes a namespace holds",
                 labels=["namespace"])
        clients = G("hicached_namespace_sessions", "Client sessions of a namespace",
                    labels=["namespace"])
        fams = {
            "quota_bytes": G("hicached_namespace_l2_quota_bytes", "L2 quota of a namespace",
                             labels=["namespace"]),
            "evictions": C("hicached_namespace_quota_evictions", "Pages a namespace evicted "
                           "from its own LRU to stay within its quota", labels=["namespace"]),
            "rejections": C("hicached_namespace_quota_rejections", "Keys refused (no space) "
                            "because a namespace's quota was full of pinned pages",
                            labels=["namespace"]),
        }
        for n in namespaces:
            held.add_metric([n["namespace"]], n["used_bytes"])
            clients.add_metric([n["namespace"]], n["sessions"])
            if n["quota_bytes"] is not None:
                for key, fam in fams.items():
                    fam.add_metric([n["namespace"]], n[key])
        yield from (held, clients, *fams.values())


    @staticmethod
    def _adoption(adoption: dict | None, C, G):
        """What this daemon adopted at its start from the arena a previous one kept (a warm
        restart: ``/stats``'s ``adoption``). A daemon that reports none adopted nothing: zeros,
        and ``hicached_adoption_cold`` 1."""
        a = adoption or {}
        yield C("hicached_adopted_pages", "Committed pages this daemon adopted at its start from "
                "the arena a previous daemon kept (warm restart)", value=a.get("pages", 0))
        yield C("hicached_adopted_bytes", "Page bytes of those pages", value=a.get("bytes", 0))
        dropped = C("hicached_adoption_dropped_pages", "Pages of the kept arena not adopted, "
                    "per reason (never served)", labels=["reason"])
        for reason, n in sorted((a.get("dropped") or {}).items()):
            dropped.add_metric([reason], n)
        yield dropped
        yield G("hicached_adoption_seconds", "Seconds the adoption took at start (0: a cold "
                "start)", value=a.get("seconds", 0.0))
        yield G("hicached_adoption_cold", "1 when this daemon started cold (no arena kept, "
                "another geometry, --cold): nothing adopted",
                value=int(not a or a.get("cold_reason") is not None))


def make_metrics(daemon, enabled: bool) -> NullMetrics:
    return Metrics(daemon) if enabled else NullMetrics(daemon)
