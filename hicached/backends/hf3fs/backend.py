"""The 3FS L3 backend: pages in fixed-size slots of per-node segment files on a shared mount.

A 3FS mount is a POSIX directory shared by every node's daemon. Each daemon ("node", option
``node``, default the host name) writes only into its own segment files; any daemon reads any
node's pages. Layout and records: ``format.py``; this node's slots: ``space.py`` (rebuilt at a
restart: ``restart.py``); pointer records, the format marker: ``records.py``; node identity:
``node.py``; how a batch of slots is written and read: ``slots.py``; other nodes' keys:
``keys.py``; open segment files, a share of RLIMIT_NOFILE: ``fds.py``; the bytes move through
``io.py`` (USRBIO rings when ``hf3fs_py_usrbio`` imports and the root is on a 3FS mount,
``preadv``/``pwritev`` on the arena's memory otherwise; the same format either way).

    key (ns, pool, key) --sha256--> kh --> index/<ns>/<pool>/<kh[:2]>/<kh>   pointer record
    pointer = (node uuid, segment, slot, slot offset, generation, page_bytes, kh)
    slot    = [.. | head stamp | page bytes | trail stamp | ..]   stamp = (slot, gen, size, kh,
                                                                    segment tag, page hash)

Write (one node, its writer thread), per batch (``transfers.py``: the put and the get):
  1. allocate slots (``NodeSpace``: free slot, new segment, or LRU eviction at ``capacity``);
  2. hash each page, write every head stamp (a new, never reused generation: epoch << 32 |
     counter), wait;
  3. write page bytes + trail stamp, wait;
  4. write the slot's directory entry, then publish the pointer (temp file + rename).
Read (any node, its reader thread):
  1. resolve kh -> pointer (own slots from memory, others' from a cache or the record);
  2. read [head | page | trail] in one vectored op per page, page bytes straight into the
     arena, and hash each page as soon as its op is done;
  3. check head and trail against the pointer, read the head again and check it once more,
     then the page's hash against the stamp's.
A writer recycling the slot stamps the head with a new generation *before* it touches the page,
so a page read that saw any new byte sees the new head in step 3: a torn or recycled slot is a
miss, never wrong bytes (seqlock; the stamp CRC also rejects zeroed or foreign blocks). A stale
pointer is harmless for the same reason. Page bytes changed under intact stamps (bit rot, a
lost or misdirected write: another key's page) fail the hash, which is bound to the key. Such
a copy, or a slot written before hashes (no ``HAS_HASH``: an upgrade keeps the root and its
format marker, and each old page misses once and is stored again), is counted
(``integrity_failures`` per pool, logged once per episode; ``unchecked_copies``) and dead (below).
Eviction removes the pointer first and reuses the slot only ``grace_s`` later, so readers in
flight rarely lose a page to the check; a pointer it cannot remove keeps its slot out of use
until a retry removes it. A pointer that a read finds naming a slot with another page in it or
a copy that does not verify, or a deleted or cut segment (a crash, another node's ``clear``),
is "dead": one miss, then ``exists`` says missing and a put stores the key again, replacing the
pointer (``KeyCache.dead``), on every node that saw it. A write into a segment deleted under it
is never published. Errors (a vanished root, a segment that cannot be created or opened) are
misses or evictions, never exceptions, and nothing readable is deleted for them. This node's
evictions are told to the daemon (``take_evicted``: the keys of pages it put, read or found
with ``exists``, which the daemon's writes ask first).

What this relies on from 3FS (checked against its FUSE client source) and any filesystem:
- rename replaces a file atomically (3FS: metadata transactions in FoundationDB); O_EXCL create;
- a read that starts after a write returned sees the write, from any client (3FS storage:
  CRAQ chains). The FUSE client would break this for plain fds: it buffers writes per inode
  (``io_bufs.write_buf_size``, 1 MB) and reads through the kernel page cache
  (``enable_read_cache``). So on a FUSE mount segment files are opened O_DIRECT (option
  ``direct``, "auto"): each write reaches storage before it returns, reads skip the cache.
  USRBIO bypasses both anyway. Pointer files are plain: close() flushes them (FUSE flush ->
  fsync) before the rename publishes them;
- lookups may be stale for a while (``entry_timeout`` 30 s, ``negative_timeout`` 5 s): a new
  pointer can stay invisible to another node for seconds (a miss), a replaced or removed one
  can still be read (a stale pointer: the slot check turns it into a miss or the old page).
It does not rely on cross-host locks, mtimes, lazily updated file lengths (segments are sized
once at creation), or clocks agreeing across hosts. Nothing is fsynced but the root's format
marker and the node files (small, replaced whole: a crash never leaves one empty): this is a
cache, and the page hash keeps a power loss (or a filesystem without ordered writeback) from
ever yielding wrong bytes. The option ``checksum`` is accepted, but hashes are always on.

``exists`` answers from memory (own slots, found pointers, recent misses) and checks unknown
keys' pointer records on a helper thread for at most ``lookup_budget_ms``: what that does not
finish counts as a miss now and is known on the next call, so a hung mount never stalls the loop.
So a key another node evicted still reads as stored here for up to ``remote_ttl_s`` (10 s), or
until a get of it misses (which forgets it at once); a put looks at the record itself, so it
never skips such a page.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Sequence

from hicached.backends.base import L3Backend
from hicached.backends.hf3fs.fds import FdTable, fd_budget
from hicached.backends.hf3fs.format import key_hash, pointer_relpath, safe_name
from hicached.backends.hf3fs.io import PosixIO, select_io, wants_direct
from hicached.backends.hf3fs.keys import KeyCache
from hicached.backends.hf3fs.records import clear_root, prepare_root
from hicached.backends.hf3fs.slots import SCRATCH_PER_PAGE
from hicached.backends.hf3fs.space import NodeSpace, Slot
from hicached.backends.hf3fs.transfers import Hf3fsTransfers
from hicached.backends.integrity import Integrity
from hicached.errors import ConfigError
from hicached.settings import parse_size

log = logging.getLogger(__name__)


class Hf3fsBackend(Hf3fsTransfers, L3Backend):
    """Pages on a 3FS (or any shared POSIX) directory; see the module docstring."""

    name = "hf3fs"
    wipe_check_s = 1.0  # how often the workers check that another node's clear left us alone

    def __init__(self, root: str | None = None, capacity="64GiB", io: str = "auto",
                 node: str | None = None, segment_bytes="256MiB", grace_s: float = 1.0,
                 lookup_budget_ms: float = 5.0, negative_ttl_s: float = 2.0,
                 remote_ttl_s: float = 10.0, batch_entries: int = 256, checksum: bool = True,
                 io_timeout_s: float = 10.0, max_open_files: int | str = "auto",
                 file_mode: int = 0o600, direct: bool | str = "auto", lock_wait_s: float = 5.0,
                 **unknown):
        if unknown:
            valid = [k for k in inspect.signature(Hf3fsBackend).parameters if k != "unknown"]
            raise ConfigError(f"hf3fs: unknown option {min(unknown)!r}; valid: {valid}")
        if not root or not isinstance(root, str):
            raise ConfigError("hf3fs: option 'root' (a directory on the 3FS mount) is required")
        if io not in ("auto", "posix", "usrbio"):
            raise ConfigError(f"hf3fs: io must be 'auto', 'posix' or 'usrbio', got {io!r}")
        if direct not in ("auto", True, False):
            raise ConfigError(f"hf3fs: direct must be 'auto', true or false, got {direct!r}")
        for key, v in (("grace_s", grace_s), ("lookup_budget_ms", lookup_budget_ms),
                       ("negative_ttl_s", negative_ttl_s), ("remote_ttl_s", remote_ttl_s),
                       ("io_timeout_s", io_timeout_s), ("lock_wait_s", lock_wait_s)):
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise ConfigError(f"hf3fs: {key} must be a number >= 0, got {v!r}")
        if isinstance(file_mode, str):  # JSON has no octal literals: "0o640" / "640"
            try:
                file_mode = int(file_mode.removeprefix("0o"), 8)
            except ValueError:
                raise ConfigError(f"hf3fs: file_mode {file_mode!r} is not octal") from None
        if max_open_files == "auto":  # a share of RLIMIT_NOFILE (fds.py)
            max_open_files = fd_budget()
        for key, v in (("batch_entries", batch_entries), ("max_open_files", max_open_files),
                       ("file_mode", file_mode)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"hf3fs: {key} must be an integer >= 1, got {v!r}")
        self.root = os.path.abspath(root)
        self.capacity = parse_size(capacity, "hf3fs capacity")
        seg_bytes = parse_size(segment_bytes, "hf3fs segment_bytes")
        prepare_root(self.root)
        self.grace_s = float(grace_s)
        self.entries, self.file_mode = batch_entries, file_mode
        if not checksum:  # (older configs turn it off: no unchecked copy is ever served now)
            log.warning("hf3fs: checksum=false is ignored: page checksums are always on")
        self.io, self.io_reason = select_io(io, self.root, 3 * batch_entries, io_timeout_s)
        self._io_option = io
        self.direct = wants_direct(direct, self.root)
        self.fds = FdTable(self.io, max_open_files, os.O_DIRECT if self.direct else 0)
        self.space = NodeSpace(self.root, safe_name(node) if node else NodeSpace.default_node(),
                               self.capacity, seg_bytes, self.grace_s, self.fds, file_mode,
                               lock_wait_s=float(lock_wait_s))
        self._write_lock = threading.RLock()  # batch_put vs clear / close; the "put" lane
        self._get_lock = threading.Lock()  # the "get" lane
        self.keys = KeyCache(float(remote_ttl_s), float(negative_ttl_s), lookup_budget_ms / 1000)
        self._wipe_checked = float("-inf")
        self._logged: set[str] = set()
        self.counters = dict.fromkeys(
            ("puts", "put_failures", "no_space", "gets", "get_hits", "remote_hits",
             "size_mismatches", "read_failures", "verify_failures", "dead_pointers"), 0)
        self._bad_lock = threading.Lock()
        self._bad_own: list[Slot] = []  # own slots a read found broken, for the writer thread
        self.integrity = Integrity("hf3fs")
        self._closed = False

    def open(self, arena) -> None:
        super().open(arena)
        scratch = self.entries * SCRATCH_PER_PAGE
        try:
            self.io.attach(arena, scratch)
        except (OSError, ConfigError) as e:
            if self._io_option == "usrbio":
                raise ConfigError(f"hf3fs: io='usrbio' cannot use the arena: {e}") from e
            log.warning("hf3fs: USRBIO unusable (%s); using POSIX I/O", e)
            self.io.close()
            self.io, self.io_reason = PosixIO(), f"usrbio failed: {e}"
            self.fds.swap_io(self.io)
            self.io.attach(arena, scratch)
        log.info("hf3fs L3 at %s: node %s, io %s (%s), capacity %d bytes", self.root,
                 self.space.node, self.io.name, self.io_reason, self.capacity)

    # ------------------------------------------------------------ key caches

    def _ptr_path(self, ns: str, pool: str, kh: bytes) -> str:
        return os.path.join(self.root, pointer_relpath(safe_name(ns), safe_name(pool), kh))

    def _note(self, what: str, err: Exception, count: int = 1) -> None:
        """Count ``count`` failures of ``what`` (put | get | read); log only the first."""
        self.counters["put_failures" if what == "put" else "read_failures"] += count
        if what not in self._logged:
            self._logged.add(what)
            log.error("hf3fs %s failed: %s (further failures are only counted)", what, err)

    # ------------------------------------------------------------ contract

    def exists(self, ns: str, pool: str, keys: Sequence[str]) -> list[bool]:
        out = [False] * len(keys)
        if self._closed:
            return out
        now = time.monotonic()
        unknown = []
        for i, key in enumerate(keys):
            kh = key_hash(ns, pool, key)
            if self._own(kh, ns, pool, key) is not None or self.keys.found(kh, now):
                out[i] = True
            elif not self.keys.absent(kh, now):
                unknown.append((i, kh))
        if unknown:
            self.keys.lookup([(kh, self._ptr_path(ns, pool, kh)) for _, kh in unknown])
            now = time.monotonic()
            for i, kh in unknown:
                out[i] = self.keys.found(kh, now)
        return out

    def _own(self, kh: bytes, ns: str, pool: str, key: str) -> Slot | None:
        """This node's live slot of ``kh``, which learns its key (``take_evicted``): a restored
        slot knows only its hash, and after an exists, put or get the daemon counts on it."""
        slot = self.space.lookup(kh)
        if slot is not None and slot.key is None:
            slot.key = (ns, pool, key)
        return slot

    # ------------------------------------------------------------ maintenance

    def clear(self) -> int:
        """Delete every pointer and segment under the root (all nodes'); returns how many
        pages (pointer records) were removed. Other nodes notice and start empty."""
        with self._write_lock:
            n = clear_root(self.root)
            self._reset(lost=False)  # (the daemon forgets what it knew stored itself)
        return n

    def _reset(self, lost: bool = True) -> None:
        self.fds.drop_all()
        self.space.reset()
        self.keys.clear()
        if lost:  # another node's clear deleted pages this daemon knew stored
            self.space.lost_track()

    def take_evicted(self) -> list[tuple[str, str, str]] | None:
        return self.space.take_evicted()

    def stats(self) -> dict:
        return {**self.space.stats(), "io": self.io.name, "io_reason": self.io_reason,
                "direct": self.direct, "open_files": len(self.fds),
                "max_open_files": self.fds.max_open, "fd_closes": self.fds.closes,
                "lookups": self.keys.lookups, "lookup_errors": self.keys.lookup_errors,
                **self.counters, **self.integrity.stats()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.keys.close()
        with self._write_lock:
            self.fds.drop_all()
            self.io.close()
            self.space.close()
