"""What the daemon tells its service manager, as an interface: ``NullNotifier``, every call a no-op.

The daemon (``server.Daemon``) receives a notifier in its constructor and calls ``ready``,
``reloading``, ``stopping`` and ``watchdog`` (every ``watchdog_interval_s``, from the control
loop). ``hicached.ops.sdnotify.SystemdNotifier`` implements it for systemd's notify protocol;
the daemon never imports ``ops``. A notification must never raise.
"""

from __future__ import annotations

import time


class NullNotifier:
    """Not under systemd: every notification is dropped."""

    watchdog_interval_s: float | None = None

    def notify(self, *states: str) -> bool:
        return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}")

    def stopping(self, status: str = "draining") -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        pass
