"""The daemon's files on the node: the lock of its state dir (which also records the arena it
made) and its listening socket (which refuses to take over another daemon's).

``DaemonFiles(config)`` takes the state dir's lock when it is made (another daemon holding it:
``HicachedError``) and owns that descriptor until ``close``; it binds the ROUTER socket on a zmq
context it is given, and removes the socket's file at the end. It mutates nothing but these files
and calls nothing of the daemon's.
"""

from __future__ import annotations

import fcntl
import os

import zmq

from hicached import protocol as P
from hicached.arena import made_before
from hicached.errors import ConfigError, HicachedError
from hicached.sockpath import refusal


class DaemonFiles:
    """The state dir's lock, the arena's record in it, the socket's file (see the module
    docstring). Its ``config`` is read, never changed."""

    def __init__(self, config) -> None:
        """Take the lock of ``config.state_dir`` (``ConfigError``: the dir cannot be used;
        ``HicachedError``: another daemon holds it)."""
        self.config = config
        self.lock_fd = self._take_state_lock(config.state_dir)

    @staticmethod
    def _take_state_lock(state_dir: str) -> int:
        try:
            os.makedirs(state_dir, exist_ok=True)
            fd = os.open(os.path.join(state_dir, "hicached.lock"), os.O_RDWR | os.O_CREAT,
                         0o600)
        except OSError as e:
            raise ConfigError(f"state_dir: cannot use {state_dir!r}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HicachedError(
                f"another hicached daemon already uses state dir {state_dir}") from None
        return fd

    def recorded_arena(self, arena_path: str) -> bool:
        """Before the arena is made: whether the state dir's last daemon recorded this path in
        its lock file (``record_arena``); if so its files, left by a crash or kept by a stop
        (``on_stop = "keep"``), may be adopted or replaced (``arena.made_before``)."""
        try:
            if os.pread(self.lock_fd, 4096, 0).decode(errors="replace").strip() == arena_path:
                made_before(arena_path, arena_path + ".presence", arena_path + ".meta")
                return True
        except OSError:  # a record is a convenience: without it only hicached-* is replaced
            pass
        return False

    def record_arena(self, arena_path: str = "") -> None:
        """Record the arena this daemon made; "" once its files are gone (a clean exit), or a
        file someone makes at that path later would be replaced by the next start."""
        try:
            os.ftruncate(self.lock_fd, 0)
            if arena_path:
                os.pwrite(self.lock_fd, arena_path.encode() + b"\n", 0)
        except OSError:
            pass

    @staticmethod
    def check_endpoint(endpoint: str) -> None:
        """ConfigError when another process listens on the ipc socket: checked first, so a
        second daemon says so before it reserves an arena or opens an L3 backend (``bind``
        checks again, as the socket may be taken in between)."""
        path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
        if path and os.path.exists(path) and refusal(path) is None:
            raise ConfigError(f"endpoint: {endpoint} is in use by a running process (another "
                              "hicached daemon?): give this one another endpoint")

    def bind(self, ctx: zmq.Context, endpoint: str) -> zmq.Socket:
        """The daemon's ROUTER socket on ``endpoint`` (``ConfigError``: it cannot listen)."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_REQUEST_BYTES)
        try:
            self._bind_to(sock, endpoint)
        except (OSError, zmq.ZMQError) as e:
            sock.close(linger=0)
            raise ConfigError(f"endpoint: cannot listen on {endpoint}: {e}") from None
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _bind_to(self, sock: zmq.Socket, endpoint: str) -> None:
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            if not path:
                raise OSError("no socket path after ipc://")
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if os.path.exists(path):
                if refusal(path) is None:  # another daemon (another state_dir) serves it
                    raise ConfigError(f"endpoint: {endpoint} is in use by a running process "
                                      "(another hicached daemon?): give this one another "
                                      "endpoint")
                os.unlink(path)  # nobody listens: a leftover of a dead daemon
            old = os.umask(0o777 & ~self.config.access_mode)
            try:
                sock.bind(endpoint)
            finally:
                os.umask(old)
            self.set_group(path)
        else:
            sock.bind(endpoint)

    def set_group(self, path: str) -> None:
        """``socket_group``: hand ``path`` to the group, mode 0660 (clients of other users)."""
        gid = self.config.socket_gid
        if gid is not None:
            os.chown(path, -1, gid)
            os.chmod(path, self.config.access_mode)

    def remove_socket_file(self) -> None:
        """Remove the ipc socket's file (its socket closed: zmq leaves it)."""
        ep = self.config.endpoint
        if ep.startswith("ipc://"):
            try:
                os.unlink(ep[len("ipc://"):])
            except FileNotFoundError:
                pass

    def close(self, keep: bool = False) -> None:
        """The lock let go, and the arena's record cleared (once the arena's files are gone),
        unless ``keep``: the arena is kept for the next daemon, which finds it by the record."""
        if not keep:
            self.record_arena()
        os.close(self.lock_fd)
