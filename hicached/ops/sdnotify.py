"""systemd's notify protocol (``Type=notify``): datagrams to ``$NOTIFY_SOCKET``, no dependency.

What the daemon says, and when (the unit file is ``configs/hicached.service``):

    READY=1       once the arena is mapped, the L3 backend is open and the admin API listens
    WATCHDOG=1    from the control loop, every half ``WATCHDOG_USEC``: a loop that is stuck stops
                  sending, and systemd restarts the daemon (``WatchdogSec=``)
    RELOADING=1   SIGHUP: policies being re-read (READY=1 follows)
    STOPPING=1    SIGTERM: draining (``Daemon._drain_for_shutdown``)
    STATUS=...    one human line shown by ``systemctl status``

``NOTIFY_SOCKET`` is a filesystem path or, starting with ``@``, an abstract socket. Without it
(not started by systemd) the notifier is a ``NullNotifier`` (``daemon/notifier.py``: what the
daemon calls; this module only implements it). Sending never raises: a lost
notification must not take the daemon down (it is logged once).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

from hicached.daemon.notifier import NullNotifier

log = logging.getLogger(__name__)


class SystemdNotifier(NullNotifier):
    """Sends to one notify socket. ``watchdog_interval_s`` is half of ``WATCHDOG_USEC`` (None
    when systemd asked for no watchdog, or asked another process: ``WATCHDOG_PID``)."""

    def __init__(self, address: str, watchdog_usec: int = 0):
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_interval_s = watchdog_usec / 2e6 if watchdog_usec > 0 else None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._failed = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NullNotifier:
        """A notifier for the environment systemd gave this process (``NullNotifier`` if none)."""
        address = env.get("NOTIFY_SOCKET", "")
        if not address:
            return NullNotifier()
        usec = 0
        pid = env.get("WATCHDOG_PID", "")
        if not pid or pid == str(os.getpid()):
            try:
                usec = int(env.get("WATCHDOG_USEC", "0") or 0)
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r (not an integer)", env.get("WATCHDOG_USEC"))
        return cls(address, usec)

    def notify(self, *states: str) -> bool:
        try:
            self._sock.sendto("\n".join(states).encode(), self.address)
        except OSError as e:
            if not self._failed:
                log.warning("systemd notification %s to %r failed: %s", states[0],
                            self.address, e)
                self._failed = True
            return False
        return True

    def close(self) -> None:
        self._sock.close()
