"""Whether a process listens on a unix socket file: a daemon that died leaves its ipc socket file
behind, and ZeroMQ would connect to it and wait for an answer that never comes."""

from __future__ import annotations

import errno
import os
import socket


def refusal(path: str) -> str | None:
    """None when a process accepts connections on the unix socket at ``path``; else why not
    ("no such file", "connection refused": a leftover of a dead process, ...)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return None
    except TimeoutError:
        return None  # a full backlog: someone is there (a busy daemon), not nobody
    except OSError as e:
        if e.errno == errno.EAGAIN:
            return None  # (the same, non-blocking)
        return os.strerror(e.errno).lower() if e.errno else str(e)
    finally:
        probe.close()
