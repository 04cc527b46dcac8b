"""Releases of get leases, piggybacked on the client's next request.

A get ends by releasing its lease. Sending a ``Release`` of its own costs the client a send and
the daemon a wake-up per get, so the client keeps the lease ids here and the next Exists /
Reserve / Lease carries them (``release`` field; ARCHITECTURE.md, life of a page, step 7).

A client that makes no further request would pin those slots until the lease TTL, so a
background thread (started on first use) sends a plain ``Release`` for ids still waiting
``delay_s`` after the first of them was added. ``delay_s == 0`` sends every release at once,
from the caller's thread.

The same ``Release`` reports the pages the client read with no lease at all (``leaseless.py``:
(offset, tag) pairs, and how many get calls needed no request), so that the daemon counts them as
hits. Those are never piggybacked: they wait for the thread (or ``close``), one message per
``delay_s`` at most however many gets read pages without asking.

Lock order: the client's socket lock, then this object's lock; the thread never holds its
lock while it sends. The thread holds the client only weakly (a client dropped without
``close`` can still be collected) and ends after ``IDLE_EXIT_S`` with nothing to send.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

from hicached.protocol import MAX_TOUCHED

log = logging.getLogger(__name__)

IDLE_EXIT_S = 30.0  # the sender thread ends after this long with nothing to send


class PendingReleases:
    """Lease ids this client is done with and has not told the daemon yet. Thread-safe."""

    def __init__(self, send: Callable[..., None], delay_s: float):
        if delay_s < 0:
            raise ValueError(f"release_delay_s must be >= 0, got {delay_s}")
        # send(ids) / send(ids, touched, gets): a fire-and-forget Release; a bound method is
        # held weakly (see above)
        self._send = (weakref.WeakMethod(send) if hasattr(send, "__self__")
                      else (lambda: send))
        self.delay_s = delay_s
        self._ids: list[int] = []
        self._touched: list[int] = []  # pages read without a lease: offset, tag, offset, ...
        self._gets = 0  # get calls that sent no request
        self._since = 0.0  # when the oldest waiting item was added
        self._cv = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits for ids (no send due): ``add`` must wake it
        self._closed = False
        self.sent_alone = 0  # Release messages the thread had to send (the rest piggybacked)

    def add(self, lease_id: int) -> None:
        if self.delay_s == 0:
            send = self._send()
            if send is not None:
                send([lease_id])
            return
        with self._cv:
            if self._closed:
                return  # the session is ending: Bye frees its leases
            self._waiting()
            self._ids.append(lease_id)

    def add_reads(self, touched: list[int], gets: int) -> None:
        """Pages read without a lease (flat offset, tag pairs) and the calls that needed no
        request: reported by the thread (never piggybacked), or by ``close``."""
        if self.delay_s == 0:
            send = self._send()
            if send is not None:
                send([], touched, gets)
            return
        with self._cv:
            if self._closed:
                return
            self._waiting()
            self._touched += touched
            self._gets += gets
            if len(self._touched) >= 2 * MAX_TOUCHED:  # as much as one Release reports: now
                self._since = float("-inf")
                self._cv.notify()

    def _waiting(self) -> None:
        """Something is about to wait (under the lock): start the clock and the thread."""
        if not (self._ids or self._touched or self._gets):
            self._since = time.monotonic()
            if self._idle:  # else it wakes by itself at its deadline: no wake-up per get
                self._cv.notify()
        if self._thread is None or not self._thread.is_alive():  # (a forked child)
            self._thread = threading.Thread(target=self._run, name="hicached-release",
                                            daemon=True)
            self._thread.start()

    def take(self) -> list[int]:
        """Every waiting id (the caller sends them with its request)."""
        with self._cv:
            ids, self._ids = self._ids, []
            return ids

    def drop(self) -> None:
        """Forget what waits (a new session: the daemon that leased those pages is gone)."""
        with self._cv:
            self._ids, self._touched, self._gets = [], [], 0

    def close(self) -> tuple[list[int], int]:
        """Stop; the unleased reads not reported yet (touched pairs, gets) for a last Release
        (the ids are dropped: Bye ends every lease of the session)."""
        with self._cv:
            self._closed = True
            reads = self._touched[:2 * MAX_TOUCHED], self._gets
            self._ids, self._touched, self._gets = [], [], 0
            self._cv.notify()
            return reads

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if not (self._ids or self._touched or self._gets):
                    self._idle = True
                    self._cv.wait(IDLE_EXIT_S)
                    self._idle = False
                    if not (self._ids or self._touched or self._gets or self._closed):
                        self._thread = None  # idle: ``add`` starts another when needed
                        return
                    continue
                left = self._since + self.delay_s - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                ids, touched, gets = self._ids, self._touched[:2 * MAX_TOUCHED], self._gets
                self._ids, self._touched, self._gets = [], self._touched[2 * MAX_TOUCHED:], 0
                if self._touched:
                    self._since = float("-inf")  # the rest goes in the next Release, at once
                send = self._send()
                if send is None:  # the client is gone (its leases die with its session)
                    self._thread = None
                    return
                self.sent_alone += 1
                self._cv.release()
                try:
                    if touched or gets:
                        send(ids, touched, gets)
                    else:
                        send(ids)
                except Exception:  # the leases expire on their own
                    log.exception("sending a Release failed")
                finally:
                    self._cv.acquire()
