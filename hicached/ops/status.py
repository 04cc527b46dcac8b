"""The live status page of the admin API (``GET /``, ``GET /status.json``): a bounded ring of
samples of the daemon's stats, and the chart series derived from it.

    admin API thread (asyncio)                          control loop
    ------------------------------------------------    -------------------------------------
    Sampler.run, every status_sample_s:  -- Daemon.call ->  Metrics.status_sample: a snapshot,
      awaited in an executor, one at a time                 the slowest calls since the last
    StatusRing.add(stats_json(snapshot), ...)  <-------     one, the snapshot's cost
    GET /status.json -> StatusRing.view(): the series, derived once per sample (cached)
    GET /            -> status.html, a static page whose script polls /status.json

Serving the page never touches the control loop: the handlers read the ring only. The sampler
costs the loop one ``/stats`` snapshot per sample, except the orphan count (about a microsecond a
key record, ``daemon/orphans.py``): a sample counts it only once ``ORPHAN_SHARE`` times the
last counting snapshot's cost has passed (at most ~1 % of the loop), and carries the last count
otherwise. The ring holds ``SAMPLES`` flat records of numbers (a few KiB each): counters
(cumulative), levels (values at the sample) and the rates against the sample before (derived
once, when a sample is added), so a view is columns picked out of the records: about 6 ms and
80 KB for a full ring with 24 namespaces. Nothing in it is a key or page bytes; namespaces are
names, as in ``/stats``.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import logging
import re
import time
from collections import deque
from importlib import resources
from typing import NamedTuple

from hicached.daemon.metrics import stats_json
from hicached.errors import HicachedError, ShuttingDown

log = logging.getLogger(__name__)

SAMPLES = 300  # 10 minutes at the default status_sample_s = 2
ORPHAN_SHARE = 100  # an orphan count waits 100x its cost: at most ~1 % of the control loop
SAMPLE_TIMEOUT_S = 10.0  # a loop that does not answer a sample within this: a gap in the charts
SLOWEST = 10  # calls in the page's table
MAX_NAMESPACES = 16  # namespaces charted (the largest; /stats lists them all)
L3_COUNTERS = ("l3_errors", "l3_load_failures", "l3_write_failures", "l3_writes_dropped",
               "l3_copies_lost")


class Sample(NamedTuple):
    """One sample of the ring: numbers only, keyed by tuples such as ``("hits", "l2", "kv")``."""

    t: float  # unix time the snapshot was taken
    counters: dict  # cumulative counts
    levels: dict  # values at t
    slow: list  # the slowest calls since the previous sample (``Metrics.take_slow``)
    rates: dict  # against the sample before it, derived once (``rates``)


def flatten(stats: dict) -> tuple[dict, dict]:
    """(counters, levels) of one ``stats_json`` answer."""
    l2, l3 = stats["tiers"]["l2"], stats["tiers"]["l3"]
    counters: dict = {}
    for pool, p in stats["pools"].items():
        for tier in ("l2", "l3"):
            counters[("hits", tier, pool)] = p[f"{tier}_hits"]
            counters[("misses", tier, pool)] = p[f"{tier}_misses"]
    for direction, n in stats["bytes_moved"].items():
        counters[("bytes", direction)] = n
    for key in ("evictions", "no_space", "expired_leases"):
        counters[(key,)] = l2[key]
    counters[("quota_evictions",)] = sum(n["evictions"] for n in stats["namespaces"])
    counters[("quota_rejections",)] = sum(n["rejections"] for n in stats["namespaces"])
    for key in L3_COUNTERS:
        counters[(key,)] = l3.get(key, 0)
    failures = (l3.get("backend_stats") or {}).get("integrity_failures")
    if isinstance(failures, int):
        counters[("integrity_failures",)] = failures
    levels: dict = {("l2_used",): l2["used_bytes"], ("l2_capacity",): l2["capacity_bytes"],
                    ("sessions",): stats["sessions"], ("leases",): l2["leases"],
                    ("reservations",): l2["reservations"],
                    ("parked",): (l2["parked_gets"] + l2["parked_exists"]
                                  + l2.get("parked_store_waits", 0)),
                    ("dirty_pages",): l3["dirty_pages"], ("jobs_in_flight",): l3["jobs_in_flight"],
                    ("loading_pages",): l3["loading_pages"],
                    ("degraded",): int(bool(l3["attached"] and l3["degraded"]))}
    if l2.get("orphan_bytes") is not None:
        levels[("orphan_bytes",)] = l2["orphan_bytes"]
    largest = sorted(stats["namespaces"], key=lambda n: -n["used_bytes"])[:MAX_NAMESPACES]
    for n in largest:
        levels[("ns", n["namespace"])] = n["used_bytes"]
        if n["quota_bytes"] is not None:
            levels[("quota", n["namespace"])] = n["quota_bytes"]
    return counters, levels


def _num(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def rates(before: Sample | None, t: float, counters: dict, slow: list) -> dict:
    """What the charts show of a sample against the one ``before`` it: each counter's rate per
    second (under the counter's key), the hit rate in % of each tier and pool that was asked
    for pages (``("hit_pct", tier, pool)``), and the slowest call of each op in milliseconds
    (``("slowest", op)``). Derived once, when the sample is added."""
    out: dict = {}
    for c in slow:
        key = ("slowest", c["op"])
        out[key] = max(out.get(key, 0.0), _num(c["ms"]))
    if before is None or t <= before.t:
        return out
    dt, old = t - before.t, before.counters
    for key, n in counters.items():
        if key in old:
            out[key] = _num(max(0, n - old[key]) / dt)
        if key[0] == "hits":
            misses = ("misses", *key[1:])
            h = n - old.get(key, 0)
            m = counters.get(misses, 0) - old.get(misses, 0)
            if h + m > 0:
                out[("hit_pct", *key[1:])] = _num(100 * h / (h + m))
    return out


class StatusRing:
    """The last ``size`` samples and the latest ``/stats`` answer. Used on the admin API's
    event loop only (the sampler adds, the handlers read): no lock."""

    def __init__(self, interval_s: float, size: int = SAMPLES):
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=size)
        self.latest: dict | None = None  # the last sample's stats_json
        self.cost_s = 0.0  # what the last sample cost the control loop
        self.orphans_at: float | None = None  # when the orphan count shown was counted
        self._orphans = None
        self._view: tuple[int, bytes] | None = None  # (len of the ring's history, JSON)
        self._added = 0

    def add(self, t: float, stats: dict, slow: list, cost_s: float, orphans: bool) -> None:
        """One sample: ``stats`` (``stats_json``; its orphan count is taken if ``orphans``,
        else the last one is put in), the slowest calls, and the sample's cost on the loop."""
        l2 = stats["tiers"]["l2"]
        if orphans:
            self._orphans, self.orphans_at = l2.get("orphan_bytes"), t
        else:
            l2["orphan_bytes"] = self._orphans
        counters, levels = flatten(stats)
        before = self.samples[-1] if self.samples else None
        self.samples.append(Sample(t, counters, levels, slow, rates(before, t, counters, slow)))
        self.latest, self.cost_s = stats, cost_s
        self._added += 1

    def view(self) -> bytes:
        """``GET /status.json``: derived once per sample, whoever asks."""
        if self._view is None or self._view[0] != self._added:
            body = json.dumps(self.derive(), separators=(",", ":"), default=str).encode()
            self._view = (self._added, body)
        return self._view[1]

    def derive(self) -> dict:
        """Times, the latest stats and each chart's series (``status.html`` draws them)."""
        s = list(self.samples)
        return {"interval_s": self.interval_s, "window_s": self.interval_s * self.samples.maxlen,
                "t": [round(x.t, 3) for x in s], "stats": self.latest,
                "sample_cost_ms": round(self.cost_s * 1e3, 3), "orphans_at": self.orphans_at,
                "charts": charts(s), "slowest": slowest(s)}


# ------------------------------------------------------------ series


def _keys(keys: set, head: str) -> list[tuple]:
    return sorted(k for k in keys if k[0] == head)


def _last(values: list) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def counter(samples: list[Sample], key: tuple, name: str) -> dict:
    """A counter's series: its rate per second; ``total`` (at the last sample, as ``/stats``
    says) and ``window`` (counted between the first and the last sample)."""
    values = [x.rates.get(key) for x in samples]
    first, total = samples[0].counters.get(key, 0), samples[-1].counters.get(key, 0)
    return {"name": name, "values": values, "last": _last(values), "total": total,
            "window": total - first}


def level(samples: list[Sample], key: tuple, name: str, **extra) -> dict:
    values = [x.levels.get(key) for x in samples]
    return {"name": name, "values": values, "last": _last(values), **extra}


def hit_rate(samples: list[Sample], tier: str, pool: str) -> dict:
    """Pages served per pages asked of ``tier`` in ``pool``, in % per interval (None: none
    asked); ``hits``/``misses``: the totals ``/stats`` shows."""
    hits, misses = ("hits", tier, pool), ("misses", tier, pool)
    values = [x.rates.get(("hit_pct", tier, pool)) for x in samples]
    end, start = samples[-1].counters, samples[0].counters
    h, m = end.get(hits, 0) - start.get(hits, 0), end.get(misses, 0) - start.get(misses, 0)
    return {"name": f"{tier.upper()} {pool}", "values": values, "last": _last(values),
            "hits": end.get(hits, 0), "misses": end.get(misses, 0),
            "window_pct": _num(100 * h / (h + m)) if h + m > 0 else None}


def chart(id_: str, title: str, unit: str, series: list[dict], limits=(), note="") -> dict:
    """A chart of ``status.html``: lines (``series``), dashed horizontal ``limits`` ({name,
    value, of: the series it bounds}), a unit (``B``, ``B/s``, ``/s``, ``%``, ``ms``, ``""``)."""
    return {"id": id_, "title": title, "unit": unit, "note": note, "series": series,
            "limits": list(limits)}


def charts(s: list[Sample]) -> list[dict]:
    """Every chart of the page, from the ring's samples (oldest first)."""
    if not s:
        return []
    counted = set().union(*(x.counters for x in s))  # every key of the window
    held, derived = set().union(*(x.levels for x in s)), set().union(*(x.rates for x in s))
    asked = [(k[1], k[2]) for k in _keys(counted, "hits")
             if s[-1].counters.get(k, 0) + s[-1].counters.get(("misses", *k[1:]), 0) > 0]
    last = s[-1].levels
    namespaces = [k[1] for k in _keys(held, "ns")]
    occupancy = [level(s, ("l2_used",), "used")]
    if ("orphan_bytes",) in held:
        occupancy.append(level(s, ("orphan_bytes",), "orphans (no hit can use)"))
    l3_failures = [counter(s, (k,), k.removeprefix("l3_").replace("_", " "))
                   for k in L3_COUNTERS]
    if ("integrity_failures",) in s[-1].counters:
        l3_failures.insert(0, counter(s, ("integrity_failures",), "integrity failures"))
    return [
        chart("hit-rate", "Hit rate per tier and pool", "%",
              [hit_rate(s, tier, pool) for tier, pool in asked],
              note="pages served / pages asked by gets, per interval"),
        chart("served", "Pages served per tier and pool", "/s",
              [counter(s, ("hits", tier, pool), f"{tier.upper()} {pool}")
               for tier, pool in asked]),
        chart("l2", "L2 occupancy", "B", occupancy,
              [{"name": "capacity", "value": last.get(("l2_capacity",)), "of": "used"}]),
        chart("namespaces", "L2 per namespace against its quota", "B",
              [level(s, ("ns", n), n) for n in namespaces],
              [{"name": f"quota {n}", "value": last[("quota", n)], "of": n}
               for n in namespaces if ("quota", n) in last]),
        chart("bytes-moved", "Bytes moved per direction", "B/s",
              [counter(s, k, k[1].replace("_", " ")) for k in _keys(counted, "bytes")]),
        chart("evictions", "Evictions and no-space answers", "/s",
              [counter(s, (k,), name) for k, name in (
                  ("evictions", "L2 evictions"), ("no_space", "no-space answers"),
                  ("quota_evictions", "quota evictions"),
                  ("quota_rejections", "quota rejections"),
                  ("expired_leases", "expired leases"))]),
        chart("l3-queue", "L3 write queue and dirty pages", "",
              [level(s, ("dirty_pages",), "dirty pages"),
               level(s, ("jobs_in_flight",), "write queue (jobs)"),
               level(s, ("loading_pages",), "loading pages"),
               level(s, ("degraded",), "degraded", band=True)]),
        chart("l3-failures", "L3 failures", "/s", l3_failures),
        chart("clients", "Sessions and leases", "",
              [level(s, (k,), k) for k in ("sessions", "leases", "reservations", "parked")]),
        chart("latency", "Slowest call per interval, per op", "ms",
              [slowest_of(s, key[1]) for key in _keys(derived, "slowest")]),
    ]


def slowest_of(s: list[Sample], op: str) -> dict:
    values = [x.rates.get(("slowest", op)) for x in s]
    return {"name": op, "values": values, "last": _last(values)}


def slowest(s: list[Sample]) -> list[dict]:
    """The ``SLOWEST`` slowest calls of the window, slowest first."""
    calls = sorted((c for x in s for c in x.slow), key=lambda c: -c["ms"])[:SLOWEST]
    return [{**c, "ms": _num(c["ms"]), "t": round(c["t"], 3)} for c in calls]


# ------------------------------------------------------------ sampler


class Sampler:
    """Fills a ``StatusRing`` every ``ring.interval_s`` from ``daemon`` (a ``Daemon`` with
    ``Metrics``). ``run()`` is a task of the admin API's event loop, cancelled at its close;
    the loop never waits on the control loop (the call is awaited in an executor), and a
    sample is not started before the previous one is answered."""

    def __init__(self, daemon, ring: StatusRing):
        self.daemon, self.ring = daemon, ring

    async def run(self) -> None:
        loop, d = asyncio.get_running_loop(), self.daemon
        orphans_due, failing = 0.0, False
        while True:
            started = loop.time()
            orphans = started >= orphans_due
            try:
                snap, slow, cost_s = await loop.run_in_executor(None, functools.partial(
                    d.call, functools.partial(d.metrics.status_sample, orphans),
                    SAMPLE_TIMEOUT_S))
                self.ring.add(time.time(), stats_json(snap), slow, cost_s, orphans)
            except ShuttingDown:  # the daemon stops: the page keeps what it has
                return
            except Exception as e:  # a missed sample is a gap in the charts, never the end
                if not failing:
                    log.log(logging.WARNING if isinstance(e, HicachedError) else logging.ERROR,
                            "status page: no sample (%s: %s); trying again every %s s",
                            type(e).__name__, e, self.ring.interval_s,
                            exc_info=not isinstance(e, HicachedError))
                failing = True
            else:
                if failing:
                    log.info("status page: sampling again")
                failing = False
                if orphans:
                    orphans_due = started + ORPHAN_SHARE * cost_s
            await asyncio.sleep(max(0.0, started + self.ring.interval_s - loop.time()))


# ------------------------------------------------------------ the adoption line


def adoption_line(adoption: dict | None) -> str:
    """How this daemon started, from ``/stats``'s ``adoption`` (None: a daemon that reports no
    adoption, a cold start): what ``hicached status`` and the page (``renderAdoption``, the
    same words) show."""
    if not adoption or (adoption.get("cold_reason") is not None and not adoption.get("pages")):
        reason = (adoption or {}).get("cold_reason")
        return "cold start" + (f": {reason}" if reason else "")
    dropped = adoption.get("dropped") or {}
    gone = ", ".join(f"{n:,} {why}" for why, n in sorted(dropped.items()))
    return (f"warm start: adopted {adoption['pages']:,} pages "
            f"({adoption['bytes'] / (1 << 30):.2f} GiB) in {adoption['seconds']:.2f} s; "
            + (f"dropped {sum(dropped.values()):,} ({gone})" if dropped else "none dropped"))


# ------------------------------------------------------------ the page


@functools.cache
def status_page() -> tuple[bytes, dict]:
    """``GET /``: ``status.html`` (package data) and its headers. The Content-Security-Policy
    lets the page run its own inline script only (by hash) and fetch from this daemon only: the
    browser makes no other request."""
    html = resources.files("hicached.ops").joinpath("status.html").read_text("utf-8")
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"
        for script in re.findall(r"<script>(.*?)</script>", html, re.DOTALL))
    csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    return html.encode(), {"Content-Type": "text/html; charset=utf-8",
                           "Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                           "Cache-Control": "no-cache"}
