"""Slot I/O for the 3FS backend: one small interface, two implementations on one format.

``SlotIO`` moves contiguous file ranges to and from the arena (page bytes) and a small scratch
region (stamps). Each op is one file range split into parts, e.g. a read of one slot:

    file   | head stamp (64 B) | page bytes (P)              | trail stamp (64 B) |
    parts  | SCRATCH @ s+0     | ARENA @ offset              | SCRATCH @ s+64     |

- ``PosixIO``: ``os.preadv`` / ``os.pwritev`` straight from / into memoryviews of the arena mmap
  (no intermediate bytes). Works on any directory, a 3FS FUSE mount included.
- ``UsrbioIO``: 3FS USRBIO. The arena's /dev/shm file and the scratch file are wrapped as Iovs
  (a symlink under ``<mount>/3fs-virt/iovs/<uuid>`` lets the FUSE process map them), fds are
  registered, and each op part is one entry of an io ring; a batch is prepared, submitted once
  and waited for. ``hf3fs_py_usrbio`` is imported only here, only when selected.

Two lanes ("get", "put") each own a scratch region and (USRBIO) a read and a write ring, so the
daemon's reader and writer threads never share a ring (a ring is single-producer).
Which segment files are open (and registered) is ``fds.FdTable``'s business.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import mmap
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hicached.arena import Arena
from hicached.errors import ConfigError

log = logging.getLogger(__name__)

ARENA, SCRATCH = 0, 1
LANES = ("get", "put")
USRBIO_MODULE = "hf3fs_py_usrbio"


class Part(NamedTuple):
    """``nbytes`` of memory at ``offset`` in the arena (ARENA) or the lane's scratch (SCRATCH)."""

    where: int
    offset: int
    nbytes: int


class IOOp(NamedTuple):
    """One contiguous file range [file_off, file_off + sum(parts)) of ``fd``; ``done`` runs on
    the submitting thread once the op moved all its bytes (a read: hash the page now, while
    its bytes are in the CPU cache, not in a pass over the whole batch afterwards)."""

    fd: int
    file_off: int
    parts: tuple[Part, ...]
    done: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class SlotIO(ABC):
    """Batched vectored I/O between files and the arena / scratch. Per op the result is the
    number of bytes moved (``op.nbytes`` when complete) or a negative errno; it never raises
    for an I/O failure of one op."""

    name = "abstract"

    def attach(self, arena: Arena, scratch_bytes: int) -> None:
        """Map the arena and allocate ``scratch_bytes`` of scratch per lane."""
        self.arena = arena
        self._scratch = {lane: self._alloc_scratch(scratch_bytes) for lane in LANES}

    def _alloc_scratch(self, nbytes: int) -> mmap.mmap:
        return mmap.mmap(-1, nbytes)

    def scratch(self, lane: str) -> memoryview:
        return memoryview(self._scratch[lane])

    def register(self, fd: int) -> None:
        """Make ``fd`` usable for this I/O path (USRBIO needs it)."""

    def unregister(self, fd: int) -> None:
        """Undo ``register`` before the fd is closed."""

    @abstractmethod
    def submit(self, lane: str, write: bool, ops: Sequence[IOOp]) -> list[int]:
        """Run ``ops`` (all reads or all writes); one result per op."""

    def close(self) -> None:
        """Release rings and Iovs. Idempotent."""


class PosixIO(SlotIO):
    """``preadv`` / ``pwritev`` per op, memoryviews of the arena mmap as the buffers."""

    name = "posix"

    def submit(self, lane, write, ops):
        out = []
        scratch, view = self.scratch(lane), self.arena.view
        for op in ops:
            try:
                bufs = [view(off, n) if where == ARENA else scratch[off:off + n]
                        for where, off, n in op.parts]
                if write:
                    out.append(self._write_all(op.fd, bufs, op.file_off))
                else:
                    out.append(os.preadv(op.fd, bufs, op.file_off))
            except OSError as e:
                out.append(-(e.errno or 5))
            if op.done is not None and out[-1] == op.nbytes:
                op.done()
        return out

    @staticmethod
    def _write_all(fd: int, bufs: list[memoryview], off: int) -> int:
        total = sum(len(b) for b in bufs)
        done = os.pwritev(fd, bufs, off)
        while done < total:  # a short write: finish the rest, buffer by buffer
            skip = done
            rest = []
            for b in bufs:
                if skip >= len(b):
                    skip -= len(b)
                else:
                    rest.append(b[skip:])
                    skip = 0
            done += os.pwritev(fd, rest, off + done)
        return done


class UsrbioIO(SlotIO):
    """3FS USRBIO rings over Iovs that wrap the arena's shared memory (zero copy)."""

    name = "usrbio"

    def __init__(self, module, mount: str, entries: int, timeout_s: float):
        self._m = module
        self.mount = mount
        self.entries = entries
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._links: list[str] = []
        self._rings: dict[tuple[str, bool], object] = {}
        self._closed = False

    def _wrap(self, buffer, shm_path: str):
        """An Iov over ``buffer``, the mapping of the /dev/shm file ``shm_path``."""
        iov_id = str(uuid.uuid4())
        link = os.path.join(self.mount, "3fs-virt", "iovs", iov_id)
        os.symlink(shm_path, link)
        self._links.append(link)
        return self._m.iovec(buffer, iov_id, self.mount, 0, -1)

    def attach(self, arena, scratch_bytes):
        if not os.path.realpath(arena.path).startswith("/dev/shm/"):
            raise ConfigError(f"io='usrbio' needs the arena in /dev/shm, it is at {arena.path}")
        self.arena = arena
        self._iov = {ARENA: self._wrap(arena.buffer, arena.path)}
        super().attach(arena, scratch_bytes)
        for lane in LANES:
            for write in (False, True):
                self._rings[lane, write] = self._m.ioring(self.mount, self.entries, not write)

    def _alloc_scratch(self, nbytes):
        path = f"/dev/shm/hicached-hf3fs-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            buf = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        try:
            self._iov[("scratch", id(buf))] = self._wrap(buf, path)
        finally:
            os.unlink(path)  # mapped by us and (after the wrap) by the FUSE process: no leak
        return buf

    def register(self, fd):
        self._m.register_fd(fd)

    def unregister(self, fd):
        self._m.deregister_fd(fd)

    def _iov_slice(self, lane: str, p: Part):
        base = (self._iov[ARENA] if p.where == ARENA
                else self._iov[("scratch", id(self._scratch[lane]))])
        return base[p.offset:p.offset + p.nbytes]

    def submit(self, lane, write, ops):
        ring = self._rings[lane, write]
        got = [0] * len(ops)
        entries = []
        for i, op in enumerate(ops):
            off = op.file_off
            for p in op.parts:
                entries.append((i, op.fd, off, p))
                off += p.nbytes
        for start in range(0, len(entries), self.entries):
            chunk = entries[start:start + self.entries]
            prepared = 0
            for i, fd, off, p in chunk:
                try:
                    ring.prepare(self._iov_slice(lane, p), not write, fd, off, i)
                except (OSError, ValueError) as e:
                    got[i] = -(getattr(e, "errno", None) or 22)
                    continue
                prepared += 1
            if prepared:
                for res in self._reap(ring, prepared):
                    i = res.userdata
                    if got[i] >= 0:
                        got[i] = got[i] + res.result if res.result >= 0 else res.result
        # (the bytes came by RDMA / from the FUSE process, not through this CPU's cache: the
        # ``done`` hooks gain nothing by running before the whole batch is in)
        for op, n in zip(ops, got):
            if op.done is not None and n == op.nbytes:
                op.done()
        return got

    def _reap(self, ring, n: int) -> list:
        """Wait until all ``n`` prepared ios completed. A late completion would land in arena
        memory the daemon already reuses, so a slow store is waited for (and logged), never
        abandoned: correctness over latency (a hung mount stalls this lane's thread only)."""
        out = []
        ring.submit()
        while len(out) < n:
            try:
                out += ring.wait(min_results=n - len(out), timeout=self.timeout)
            except OSError as e:
                if e.errno not in (110, 62):  # ETIMEDOUT, ETIME
                    raise
                log.error("usrbio: %d of %d ios still running after %s; waiting", n - len(out),
                          n, self.timeout)
        return out

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._rings.clear()
        self._iov = {}
        for link in self._links:
            try:
                os.unlink(link)
            except OSError:
                pass


def select_io(io: str, root: str, entries: int, timeout_s: float) -> tuple[SlotIO, str]:
    """The I/O path for option ``io`` ("auto" | "posix" | "usrbio") and why it was chosen.

    "auto" takes USRBIO when ``hf3fs_py_usrbio`` imports and ``root`` is on a 3FS mount, POSIX
    otherwise; "usrbio" without either is a ``ConfigError`` naming what is missing."""
    if io == "posix":
        return PosixIO(), "io='posix'"
    try:
        module = importlib.import_module(USRBIO_MODULE)
    except ImportError as e:
        if io == "usrbio":
            raise ConfigError(
                f"io='usrbio' needs the {USRBIO_MODULE} module (3FS USRBIO Python binding, "
                f"built from deepseek-ai/3FS src/lib/py, not on the package index): {e}") from None
        return PosixIO(), f"{USRBIO_MODULE} not importable"
    try:
        mount = module.extract_mount_point(os.path.abspath(root))
    except OSError as e:
        mount, err = None, e
    else:
        err = None
    if not mount:
        if io == "usrbio":
            raise ConfigError(f"io='usrbio': root {root} is not on a 3FS mount ({err or 'none'})")
        return PosixIO(), f"{root} is not on a 3FS mount"
    return UsrbioIO(module, mount, entries, timeout_s), f"3FS mount {mount}"


def mount_fstype(path: str, mountinfo: str | None = None) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/self/mountinfo), or ""."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            return ""
    path = os.path.realpath(path)
    best, fstype = "", ""
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        mnt = parts[4].replace("\\040", " ")
        inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, rest.split()[0]
    return fstype


def wants_direct(direct: bool | str, root: str) -> bool:
    """Whether segment files are opened with O_DIRECT. "auto": on FUSE mounts (3FS), where a
    plain fd reads through the kernel page cache (stale across nodes) and writes through the
    FUSE client's write buffer (no order across the buffer's flushes, nothing visible to other
    nodes until a flush). Local filesystems need aligned buffers for O_DIRECT, so "auto" is off
    there; the page cache of a local disk is coherent anyway."""
    if direct == "auto":
        return mount_fstype(root).startswith("fuse")
    return bool(direct)
