"""Which process a client is, and whether it still runs: how the daemon knows to drop the
session of a client that died without saying goodbye (SIGKILL, OOM killer, a crashed engine).

A pid alone is not enough:

- an engine in a container has its own pid namespace: the pid it sees for itself is not the
  one the daemon (on the host, or in another container) sees, and may name an unrelated
  process there, or none, so its live session would be dropped;
- a pid is reused once its process is gone: a dead client's pid given to a new process would
  keep its session forever.

So the daemon asks the kernel: on an ``ipc://`` socket libzmq reads the connecting process's
credentials (``SO_PEERCRED``) and hands them over as the ``Peer-Address`` property of each
message, with the pid already translated into the daemon's pid namespace. The daemon keeps
that pid together with the process's start time (``/proc/PID/stat``, field 22), and calls the
client dead once that pid is gone or belongs to a process started at another time.

On a ``tcp://`` socket there are no credentials: the pid and start time the client states in
its ``Hello`` are used when it shares the daemon's pid namespace (same ``/proc/self/ns/pid``
inode), and checked against ``/proc`` once. Otherwise the daemon cannot tell; such a session
lives on (its reservations and leases still expire by their TTLs) until the daemon restarts.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

# libzmq's Peer-Address of an ipc connection: "<host>:<uid>:<gid>:<pid>" (zmq 4.3)
_PEERCRED = re.compile(r"^[^:]*:(\d+):(\d+):(\d+)$")


class ProcessRef(NamedTuple):
    """A client process as the daemon can check it: ``pid`` in the daemon's pid namespace and
    its start time in clock ticks since boot; ``how`` says where they come from: ``peer``
    (kernel credentials of the socket), ``claimed`` (the Hello's, same pid namespace) or
    ``none`` (not checkable: never called dead)."""

    pid: int
    start: int
    how: str


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (``/proc/PID/stat`` field 22, clock ticks since boot), or
    None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])  # fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


def own_pid_ns() -> int:
    """Inode of this process's pid namespace (0: unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def own_start_ticks() -> int:
    return start_ticks(os.getpid()) or 0


def peer_pid(peer_address: str | None) -> int:
    """The pid in libzmq's ``Peer-Address`` of an ipc connection (0: not there, or the peer is
    outside the daemon's pid namespace, where the kernel reports 0)."""
    m = _PEERCRED.match(peer_address or "")
    return int(m.group(3)) if m else 0


def identify(peer: int, pid: int, start: int, pid_ns: int, daemon_pid_ns: int) -> ProcessRef:
    """What the daemon will check of a client: ``peer`` the pid from the socket's credentials
    (0: none), ``pid`` / ``start`` / ``pid_ns`` what its Hello states."""
    if peer > 0:
        ticks = start_ticks(peer)
        if ticks is not None:
            return ProcessRef(peer, ticks, "peer")
        return ProcessRef(peer, 0, "peer")  # gone already: the next sweep drops it
    if pid > 0 and start > 0 and pid_ns and pid_ns == daemon_pid_ns and start_ticks(pid) == start:
        return ProcessRef(pid, start, "claimed")
    return ProcessRef(pid, 0, "none")


def alive(ref: ProcessRef) -> bool:
    """False once the process ``ref`` names is known to be gone; True while it runs or when it
    cannot be told."""
    if ref.how == "none":
        return True
    ticks = start_ticks(ref.pid)
    if ticks is None:
        # no /proc entry: gone, unless /proc itself is missing (then fall back on signal 0)
        if os.path.isdir("/proc/self"):
            return False
        try:
            os.kill(ref.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return ref.start == 0 or ticks == ref.start
