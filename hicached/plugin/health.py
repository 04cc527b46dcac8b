"""Counters, once-per-episode logging and SGLang storage metrics for the engine plugins.

An engine must keep serving when its storage daemon is down or slow: every I/O call then answers
a miss. That must be visible without flooding the log, so failures are grouped in *episodes*:

    call ok ... ok | fail fail fail ... fail | ok ...
                   ^ warning: "unavailable"   ^ info: "reachable again after N misses"

Every failed call is counted (``unavailable``: daemon down / slow; ``errors``: anything else, each
kind logged once). ``PluginHealth.get_stats`` returns the counters together with SGLang's
``StorageMetrics`` histogram lists (pages and GB/s per read / write call), drained per call.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("hicached.plugin")

MAX_SAMPLES = 4096  # per histogram list between two get_stats calls (older samples are dropped)
COUNTERS = (
    "calls",  # I/O calls made by the engine
    "unavailable",  # calls answered as misses because the daemon was down or too slow
    "errors",  # calls answered as misses for any other reason (logged once per kind)
    "episodes",  # times the daemon became unavailable
    "exists_pages",  # pages asked about in exists calls
    "hit_pages",  # pages answered as restorable
    "read_pages",  # pages asked for in reads
    "read_hit_pages",  # pages read
    "write_pages",  # pages asked to be written
    "written_pages",  # pages stored (or already there)
    "skipped_write_pages",  # replicated pages a non-writer TP rank was asked to write
    "unsupported_pool_pages",  # pages of pools not registered or refused, or bad indices
)


@dataclass
class PluginStats:
    """What ``get_stats`` returns when SGLang's ``StorageMetrics`` is not importable: the same
    four histogram lists, plus ``counters`` (which SGLang's object carries too)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)


def _storage_metrics_class() -> type:
    """SGLang's ``StorageMetrics`` if SGLang already imported it (never imported from here: the
    module pulls in most of SGLang), else ``PluginStats``."""
    module = sys.modules.get("sglang.srt.observability.metrics_collector")
    return getattr(module, "StorageMetrics", None) or PluginStats


class PluginHealth:
    """Thread-safe counters, episode tracking and metric samples of one plugin instance."""

    def __init__(self, name: str, record_metrics: bool):
        self.name = name
        self.record_metrics = record_metrics
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._down_since: float | None = None
        self._down_calls = 0
        self._warned: set[str] = set()
        self._samples: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}

    def add(self, **counts: int) -> None:
        """Add to counters (names from ``COUNTERS``)."""
        with self._lock:
            for name, n in counts.items():
                self.counters[name] += n

    def ok(self) -> None:
        """A call reached the daemon: ends an unavailability episode."""
        if self._down_since is None:  # racy read is fine: the locked check below decides
            return
        with self._lock:
            if self._down_since is None:
                return
            down_s, misses = time.monotonic() - self._down_since, self._down_calls
            self._down_since, self._down_calls = None, 0
        log.info("%s: hicached reachable again after %.1f s (%d calls answered as misses)",
                 self.name, down_s, misses)

    def unavailable(self, op: str, reason: BaseException | str) -> None:
        """A call could not reach the daemon (answered as a miss); warns once per episode."""
        with self._lock:
            self.counters["calls"] += 1
            self.counters["unavailable"] += 1
            self._down_calls += 1
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
                self.counters["episodes"] += 1
        if first:
            log.warning("%s: hicached unavailable (%s in %s); answering misses until it is back",
                        self.name, reason, op)

    def error(self, op: str, exc: BaseException) -> None:
        """A call failed for another reason (answered as a miss); logged once per kind."""
        self.add(calls=1, errors=1)
        self.warn_once(f"{op}:{type(exc).__name__}",
                       f"{self.name}: {op} failed ({type(exc).__name__}: {exc}); answering a miss")

    def warn_once(self, key: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` the first time ``key`` is seen."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.log(level, message)

    def sample(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """Record one read ("prefetch") or write ("backup") call for SGLang's histograms."""
        if not self.record_metrics or pages <= 0:
            return
        with self._lock:
            for key, value in ((f"{kind}_pgs", pages),
                               (f"{kind}_bandwidth", nbytes / max(seconds, 1e-9) / 1e9)):
                samples = self._samples[key]
                samples.append(value)
                if len(samples) > MAX_SAMPLES:
                    del samples[: len(samples) - MAX_SAMPLES]

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (or ``PluginStats``) with the samples since the last call
        and a ``counters`` attribute (totals since start)."""
        with self._lock:
            samples = {k: list(v) for k, v in self._samples.items()}
            for v in self._samples.values():
                v.clear()
            counters = dict(self.counters)
        stats = _storage_metrics_class()(**samples)
        stats.counters = counters
        return stats
