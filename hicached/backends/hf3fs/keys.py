"""What one 3FS-backend node knows about keys other nodes stored, so ``exists`` stays cheap.

``exists`` runs on the daemon's prober thread, and every lookup queues behind it. This node's
own pages answer from memory (``NodeSpace.live``); for the rest the pointer records on the mount
are the truth, and a metadata lookup on a network filesystem costs from tens of microseconds to
forever (a hung mount). So ``KeyCache`` keeps:

    found    kh -> (expires, Pointer | None)   a pointer record seen (None: only stat-ed)
    absent   kh -> expires                      no pointer record a moment ago
    dead     kh -> Pointer                      a record that names a slot holding another
                                                page now, or a copy that does not verify (a
                                                get found out): it counts as no record while
                                                it stays the same, so the key is missing to
                                                ``exists`` and stored again by a put

and checks unknown keys on one helper thread, in key order, for at most ``budget_s`` per call:
keys it has not reached by then count as misses now (a miss is always safe) and are known on
the next call. Entries expire (other nodes evict), and both maps are bounded.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict

from hicached.backends.hf3fs.format import Pointer
from hicached.backends.hf3fs.records import read_pointer

log = logging.getLogger(__name__)

CACHE_MAX = 1 << 20  # entries per map


class KeyCache:
    """Found / absent keys of any node, and the helper thread that looks them up."""

    def __init__(self, found_ttl_s: float, absent_ttl_s: float, budget_s: float):
        self.found_ttl_s, self.absent_ttl_s, self.budget_s = found_ttl_s, absent_ttl_s, budget_s
        self._found: OrderedDict[bytes, tuple[float, Pointer | None]] = OrderedDict()
        self._absent: OrderedDict[bytes, float] = OrderedDict()
        self._dead: OrderedDict[bytes, Pointer] = OrderedDict()
        self._lock = threading.Lock()
        self.lookups = 0
        self.lookup_errors = 0
        self._busy = False
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="hicached-hf3fs-lookup",
                                        daemon=True)  # a hung mount must not block exit
        self._thread.start()

    # ------------------------------------------------------------ reads (any thread)

    def found(self, kh: bytes, now: float) -> bool:
        hit = self._found.get(kh)
        return hit is not None and hit[0] > now

    def pointer(self, kh: bytes, now: float) -> Pointer | None:
        hit = self._found.get(kh)
        return hit[1] if hit is not None and hit[0] > now else None

    def absent(self, kh: bytes, now: float) -> bool:
        return self._absent.get(kh, 0.0) > now

    def is_dead(self, kh: bytes, ptr: Pointer) -> bool:
        """Did a get find ``ptr``, the record of ``kh``, dead (so reading it again would only
        miss again)?"""
        return self._dead.get(kh) == ptr

    # ------------------------------------------------------------ updates (any thread)

    def remember(self, kh: bytes, ptr: Pointer | None, now: float) -> None:
        """A pointer record exists for ``kh`` (``ptr`` when it was read)."""
        with self._lock:
            self._absent.pop(kh, None)
            self._found[kh] = (now + self.found_ttl_s, ptr)
            self._found.move_to_end(kh)
            if len(self._found) > CACHE_MAX:
                self._found.popitem(last=False)

    def forget(self, kh: bytes, now: float) -> None:
        """No (valid) pointer record for ``kh``."""
        with self._lock:
            self._found.pop(kh, None)
            self._absent[kh] = now + self.absent_ttl_s
            self._absent.move_to_end(kh)
            if len(self._absent) > CACHE_MAX:
                self._absent.popitem(last=False)

    def stored(self, kh: bytes) -> None:
        """This node just published ``kh``: drop a stale miss."""
        with self._lock:
            self._absent.pop(kh, None)
            self._dead.pop(kh, None)

    def dead(self, kh: bytes, ptr: Pointer, now: float) -> None:
        """The record ``ptr`` of ``kh`` names a slot that holds another page now (or a copy
        that does not verify)."""
        self.forget(kh, now)
        with self._lock:
            self._dead[kh] = ptr
            self._dead.move_to_end(kh)
            if len(self._dead) > CACHE_MAX:
                self._dead.popitem(last=False)

    def has_record(self, kh: bytes, path: str) -> bool:
        """Is there a live pointer record for ``kh`` at ``path``: one that is not the dead one
        (reads it then; a stat otherwise). OSError when that cannot be told."""
        dead = self._dead.get(kh)
        if dead is None:
            try:
                os.stat(path)
            except FileNotFoundError:
                return False
            return True
        ptr = read_pointer(path)
        if ptr == dead:
            return False
        with self._lock:
            self._dead.pop(kh, None)  # replaced (or removed): not dead any more
        return ptr is not None

    def clear(self) -> None:
        with self._lock:
            self._found.clear()
            self._absent.clear()
            self._dead.clear()

    # ------------------------------------------------------------ lookups

    def lookup(self, items: list[tuple[bytes, str]]) -> None:
        """Stat the pointer records ``items`` = [(kh, path)] on the helper thread, waiting at
        most ``budget_s``. Skipped (answers stay unknown) while a previous batch still runs."""
        if self._busy:
            return
        self._busy = True
        done = threading.Event()
        self._q.put((items, done))
        done.wait(self.budget_s)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            items, done = job
            try:
                for kh, path in items:
                    self.lookups += 1
                    try:
                        present = self.has_record(kh, path)
                    except FileNotFoundError:
                        present = False
                    except OSError as e:
                        if not self.lookup_errors:
                            log.error("hf3fs pointer lookup failed: %s (further failures are "
                                      "only counted)", e)
                        self.lookup_errors += 1
                        continue
                    if present:
                        self.remember(kh, None, time.monotonic())
                    else:
                        self.forget(kh, time.monotonic())
            finally:
                self._busy = False
                done.set()

    def close(self) -> None:
        """Stop the helper thread (it exits after its current batch)."""
        self._q.put(None)
