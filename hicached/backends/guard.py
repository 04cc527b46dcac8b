"""Guards for calls into a store's client library: deadlines on helper threads, and a breaker.

A store client (Mooncake, 3FS) can block for tens of seconds when its server is dead or hung
(Mooncake: ~4 s per call against a dead master, 30 s against a hung one). The daemon cannot
afford that: ``exists`` runs on the single prober thread, which every lookup (each exists,
each get of keys not known to be in L3) queues behind. So every call goes through two guards:

``DeadlineCaller``  runs the call on a helper thread and waits at most ``timeout_s``. A call
                    that overruns is *abandoned*: its helper keeps running it and rejoins the
                    idle set when the library returns, while the caller gets ``CallTimeout``.
                    Later calls take another idle helper (or a new one, up to ``max_threads``),
                    so nothing ever queues behind a stuck call. With every helper stuck, calls
                    fail at once with ``CallerBusy``.
``Breaker``         healthy / degraded. The first failure of an episode is logged (once) and
                    opens the breaker: calls are refused at once (fast misses) until a backoff
                    passes, then one caller is let through as a probe. Its success closes the
                    breaker (logged once); its failure doubles the backoff (up to a maximum).

Neither knows anything about the store: the backend decides what counts as a failure.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from hicached.errors import BackendError

log = logging.getLogger(__name__)


class StoreUnavailable(BackendError):
    """A store call failed in a way that says the store is unreachable (or the breaker is open).

    Raised inside backends only; the backend answers misses (the L3 contract never raises)."""


class CallTimeout(StoreUnavailable):
    """A guarded call did not finish within its deadline and was abandoned."""


class CallerBusy(StoreUnavailable):
    """Every helper thread is still stuck in an abandoned call."""


class _Box:
    """One call's result, handed from the helper to the waiting caller."""

    __slots__ = ("abandoned", "args", "done", "error", "fn", "lock", "value")

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()


class DeadlineCaller:
    """``call(fn, *args, timeout_s=...)``: ``fn(*args)`` on a helper thread, bounded in time.

    Helpers are daemon threads (a call stuck in C code must not hold up interpreter exit), each
    with its own queue, so a call never waits for another call. Thread-safe.
    """

    def __init__(self, name: str, max_threads: int = 16):
        self.name = name
        self.max_threads = max_threads
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []
        self._threads = 0
        self.abandoned_total = 0
        self.abandoned_running = 0  # abandoned calls the library has not returned from yet
        self._all_idle = threading.Condition(self._lock)
        self._closed = False

    def call(self, fn: Callable, *args: Any, timeout_s: float) -> Any:
        """Result of ``fn(*args)``; re-raises its exception; ``CallTimeout`` past ``timeout_s``."""
        box = _Box(fn, args)
        with self._lock:
            if self._idle:
                q = self._idle.pop()
            elif self._threads < self.max_threads:
                q = queue.SimpleQueue()
                self._threads += 1
                threading.Thread(target=self._helper, args=(q,), daemon=True,
                                 name=f"{self.name}-call-{self._threads}").start()
            else:
                raise CallerBusy(f"{self.name}: all {self.max_threads} helper threads are stuck "
                                 "in abandoned calls")
        q.put(box)
        if not box.done.wait(timeout_s):
            with box.lock:
                if not box.done.is_set():  # else it finished just now: take the result
                    box.abandoned = True
                    self.abandoned_total += 1
                    self.abandoned_running += 1
                    raise CallTimeout(f"{getattr(fn, '__name__', 'call')} did not finish "
                                      f"within {timeout_s:g} s (abandoned)")
        if box.error is not None:
            raise box.error
        return box.value

    def _helper(self, q: queue.SimpleQueue) -> None:
        while True:
            box = q.get()
            if box is None:
                return
            try:
                box.value = box.fn(*box.args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who re-raises it
                box.error = e
            with box.lock:
                box.done.set()
                late = box.abandoned
            box.fn = box.args = None
            with self._lock:
                if late:
                    self.abandoned_running -= 1
                    log.info("%s: an abandoned call returned after all", self.name)
                if self._closed:
                    self._threads -= 1
                else:
                    self._idle.append(q)
                if len(self._idle) == self._threads:
                    self._all_idle.notify_all()
                if self._closed:
                    return

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is running (abandoned ones included); True if so in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self._idle) < self._threads:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._all_idle.wait(left)
            return True

    def close(self) -> None:
        """Stop the idle helpers (a stuck one ends when its call returns, or with the process)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._threads -= len(idle)
            self._closed = True
            self.max_threads = 0  # no new helpers
        for q in idle:
            q.put(None)


class Breaker:
    """Healthy / degraded state of one store, with exponential backoff and a single probe.

        admit()  healthy -> True; degraded -> False (a fast miss) until ``retry_at``, then True
                 for exactly one caller (the probe) until that caller reports back
        ok()     a call worked: closes the breaker (logs the recovery once)
        failed() a call says the store is unreachable: opens the breaker (logs once per
                 episode), or doubles the backoff of an open one

    Thread-safe; the clock is injectable for tests.
    """

    def __init__(self, name: str, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self._lock = threading.Lock()
        self.degraded = False
        self.degraded_since = 0.0
        self.episodes = 0
        self.failures = 0
        self.fast_misses = 0
        self.recoveries = 0  # degraded -> healthy transitions (the store may have lost pages)
        self.last_error = ""
        self._backoff = backoff_s
        self._retry_at = 0.0
        self._probing = False

    def admit(self) -> bool:
        with self._lock:
            if not self.degraded:
                return True
            if not self._probing and self.clock() >= self._retry_at:
                self._probing = True
                return True
            self.fast_misses += 1
            return False

    def refuse(self) -> None:
        """Count a call answered as a miss without trying (e.g. no client yet)."""
        with self._lock:
            self.fast_misses += 1

    def ok(self) -> None:
        with self._lock:
            self._probing = False
            if not self.degraded:
                return
            self.degraded = False
            self.recoveries += 1
            self._backoff = self.backoff_s
            down_s = self.clock() - self.degraded_since
            fast = self.fast_misses
        log.warning("%s recovered after %.1f s (%d calls answered as fast misses meanwhile)",
                    self.name, down_s, fast)

    def failed(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            self.last_error = reason
            self._probing = False
            now = self.clock()
            if self.degraded:
                self._backoff = min(self._backoff * 2, self.max_backoff_s)
                self._retry_at = now + self._backoff
                return
            self.degraded = True
            self.degraded_since = now
            self.episodes += 1
            self._backoff = self.backoff_s
            self._retry_at = now + self._backoff
        log.warning("%s unavailable: %s; answering misses (retrying every <= %g s) until it "
                    "recovers; further failures are only counted", self.name, reason,
                    self.max_backoff_s)

    def stats(self) -> dict:
        with self._lock:
            return {
                "degraded": self.degraded,
                "degraded_for_s": round(self.clock() - self.degraded_since, 3)
                if self.degraded else 0.0,
                "degraded_episodes": self.episodes,
                "failures": self.failures,
                "fast_misses": self.fast_misses,
                "last_error": self.last_error,
            }
