"""The named phases of ``hicached serve``'s start, where a Ctrl-C is acted on, and a test's
pause at one of them.

    phase            reached                                              SIGINT (interrupts.py)
    start            the CLI's first line: Python has started, hicached's END
                     CLI is imported (``python -m hicached`` / ``hicached``)
    config           the config is read; serve's imports (torch) are next END
    import:MODULE    MODULE is about to be imported for the first time    END
                     (``import:torch.cuda`` comes from C++: torch's
                     ``_C._initExtension`` is on the stack)
    inside:FUNCTION  the first Python call made from inside the C         END
                     function FUNCTION (``inside:_c10d_init``: torch's
                     distributed init, where a raised KeyboardInterrupt
                     aborted the process)
    imported         the imports are done, nothing is made yet            END
    lock             the state dir's lock is taken (from here the start   RECORD
                     has things to undo)
    arena            after each step of the arena's reservation           RECORD
                     (``arena.RESERVE_STEP`` bytes allocated or pre-faulted)
    l3               the L3 backend is open (or none is configured)       RECORD
    socket           the control socket is bound                          RECORD
    admin            the admin API listens, if configured                 RECORD

At each RECORD phase ``reach`` raises KeyboardInterrupt if SIGINT came (``interrupts.check``),
and the start undoes what it made. Once the daemon's own handlers are in place it is ready: a
SIGINT then stops it in order.

For tests, ``Phases(pause_at=PHASE)`` (``HICACHED_TEST_PAUSE_AT``, read by the CLI) stops the start
at PHASE: it writes ``hicached: test pause at PHASE`` on stderr and waits, up to ``PAUSE_LIMIT_S``,
for a SIGINT, so a test sends the signal exactly there rather than after a guessed sleep. The
``import:`` and ``inside:`` phases are only watched for when asked (the latter profiles the main
thread's calls until it fires).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

from hicached.errors import ConfigError
from hicached.ops import interrupts

PAUSE_ENV = "HICACHED_TEST_PAUSE_AT"
CRASH_ENV = "HICACHED_TEST_CRASH_AT"  # a test's kill at a point of the journal (not a phase)
PAUSE_LIMIT_S = 60.0  # a test that never signals: the start goes on
NAMED = ("start", "config", "imported", "lock", "arena", "l3", "socket", "admin")
WATCHED = ("import:", "inside:")


class Phases:
    """Where ``hicached serve``'s start is (see the module docstring); ``reach`` is called at each
    phase by the CLI, ``serve`` and the ``Daemon`` (its ``on_phase``)."""

    def __init__(self, pause_at: str | None = None, crash_at: str | None = None):
        """``crash_at``: not a phase of the start, carried to the daemon for a test's kill at a
        point of its journal (``HICACHED_TEST_CRASH_AT``: ``daemon/journal.CrashPoint``)."""
        if crash_at:  # (imported only then: the CLI's start imports nothing of the daemon)
            from hicached.daemon.journal import CrashPoint

            CrashPoint(crash_at)  # (ConfigError naming the variable, before anything starts)
        self.crash_at = crash_at or None
        if pause_at and pause_at not in NAMED and not pause_at.startswith(WATCHED):
            raise ConfigError(f"{PAUSE_ENV}={pause_at!r}: not a phase; phases: "
                             f"{', '.join(NAMED)}, import:MODULE, inside:FUNCTION")
        self.pause_at = pause_at or None
        self._paused = False
        if self.pause_at and self.pause_at.startswith("import:"):
            sys.meta_path.insert(0, _ImportWatch(self.pause_at[len("import:"):], self))
        elif self.pause_at and self.pause_at.startswith("inside:"):
            _watch_inside(self.pause_at[len("inside:"):], self)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Phases:
        """The phases of a start whose test pause, if any, is ``env[PAUSE_ENV]`` (and its
        test kill ``env[CRASH_ENV]``)."""
        return cls(env.get(PAUSE_ENV), env.get(CRASH_ENV))

    def reach(self, name: str) -> None:
        """The start is at phase ``name``: pause there if a test asked (once), then raise
        KeyboardInterrupt if SIGINT came (``interrupts.check``)."""
        if name == self.pause_at:
            self.pause(name)
        interrupts.check()

    def pause(self, name: str) -> None:
        """Say ``hicached: test pause at NAME`` on stderr and wait for a SIGINT (its handler runs
        while this waits), for ``PAUSE_LIMIT_S`` at most. Once per start."""
        if self._paused:
            return
        self._paused = True
        os.write(2, f"hicached: test pause at {name}\n".encode())
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not interrupts.pressed() and time.monotonic() < deadline:
            time.sleep(0.01)  # a signal cuts the sleep short and runs the handler


class _ImportWatch:
    """A meta path finder that pauses when ``module`` is about to be imported (it finds nothing:
    the import goes on as without it)."""

    def __init__(self, module: str, phases: Phases):
        self.module, self.phases = module, phases

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.module:  # (None: the next finder finds it)
            sys.meta_path.remove(self)
            self.phases.pause(f"import:{fullname}")


def _watch_inside(function: str, phases: Phases) -> None:
    """Pause at the first Python call made while the C function ``function`` runs on the main
    thread (a profile hook, removed when it fires)."""
    depth = 0

    def profile(frame, event, arg) -> None:
        nonlocal depth
        if event == "c_call" and getattr(arg, "__name__", None) == function:
            depth += 1
        elif event in ("c_return", "c_exception") and getattr(arg, "__name__", None) == function:
            depth -= 1
        elif depth and event == "call":
            sys.setprofile(None)
            phases.pause(f"inside:{function}")

    sys.setprofile(profile)
