"""Checksums of L3 page copies, bound to the page's identity: no backend serves a corrupted or
misplaced page.

Every copy an L3 backend writes carries ``page_digest(seed, bytes)``: XXH3-64 of the page bytes,
seeded with ``identity_seed(ns, pool, key, page_bytes)`` (itself XXH3-64 of the identity). A
copy whose bytes changed (bit rot, a torn or misdirected write), or that is intact but belongs
to another key, pool, namespace or page size (a swapped object, a copied directory), does not
verify: the load is a miss, never a hit. Each backend hashes a page right after its own read
or write, on its I/O thread, while the bytes are in the CPU cache; never on the control loop.
``xxhash`` releases the GIL while it hashes.

What a backend does when a copy does not verify (``Integrity.failed``): count it per pool
(``hicached_l3_integrity_failures_total{backend,pool}``), log once per episode (the key's
digest, never the key), delete the copy so the next set stores the page again, and where it
cannot be deleted, remember the key as bad (``BadKeys``: bounded, with expiry) so that ``exists``
does not count on it and the next write is not skipped as "already stored".
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

log = logging.getLogger(__name__)

DIGEST_BYTES = 8
EPISODE_S = 60.0  # failures within this long of the last log line are only counted
BAD_KEYS_MAX = 1 << 16
BAD_KEY_TTL_S = 600.0
# A page is read (or written) and hashed in pieces this size: each piece is hashed right after
# its own read, while it is still in the core's cache (a 1 MiB page read whole had left it by
# the time it was hashed: on the 2-vCPU VM the hash runs at ~9 GB/s from memory, ~40 in cache).
HASH_PIECE = 256 << 10
# Pages at least this big are hashed on a helper thread while a batch is read or written
# (below it, handing a page over costs more than hashing it where it is).
HASH_AHEAD_MIN = 64 << 10


def identity_seed(ns: str, pool: str, key: str, page_bytes: int) -> int:
    """64-bit seed naming one page: the hash of a copy made under it verifies under no other
    namespace, pool, key or page size."""
    ident = f"{len(ns)}:{ns}\0{len(pool)}:{pool}\0{key}\0{page_bytes}".encode()
    return xxhash.xxh3_64_intdigest(ident)


_enabled = True


def disable_for_benchmark() -> None:
    """Checksums off in this process (every digest is 0, so every copy verifies): only for
    ``tools/bench_l3.py``, which measures what they cost side by side, through a daemon
    started with ``HICACHED_BENCH_NO_CHECKSUMS=1``. Never in production."""
    global _enabled
    _enabled = False
    log.warning("L3 checksums are OFF in this process (HICACHED_BENCH_NO_CHECKSUMS): a "
                "corrupted page would be served. For benchmarks only.")


def checksums_on() -> bool:
    """False only in a benchmark's daemon (``disable_for_benchmark``)."""
    return _enabled


def page_digest(seed: int, data) -> int:
    """XXH3-64 of ``data`` (any buffer: an arena view) under ``seed``."""
    return xxhash.xxh3_64_intdigest(data, seed=seed) if _enabled else 0


def read_hashed(fd: int, view: memoryview, pos: int, seed: int) -> tuple[int, int]:
    """``preadv`` ``view`` from ``fd`` at file offset ``pos``, hashing each piece right after
    its read: (bytes read, ``page_digest(seed, view)`` of what was read). A short read (end
    of file) stops it; the caller compares the count."""
    if not _enabled:
        return os.preadv(fd, [view], pos), 0
    h = xxhash.xxh3_64(seed=seed)
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done:done + HASH_PIECE]], pos + done)
        if n <= 0:
            break
        h.update(view[done:done + n])
        done += n
    return done, h.intdigest()


def write_plain(fd: int, view: memoryview, pos: int) -> None:
    """``pwrite`` all of ``view`` to ``fd`` at ``pos`` (short writes finished), in pieces."""
    done, total = 0, len(view)
    while done < total:
        n = os.pwrite(fd, view[done:min(total, done + HASH_PIECE)], pos + done)
        if n <= 0:
            raise OSError(f"pwrite wrote nothing at {pos + done}")
        done += n


def write_hashed(fd: int, view: memoryview, pos: int, seed: int) -> int:
    """``write_plain`` of ``view``, each piece hashed just before its write (the write then
    reads it from cache): ``page_digest(seed, view)``."""
    if not _enabled:
        write_plain(fd, view, pos)
        return 0
    h = xxhash.xxh3_64(seed=seed)
    for done in range(0, len(view), HASH_PIECE):
        piece = view[done:done + HASH_PIECE]
        h.update(piece)
        write_plain(fd, piece, pos + done)
    return h.intdigest()


class HashedBatch:
    """The digests of one batch's pages, computed in order on ``HashAhead``'s thread while
    the caller reads or writes the next ones: ``add`` a page (a reader adds each page once it
    is read; a writer gives them all at the start), ``get`` waits for one digest; ``cancel``
    stops the rest (the caller is done with the batch, or gave up on it)."""

    def __init__(self, items: Sequence[tuple[int, memoryview]] = (), on_cancel=None):
        self._on_cancel = on_cancel
        self.items = list(items)
        self.out: list[int | None] = [None] * len(self.items)
        self.done = 0  # out[:done] are ready
        self.cancelled = False
        self._cond = threading.Condition()

    def add(self, seed: int, view: memoryview) -> int:
        """Queue one more page; returns its index for ``get``."""
        with self._cond:
            self.items.append((seed, view))
            self.out.append(None)
            self._cond.notify_all()
            return len(self.items) - 1

    def get(self, i: int) -> int | None:
        """The digest of item ``i`` (None: its hash failed, or the batch was cancelled)."""
        with self._cond:
            while self.done <= i and not self.cancelled:
                self._cond.wait()
            return self.out[i] if i < self.done else None

    def cancel(self) -> None:
        with self._cond:
            if self.cancelled:
                return
            self.cancelled = True
            self._cond.notify_all()
        if self._on_cancel is not None:
            self._on_cancel()

    def _run(self) -> None:
        """On the helper thread: hash the items as they come, until cancelled."""
        i = 0
        while True:
            with self._cond:
                while i >= len(self.items) and not self.cancelled:
                    self._cond.wait()
                if self.cancelled:
                    return
                seed, view = self.items[i]
            try:
                digest: int | None = page_digest(seed, view)
            except (ValueError, TypeError, BufferError):  # a view gone bad: that page fails
                digest = None
            with self._cond:
                self.out[i] = digest
                self.done = i = i + 1
                self._cond.notify_all()


class HashAhead:
    """A helper thread that hashes a batch's pages while the I/O thread moves the next ones
    (during an L3 load or write-through the second core is mostly idle: the client waits for
    its answer, the control loop for its next message), so the I/O pays for the hash only when
    the hasher falls behind. The pages' arena slots stay pinned for the whole batch (the
    ``batch_put`` / ``batch_get`` contract), so the bytes hashed are the bytes moved. One batch
    at a time: while one is open (until its caller's ``cancel``), ``start`` answers None and
    that caller hashes its pages itself (another reader thread, say)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue[HashedBatch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._open = False

    def start(self, items: Sequence[tuple[int, memoryview]] = ()) -> HashedBatch | None:
        """A batch hashing ``(seed, view)`` pairs in order (more with ``add``), or None while
        another is open; returns at once. The caller must ``cancel`` it when done."""
        with self._lock:
            if self._open:
                return None
            self._open = True
            batch = HashedBatch(items, on_cancel=self._closed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hicached-l3-hash",
                                                daemon=True)
                self._thread.start()
        self._jobs.put(batch)
        return batch

    def _closed(self) -> None:
        with self._lock:
            self._open = False

    def _run(self) -> None:
        while (batch := self._jobs.get()) is not None:
            batch._run()

    def close(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread = None


def digests(hasher: HashAhead | None, items: Sequence[tuple[int, memoryview]]
            ) -> list[int | None]:
    """``page_digest`` of each ``(seed, view)``; with ``hasher`` (and pages worth handing
    over), its thread hashes the second half while this one hashes the first: on two cores,
    half the wall time of a batch that arrived whole (a Mooncake batch get, or a put that
    needs every digest before its one call). None: that page's hash failed."""
    half = len(items) // 2
    batch = None
    if hasher is not None and half and len(items[0][1]) >= HASH_AHEAD_MIN and _enabled:
        batch = hasher.start(items[half:])
    if batch is None:
        return [page_digest(seed, view) for seed, view in items]
    try:
        out: list[int | None] = [page_digest(seed, view) for seed, view in items[:half]]
        out += [batch.get(i) for i in range(len(items) - half)]
    finally:
        batch.cancel()
    return out


def key_digest(key: str) -> str:
    """What the log says of a key (keys may carry tenants' data): a short digest."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Integrity:
    """One backend's integrity failures: counted per pool, logged once per episode."""

    def __init__(self, backend: str):
        self.backend = backend
        self._lock = threading.Lock()
        self.by_pool: dict[str, int] = {}
        self.unchecked = 0  # copies of a format without a checksum (written before it): misses
        self.verified = 0  # loaded copies that were hashed and verified (L2 hits never are)
        self._last_log = -EPISODE_S
        self._since_log = 0

    @property
    def failures(self) -> int:
        return sum(self.by_pool.values())

    def failed(self, ns: str, pool: str, key: str, why: str) -> None:
        """A copy of (ns, pool, key) did not verify (``why``: what was wrong)."""
        now = time.monotonic()
        with self._lock:
            self.by_pool[pool] = self.by_pool.get(pool, 0) + 1
            self._since_log += 1
            if now - self._last_log < EPISODE_S:
                return
            quiet, self._since_log, self._last_log = self._since_log - 1, 0, now
        log.warning("%s L3: the copy of key %s (pool %s) does not verify (%s): a miss, and the "
                    "copy is dropped so the page is stored again%s", self.backend,
                    key_digest(key), pool, why,
                    f" ({quiet} more since the last such line)" if quiet else "")

    def unchecked_copies(self, n: int = 1) -> None:
        """``n`` copies of a format before checksums were found (misses)."""
        with self._lock:
            self.unchecked += n

    def verified_loads(self, n: int) -> None:
        """``n`` loaded copies were hashed and verified (two I/O threads may count)."""
        with self._lock:
            self.verified += n

    def stats(self) -> dict:
        with self._lock:
            return {"integrity_failures": sum(self.by_pool.values()),
                    "integrity_failures_by_pool": dict(self.by_pool),
                    "unchecked_copies": self.unchecked, "verified_loads": self.verified}


class BadKeys:
    """Keys whose stored copy failed its check but could not be deleted (another node's, a
    store that refused): ``exists`` must not count on them, and a put must write them again
    (over the bad copy) instead of skipping them as stored. Bounded; entries expire."""

    def __init__(self, max_keys: int = BAD_KEYS_MAX, ttl_s: float = BAD_KEY_TTL_S):
        self.max_keys, self.ttl_s = max_keys, ttl_s
        self._lock = threading.Lock()
        self._keys: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def add(self, ns: str, pool: str, key: str) -> None:
        with self._lock:
            self._keys[(ns, pool, key)] = time.monotonic() + self.ttl_s
            self._keys.move_to_end((ns, pool, key))
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)

    def __contains__(self, item: tuple[str, str, str]) -> bool:
        if not self._keys:
            return False
        with self._lock:
            until = self._keys.get(item)
            if until is None:
                return False
            if until < time.monotonic():
                del self._keys[item]
                return False
            return True

    def discard(self, ns: str, pool: str, key: str) -> None:
        """The key was written again: its copy is good now."""
        if self._keys:
            with self._lock:
                self._keys.pop((ns, pool, key), None)

    def __len__(self) -> int:
        return len(self._keys)
