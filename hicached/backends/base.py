"""The L3 backend contract, and the registry of backends by name.

A backend stores pages outside the node (Mooncake Store, 3FS) or on a local directory (the
embedded default). It moves bytes straight between the daemon's arena and the store: ``open``
hands it the arena once (register it for zero-copy transports), and every transfer names arena
byte offsets, never Python byte strings.

Threads: ``exists`` runs on the daemon's prober thread (and before puts, on the writer); it
should answer from memory or within a short deadline, as every lookup of the daemon queues
behind it. ``batch_put`` / ``batch_get`` run on the daemon's I/O worker threads (one writer,
one reader) and may block. A failing store answers False (a miss), it does not raise: the daemon
must keep serving from L2. Backends are created by ``create_backend(name, **options)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from hicached.arena import Arena
from hicached.classref import is_class_ref, load_class
from hicached.errors import BackendError


class L3Backend(ABC):
    """One L3 store. Pages are addressed by (namespace digest, pool, key)."""

    name = "abstract"
    # Closing it stalls the whole process (Mooncake's client holds the GIL for ~1 s, joining
    # its heartbeat thread): once detached, the daemon keeps it open, unused, for a later
    # attach with the same options or the daemon's exit (``L3Tier.unpark``), never closing
    # it while it serves.
    slow_close = False
    # ``clear_namespace`` works: the store can find one namespace's pages (a flush of one
    # namespace's L3 pages is refused for a backend that cannot)
    clears_namespaces = False

    def open(self, arena: Arena) -> None:
        """Called once before any transfer with the arena transfers read from / write into."""
        self.arena = arena

    @abstractmethod
    def exists(self, ns: str, pool: str, keys: Sequence[str]) -> list[bool]:
        """Per key: is the page stored? Cheap; called on the prober / writer thread."""

    @abstractmethod
    def batch_put(
        self, ns: str, pool: str, keys: Sequence[str], offsets: Sequence[int], page_bytes: int
    ) -> list[bool]:
        """Store arena[offsets[i] : offsets[i] + page_bytes] under keys[i]; per key success.

        Keys already stored are skipped and count as success. The arena slots stay pinned by the
        daemon until this returns. Blocking; worker thread.
        """

    @abstractmethod
    def batch_get(
        self, ns: str, pool: str, keys: Sequence[str], offsets: Sequence[int], page_bytes: int
    ) -> list[bool]:
        """Load keys[i] into arena[offsets[i] : offsets[i] + page_bytes]; per key success.

        A missing key, a stored page of another size or a failing store is False, never an
        exception. Blocking; worker thread.
        """

    def clear(self) -> int:
        """Delete every stored page; returns how many (best effort)."""
        return 0

    def clear_namespace(self, ns: str) -> int:
        """Delete every stored page of namespace digest ``ns`` (all its pools), and no other;
        returns how many (best effort). Blocking; on the writer thread, behind the writes
        queued before it. Only called where ``clears_namespaces`` is True."""
        raise BackendError(f"L3 backend {self.name} cannot clear one namespace's pages")

    def take_evicted(self) -> list[tuple[str, str, str]] | None:
        """The (namespace, pool, key) of the pages this backend deleted to make room since the
        last call, so the daemon stops counting on them; None when it lost track (the daemon
        then forgets every page it knew to be stored). Called on the daemon's control loop
        after each write; a store that evicts on its own without telling answers [] (the tier's
        audit, ``daemon/l3/audit.py``, then finds the copies it lost)."""
        return []

    def stats(self) -> dict:
        """Backend counters for the daemon's stats."""
        return {}

    def close(self) -> None:
        """Release connections and threads. Idempotent."""


class NullBackend(L3Backend):
    """No L3: everything is a miss and nothing is stored (a disabled tier as a Null object)."""

    name = "none"

    def exists(self, ns, pool, keys):
        return [False] * len(keys)

    def batch_put(self, ns, pool, keys, offsets, page_bytes):
        return [False] * len(keys)

    def batch_get(self, ns, pool, keys, offsets, page_bytes):
        return [False] * len(keys)


# name -> "module:Class"; a new backend is one new file and one line here.
BACKENDS = {
    "none": "hicached.backends.base:NullBackend",
    "file": "hicached.backends.file:FileBackend",
    "hf3fs": "hicached.backends.hf3fs.backend:Hf3fsBackend",
    "mooncake": "hicached.backends.mooncake.backend:MooncakeBackend",
}


def is_backend_name(name: str) -> bool:
    """A registry name, or ``package.module:Class`` naming an out-of-tree backend."""
    return name in BACKENDS or is_class_ref(name)


def create_backend(name: str, **options) -> L3Backend:
    """Instantiate a backend by registry name (or ``module:Class``) with its options."""
    target = BACKENDS.get(name, name if is_backend_name(name) else None)
    if target is None:
        raise ValueError(f"unknown L3 backend {name!r}; valid: {sorted(BACKENDS)} "
                         "or 'package.module:Class'")
    return load_class(target, L3Backend, "L3 backend", name)(**options)
