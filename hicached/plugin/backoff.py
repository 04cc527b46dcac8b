"""The plugins' back-off from a failing daemon, and the watch that ends it when the daemon is back.

A daemon that is down, hung or restarting makes a plugin call fail (``DaemonUnavailable``); every
call would then wait its timeout. So after a failure every call misses at once for a while
(``retry_interval_s``, doubling per failure up to ``MAX_BACKOFF_S``). A long back-off alone would
cost the engine its hits for up to 30 s after the daemon is back (a ``systemctl restart``, a crash
and ``Restart=on-failure``, a warm restart that kept the arena: issue 49), so while it backs off
each call also looks at the daemon's ipc socket file::

    failure          the socket file's identity is noted (device, inode, ctime; or "none")
    each call        one stat of that file (about a microsecond, nothing sent to anyone)
      same file      still backing off: a hung daemon keeps its socket, a dead one leaves it
      another file   a daemon bound the endpoint anew: one connect() to it (accepted: retry now)

A new daemon binds its socket once its arena is mapped and its L3 opened, a moment before
READY=1, and answers once its loop runs: the first call after that reaches it, within a call of
the engine (well under a second). A daemon is never hammered: each new socket file earns one
retry; failing again notes that file and backs off as before (a file nobody listens on yet is
connected to again at the next call: refused at once, nothing reaches a daemon). A tcp://
endpoint has no file to watch: it backs off on time alone.
"""

from __future__ import annotations

import os
import time

from hicached.sockpath import refusal

MAX_BACKOFF_S = 30.0  # longest a failing daemon is left alone (calls miss meanwhile)


def socket_ident(path: str) -> tuple[int, int, int] | None:
    """(device, inode, ctime ns) of the file at ``path``, or None when there is none. The ctime
    tells a new file from an old one whose inode number the filesystem reused."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class RetryClock:
    """When a plugin's calls may try the daemon at ``endpoint`` again. Thread-safe enough for its
    use: fields are replaced whole, and a race only makes one more call try (or miss)."""

    def __init__(self, endpoint: str, interval_s: float, max_s: float = MAX_BACKOFF_S):
        """``interval_s``: the first back-off (doubled per failure up to ``max(max_s,
        interval_s)``)."""
        self.path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
        self.interval_s = interval_s
        self.max_s = max(max_s, interval_s)
        self._next_s = interval_s  # the back-off the next failure starts
        self._retry_at = 0.0  # calls miss without trying until then (monotonic)
        self._failed_on: tuple[int, int, int] | None = None  # the socket file at the failure

    def failed(self, now: float | None = None) -> None:
        """A call found the daemon unavailable: back off (the socket file as it is now noted)."""
        now = time.monotonic() if now is None else now
        self._failed_on = socket_ident(self.path) if self.path else None
        self._retry_at = now + self._next_s
        self._next_s = min(2 * self._next_s, self.max_s)

    def succeeded(self) -> None:
        """A call reached the daemon: the next failure backs off ``interval_s`` again."""
        self._next_s = self.interval_s
        self._retry_at = 0.0

    def wait_s(self, now: float | None = None) -> float:
        """Seconds calls still miss without trying (0: try now). Ends early, once, when another
        daemon listens on the endpoint's socket file (see the module docstring)."""
        now = time.monotonic() if now is None else now
        left = self._retry_at - now
        if left <= 0 or not self.path:
            return max(left, 0.0)
        ident = socket_ident(self.path)
        if ident is None or ident == self._failed_on:
            return left
        if refusal(self.path) is not None:  # bound, not yet listening (or a dead one's):
            return left  # asked again at the next call (a connect refused costs microseconds)
        self._retry_at = now  # a daemon is back: this call tries
        return 0.0
