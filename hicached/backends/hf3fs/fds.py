"""Open segment files of the 3FS backend: a bounded LRU of fds shared by the reader and writer.

A node may own thousands of segment files (2 TiB in 256 MiB segments is 8,192) and read as
many of other nodes', while the process may hold only ``RLIMIT_NOFILE`` fds (systemd's default
soft limit is 1,024). So no segment file is held open for good: ``FdTable`` keeps at most
``max_open`` open, closes the least recently used one that no I/O is using before it opens
another, and opens a closed one again on its next use (one ``open``, plus the USRBIO register).

    acquire(key)  -> handle, users += 1     (opens the file if it is not open)
    ... I/O on handle.fd ...                (a USRBIO batch holds its handles until reaped)
    release(handle)  users -= 1             (a dropped handle is closed at 0)

What must stay true: an fd is closed only while its ``users`` is 0, so no I/O ever runs on a
closed or recycled fd. Hence the table may pass ``max_open`` while more handles than that are
in use at once (one batch over many segments); it shrinks back as they are released and others
opened. An open that fails with EMFILE / ENFILE (other fds of the process took the room) closes
every unused handle, lowers ``max_open`` to half the files it held, and tries once more.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from collections import OrderedDict

from hicached.backends.hf3fs.io import SlotIO

log = logging.getLogger(__name__)

FD_SHARE = 0.5  # of the soft RLIMIT_NOFILE for segment files; the rest: sockets, clients, ...
FD_FLOOR = 16


def fd_budget(share: float = FD_SHARE, floor: int = FD_FLOOR) -> int:
    """``max_open`` for ``max_open_files = "auto"``: ``share`` of this process's soft
    RLIMIT_NOFILE (read now: ``hicached serve`` raises it to the hard limit at start), at least
    ``floor``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 1 << 20
    return max(floor, int(soft * share))


class FdHandle:
    """An open segment file: ``fd`` stays valid while ``users`` > 0 (see ``FdTable``)."""

    __slots__ = ("dropped", "fd", "users")

    def __init__(self, fd: int):
        self.fd, self.users, self.dropped = fd, 0, False


class FdTable:
    """At most ``max_open`` segment files open (and registered with the I/O path), least
    recently used closed first, never one in use (see the module docstring). Thread-safe."""

    def __init__(self, io: SlotIO, max_open: int = 256, open_flags: int = 0):
        self.io = io
        self.max_open = max_open
        self.open_flags = open_flags  # os.O_DIRECT on FUSE mounts (see ``wants_direct``)
        self.closes = 0  # unused fds closed to stay within max_open (or after EMFILE)
        self.opens = 0
        self._open: OrderedDict[tuple, FdHandle] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, key: tuple, path: str, writable: bool = False, fd: int = -1) -> FdHandle:
        """The handle of ``path``, one more user (opened on first use, or again after it was
        closed; ``fd`` adopts a file just created). Raises OSError when the file cannot be
        opened or registered. Keys name a file for good: one key, one path, one mode."""
        with self._lock:
            h = self._open.get(key)
            if h is None:
                self._trim(1)
                if fd < 0:
                    fd = self._open_locked(path, os.O_RDWR if writable else os.O_RDONLY, 0)
                try:
                    self.io.register(fd)
                except OSError:
                    os.close(fd)
                    raise
                h = self._open[key] = FdHandle(fd)
            self._open.move_to_end(key)
            h.users += 1
            return h

    def release(self, h: FdHandle) -> None:
        with self._lock:
            h.users -= 1
            if h.users == 0 and h.dropped:
                self._finish(h)

    def open_file(self, path: str, flags: int, mode: int) -> int:
        """``os.open`` with the table's flags, making room (closing unused handles) first and,
        at EMFILE / ENFILE, once more; for a file to ``acquire(fd=...)`` next."""
        with self._lock:
            self._trim(1)
            return self._open_locked(path, flags, mode)

    def drop(self, key: tuple) -> None:
        """Close ``key``'s fd as soon as nobody uses it (a retired or deleted segment)."""
        with self._lock:
            h = self._open.pop(key, None)
            if h is not None:
                h.dropped = True
                if h.users == 0:
                    self._finish(h)

    def swap_io(self, io: SlotIO) -> None:
        """Move every open fd to another I/O path (USRBIO found unusable at ``open``)."""
        with self._lock:
            for h in self._open.values():
                try:
                    self.io.unregister(h.fd)
                except OSError:
                    pass
                io.register(h.fd)
            self.io = io

    def drop_all(self) -> None:
        for key in list(self._open):
            self.drop(key)

    def __len__(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------ under self._lock

    def _open_locked(self, path: str, flags: int, mode: int) -> int:
        try:
            fd = os.open(path, flags | self.open_flags, mode)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            held = len(self._open)
            self._close_unused(held)
            lower = max(FD_FLOOR, held // 2)
            if lower < self.max_open:  # leave the rest of the process room from now on
                log.warning("hf3fs: out of fds (%s) with %d segment files open; keeping at most "
                            "%d open (was %d)", e, held, lower, self.max_open)
                self.max_open = lower
            fd = os.open(path, flags | self.open_flags, mode)
        self.opens += 1
        return fd

    def _trim(self, room: int) -> None:
        """Close least recently used unused handles until ``room`` more fit in max_open."""
        self._close_unused(len(self._open) + room - self.max_open)

    def _close_unused(self, n: int) -> None:
        if n <= 0:
            return
        for key, h in list(self._open.items()):
            if h.users == 0:
                del self._open[key]
                self._finish(h)
                self.closes += 1
                n -= 1
                if n == 0:
                    break

    def _finish(self, h: FdHandle) -> None:
        try:
            self.io.unregister(h.fd)
        except OSError:
            pass
        os.close(h.fd)
