"""The shared-memory arena: one file in /dev/shm that the daemon creates and every client maps.

The daemon owns it (create, pre-fault, unlink on close); clients map the same file read/write
after the handshake and copy page bytes between arena slots and their host pools. Pre-faulting
matters: copying into never-touched memory runs at a third of memcpy (page faults), so the daemon
allocates the tmpfs pages up front (``posix_fallocate`` also turns "/dev/shm too small" into a
clear error at start instead of a SIGBUS later) and both sides map with ``MAP_POPULATE``.

    arena bytes  [0 ............................................ size)
                 |  slab 0  |  slab 1  |  ...  |  slab n-1  | tail |
    slots of one size class are carved out of whole slabs (``slabs.py``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from hicached.errors import ArenaError

log = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _map(fd: int, size_bytes: int) -> mmap.mmap:
    return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | _POPULATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


Progress = Callable[[int, int], None]
RESERVE_STEP = 256 << 20  # bytes allocated, or pre-faulted, between two progress calls
PAGE = mmap.PAGESIZE


def _reserve(fd: int, size_bytes: int, path: str, what: str,
             progress: Progress | None) -> mmap.mmap:
    """Allocate the new (all zero) file's tmpfs pages and map them, pre-faulted, in steps.

    One write of a zero byte per page faults it in writable: 3-4x faster than ``MAP_POPULATE``
    here (16 s for 4 GiB on a VM), and done in steps, so the daemon can say how far it got, and
    stop between two (``progress`` may raise: a Ctrl-C). The allocation takes as long as the
    pre-faulting, so each pass counts as half of ``done``."""
    try:
        for off in range(0, size_bytes, RESERVE_STEP):
            os.posix_fallocate(fd, off, min(RESERVE_STEP, size_bytes - off))
            if progress is not None:
                progress(min(off + RESERVE_STEP, size_bytes) // 2, size_bytes)
    except OSError as e:
        raise ArenaError(
            f"cannot reserve {size_bytes} bytes for {what} {path} "
            f"(is /dev/shm large enough? see `df -h /dev/shm`): {e}"
        ) from e
    buf = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    pages = np.frombuffer(buf, dtype=np.uint8, count=size_bytes)
    try:
        for off in range(0, size_bytes, RESERVE_STEP):
            pages[off:off + RESERVE_STEP:PAGE] = 0  # the file is new: its bytes are 0
            if progress is not None:
                progress((size_bytes + min(off + RESERVE_STEP, size_bytes)) // 2, size_bytes)
    except BaseException:
        del pages
        buf.close()
        raise
    del pages
    return buf


# path -> fd of the files this process created, each held with an exclusive flock for as long
# as it is in use: another daemon given the same path refuses to start instead of replacing it
_HELD: dict[str, int] = {}
# files a daemon of this state dir made before (its lock file records the arena path): a crash
# leaves them behind, and they are replaced like files named hicached-*
_MADE_BEFORE: set[str] = set()


def made_before(*paths: str) -> None:
    """Let ``create_mapped`` replace these existing files (a crashed daemon's, by its record)."""
    _MADE_BEFORE.update(paths)


def _replaceable(path: str) -> bool:
    """Whether an unlocked file at ``path`` is a crashed daemon's, never someone else's file:
    a mistyped arena_path must not delete an unrelated file."""
    return (os.path.basename(path).startswith("hicached-") or path in _MADE_BEFORE) \
        and not os.path.islink(path) and os.path.isfile(path)


def create_mapped(path: str, size_bytes: int, mode: int, what: str,
                  progress: Progress | None = None) -> mmap.mmap:
    """A fresh shared-memory file of ``size_bytes`` (replacing a crashed daemon's), allocated
    up front and mapped read/write, pre-faulted, and locked until ``release_mapped``;
    ArenaError when it cannot be, or when a running daemon holds the file at ``path``.
    ``progress(done, total)`` is called after each ``RESERVE_STEP`` bytes allocated, then after
    each ``RESERVE_STEP`` bytes pre-faulted (a 4 GiB arena takes seconds); if it raises, the
    file is removed and the exception goes on."""
    if os.path.isdir(path):
        raise ArenaError(f"{what} path {path} is a directory: name a file (in /dev/shm)")
    try:
        old = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        old = None
    except OSError as e:
        raise ArenaError(f"cannot open the existing {what} {path}: {e}") from e
    if old is not None:
        try:
            fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArenaError(
                f"{what} {path} is in use by a running hicached daemon: give this one another "
                "arena_path (or state_dir)") from None
        finally:
            os.close(old)
        if not _replaceable(path):
            raise ArenaError(
                f"{what} path {path} holds a file hicached did not make (its name does not start "
                "with hicached-, and the state dir's last daemon did not use it): choose another "
                "arena_path, or remove the file if it is a stale arena")
        try:  # a crashed daemon's file: nobody maps a file we are about to own
            os.unlink(path)
        except OSError as e:
            raise ArenaError(f"cannot replace the existing {what} {path}: {e}") from None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    except OSError as e:
        raise ArenaError(f"cannot create {what} {path}: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, mode)  # umask must not widen or narrow what the operator asked for
        buf = _reserve(fd, size_bytes, path, what, progress)
    except BlockingIOError:
        os.close(fd)
        raise ArenaError(f"{what} {path} is being created by another daemon") from None
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    _HELD[path] = fd
    return buf


def adopt_mapped(path: str, size_bytes: int, what: str) -> mmap.mmap:
    """The existing shared-memory file at ``path`` (a previous daemon's, kept for this one),
    mapped read/write without pre-faulting (its pages are allocated already: only the page
    tables are filled as it is touched) and locked until ``release_mapped`` / ``keep_mapped``;
    ArenaError when it is missing, in use by a running daemon, or not ``size_bytes`` long."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        raise ArenaError(f"cannot open the kept {what} {path}: {e}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArenaError(f"{what} {path} is in use by a running hicached daemon") from None
        actual = os.fstat(fd).st_size
        if actual != size_bytes:
            raise ArenaError(f"kept {what} {path} has {actual} bytes, expected {size_bytes}")
        buf = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    _HELD[path] = fd
    return buf


def keep_mapped(path: str) -> None:
    """Let go of a file ``create_mapped`` / ``adopt_mapped`` made or took, leaving it in place
    for the next daemon (its lock dropped)."""
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


def release_if_made(path: str) -> None:
    """``release_mapped(path)`` when this process made the file (a start interrupted between
    ``create_mapped`` and the object that owns its mapping); nothing otherwise."""
    if path in _HELD:
        release_mapped(path)


def release_mapped(path: str) -> None:
    """Remove a file ``create_mapped`` made, and its lock."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


class Arena:
    """A mapped shared-memory file of ``size_bytes`` bytes.

    ``Arena.create`` (daemon) makes a fresh file, replacing a stale one of a crashed daemon;
    ``Arena.attach`` (client) maps an existing one. ``tensor`` is a 1-D ``torch.uint8`` CPU view of
    the whole arena; ``buffer`` the raw mmap (for ``preadv`` / ``pwritev`` / registration).
    """

    def __init__(self, path: str, size_bytes: int, buffer: mmap.mmap, owner: bool):
        self.path = path
        self.size_bytes = size_bytes
        self.ident: tuple[int, int] | None = None  # (device, inode) of the file a client mapped
        self.buffer = buffer
        self.owner = owner
        self._tensor = None  # made on first use: the daemon maps arenas without importing torch
        self._closed = False

    @property
    def tensor(self):
        """The 1-D ``torch.uint8`` CPU view of the whole arena (None once closed). Made on first
        use, so that a process that never copies pages through torch (the daemon without a
        Mooncake backend) does not import it: torch's import is most of a daemon's start."""
        buffer = self.buffer  # (read once: close() may run on another thread)
        if self._tensor is None and buffer is not None:
            import torch

            self._tensor = torch.frombuffer(buffer, dtype=torch.uint8, count=self.size_bytes)
        return self._tensor

    @classmethod
    def create(cls, path: str, size_bytes: int, mode: int = 0o600,
               progress: Progress | None = None) -> Arena:
        """Create (or replace) the arena file and map it, pre-faulted (``progress``: see
        ``create_mapped``)."""
        if size_bytes <= 0:
            raise ArenaError(f"arena size must be > 0 bytes, got {size_bytes}")
        buf = create_mapped(path, size_bytes, mode, "arena", progress)
        try:
            return cls(path, size_bytes, buf, owner=True)
        except BaseException:  # (Ctrl-C lands anywhere)
            release_mapped(path)
            raise

    @classmethod
    def adopt(cls, path: str, size_bytes: int) -> Arena:
        """Map the arena a previous daemon kept at ``path`` (``adopt_mapped``: no pre-fault;
        its bytes are what that daemon left)."""
        buf = adopt_mapped(path, size_bytes, "arena")
        try:
            return cls(path, size_bytes, buf, owner=True)
        except BaseException:
            keep_mapped(path)
            raise

    @classmethod
    def attach(cls, path: str, size_bytes: int) -> Arena:
        """Map an arena the daemon created (client side)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ArenaError(f"cannot open arena {path}: {e}") from e
        try:
            actual = os.fstat(fd).st_size
            if actual != size_bytes:
                raise ArenaError(
                    f"arena {path} has {actual} bytes, daemon announced {size_bytes}"
                )
            buf = _map(fd, size_bytes)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        arena = cls(path, size_bytes, buf, owner=False)
        arena.ident = (st.st_dev, st.st_ino)
        return arena

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A memoryview of ``nbytes`` at ``offset`` (bounds checked)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size_bytes:
            raise ArenaError(
                f"slice [{offset}, {offset + nbytes}) outside arena of {self.size_bytes} bytes"
            )
        return memoryview(self.buffer)[offset : offset + nbytes]

    def close(self, keep: bool = False) -> None:
        """Drop this mapping (and unlink the file, for the owner, unless ``keep``: it stays for
        the next daemon to adopt). Safe to call twice.

        The mmap is not closed explicitly: a tensor or memoryview another thread still holds
        keeps the memory mapped until it is gone (closing under it would crash that thread).
        """
        if self._closed:
            return
        self._closed = True
        self._tensor = None
        self.buffer = None
        if self.owner:
            (keep_mapped if keep else release_mapped)(self.path)


def arena_progress(every_s: float = 2.0):
    """A progress callback for ``Arena.create`` that logs how far the reservation got, at most
    every ``every_s`` (a large arena takes seconds, and a silent start looks hung)."""
    start = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done < total and now - last < every_s:
            return
        if done < total or now - start >= every_s:
            log.info("arena: %.1f of %.1f GiB reserved (%.0f s)", done / (1 << 30),
                     total / (1 << 30), now - start)
        last = now

    return progress
