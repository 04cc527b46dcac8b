"""Whether this node can back an arena of a given size, asked before the daemon reserves it.

The arena lives in a tmpfs (``/dev/shm``), which is often as large as RAM (containers), so
``posix_fallocate`` does not fail first: an arena larger than the memory behind it is reserved
until the kernel's OOM killer ends the daemon *and other processes* (engines on a real node).
So the daemon compares what it is about to reserve (the arena and its presence table) with three
figures first, and refuses with one line naming them (``check_room``):

    shm free          free bytes of the filesystem holding the arena (statvfs: f_bavail)
    MemAvailable      /proc/meminfo: what new allocations get without swapping
    cgroup room       the tightest memory limit of the process's cgroup and its ancestors
                      (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) less what is used there
                      (``memory.current`` / ``memory.usage_in_bytes`` less its inactive file
                      pages, which the kernel reclaims first: the working set)

Of the two memory figures ``MARGIN_BYTES`` stays free: the daemon process itself (Python, torch,
the page index: about 250 MiB measured with a small arena, more with many pages), its L3 I/O,
and the other processes' growth in the seconds a reservation takes; an arena that drives a
figure to zero is what makes the OOM killer pick a victim. The shm figure needs no margin: a
full tmpfs fails a reservation cleanly. Files about to be replaced (a crashed daemon's arena at
the same path) count as free, since they are unlinked before the new arena is made.

``read_room`` is the one place that reads /proc and /sys (its roots are parameters, so a test
can hand it a tree of its own); ``largest_arena`` and ``check_room`` are arithmetic on its
answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from hicached.errors import ConfigError

MARGIN_BYTES = 1 << 30  # left free of MemAvailable and of the cgroup's room (see above)
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as 2**63 rounded down to a page


class Room(NamedTuple):
    """What can back shared memory on this node, in bytes (None: the figure is not known, or
    there is no limit)."""

    shm_dir: str
    shm_free_bytes: int | None
    mem_available_bytes: int | None
    cgroup_limit_bytes: int | None  # the tightest limit of the cgroup and its ancestors
    cgroup_used_bytes: int | None  # used under that limit (less inactive file pages)


def read_room(shm_dir: str, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Room:
    """The figures of ``Room`` for an arena in directory ``shm_dir``, read now from ``proc``
    (``meminfo``, ``self/cgroup``) and the cgroup filesystems under ``cgroup_root`` (v2 at the
    root or at ``unified/``, v1 at ``memory/``). Reads only; an unreadable figure is None."""
    try:
        st = os.statvfs(shm_dir)
        shm_free = st.f_bavail * st.f_frsize
    except OSError:  # (no such directory: creating the arena there says so)
        shm_free = None
    limit = used = None
    for lim, use in _cgroup_limits(proc, cgroup_root):
        if limit is None or lim - use < limit - used:
            limit, used = lim, use
    return Room(shm_dir, shm_free, _mem_available(proc), limit, used)


def allocated_bytes(*paths: str) -> int:
    """Bytes the regular files at ``paths`` hold (their allocated blocks; 0 for a path with no
    file): what replacing them frees."""
    total = 0
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if os.path.isfile(path) and not os.path.islink(path):
            total += st.st_blocks * 512
    return total


def largest_arena(room: Room, credit_bytes: int = 0, margin_bytes: int = MARGIN_BYTES) -> int:
    """Bytes of shared memory that ``room`` can back (``credit_bytes``: files that will be freed
    first): the least of the shm free space, MemAvailable less ``margin_bytes``, and the
    cgroup's room less ``margin_bytes``; 0 when a figure is below its margin, 2**62 when no
    figure is known."""
    fits = [room.shm_free_bytes + credit_bytes] if room.shm_free_bytes is not None else []
    if room.mem_available_bytes is not None:
        fits.append(room.mem_available_bytes + credit_bytes - margin_bytes)
    if room.cgroup_limit_bytes is not None:
        fits.append(room.cgroup_limit_bytes - room.cgroup_used_bytes + credit_bytes
                    - margin_bytes)
    return max(0, min(fits)) if fits else 1 << 62


def check_room(arena_bytes: int, room: Room, credit_bytes: int = 0,
               table_bytes_of: Callable[[int], int] = lambda n: 0,
               margin_bytes: int = MARGIN_BYTES) -> None:
    """ConfigError, one line naming ``l2_size`` (``--l2-size``), every figure and the largest
    arena that fits, when the arena (``arena_bytes``) and its presence table
    (``table_bytes_of(arena_bytes)``, nondecreasing) need more shared memory than
    ``largest_arena(room, credit_bytes, margin_bytes)``; nothing otherwise."""
    table = table_bytes_of(arena_bytes)
    fits = largest_arena(room, credit_bytes, margin_bytes)
    if arena_bytes + table <= fits:
        return
    lo, hi = 0, arena_bytes  # the largest arena that fits with its table: lo fits, hi does not
    while hi - lo > 1 << 20:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mid + table_bytes_of(mid) <= fits else (lo, mid)
    figures = [] if room.shm_free_bytes is None else [
        f"{room.shm_dir} has {_size(room.shm_free_bytes)} free"]
    if room.mem_available_bytes is not None:
        figures.append(f"MemAvailable is {_size(room.mem_available_bytes)}")
    if room.cgroup_limit_bytes is not None:
        figures.append(f"the cgroup's memory limit is {_size(room.cgroup_limit_bytes)} with "
                       f"{_size(room.cgroup_used_bytes)} used")
    freed = f", {_size(credit_bytes)} of an old arena to be replaced" if credit_bytes else ""
    with_table = f" (and {_size(table)} for its presence table)" if table else ""
    raise ConfigError(
        f"l2_size (--l2-size): an arena of {_size(arena_bytes)}{with_table} is more than this "
        f"node can back: {', '.join(figures)}{freed}; keeping {_size(margin_bytes)} of memory "
        f"free, an arena of at most {_size(lo)} fits: lower --l2-size")


def _size(n: int) -> str:
    if abs(n) >= 1 << 40:
        return f"{n / (1 << 40):.1f} TiB"
    return f"{n / (1 << 30):.1f} GiB"


def _mem_available(proc: str) -> int | None:
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limits(proc: str, cgroup_root: str) -> list[tuple[int, int]]:
    """(limit, used) of each memory-limited cgroup from this process's up to its hierarchy's
    root, in every hierarchy with the memory controller (/proc/self/cgroup)."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":  # v2 (alone, or beside v1: "hybrid")
            mounts = [cgroup_root, os.path.join(cgroup_root, "unified")]
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            mounts = [os.path.join(cgroup_root, "memory")]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for mount in mounts:
            for d in _up_to(mount, path):
                limit = _read_int(os.path.join(d, files[0]))
                if limit is None or limit >= _UNLIMITED:
                    continue
                used = _read_int(os.path.join(d, files[1])) or 0
                inactive = _stat(os.path.join(d, "memory.stat"), files[2])
                out.append((limit, max(0, used - inactive)))
    return out


def _up_to(mount: str, path: str) -> list[str]:
    """``mount``/``path`` and its parents up to ``mount``; only ``mount`` when that directory
    is not there (a container that sees the host's path but mounts its own cgroup as root)."""
    parts = [p for p in path.split("/") if p]
    here = os.path.join(mount, *parts)
    if not os.path.isdir(here):
        return [mount] if os.path.isdir(mount) else []
    return [os.path.join(mount, *parts[:n]) for n in range(len(parts), -1, -1)]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())  # "max" (v2, no limit) -> ValueError -> None
    except (OSError, ValueError):
        return None


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
