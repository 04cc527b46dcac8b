"""The session-end check that the suite left nothing of its own in /dev/shm (a pytest plugin,
loaded by ``conftest.py``). It fails the run, naming each file, and removes them.

The suite's files, told apart from other processes' on a shared machine by name and record:

    what                                  how it is found
    a daemon's arena, ``.presence`` and   the path the daemon recorded in its state dir's
      ``.meta`` (hicached-<digest>, or a    ``hicached.lock`` (it writes "" there on a clean
      custom arena_path)                    exit that frees the arena): every lock file
                                            under the session's basetemp
    a test's own file (hicached-test-*)   a name with the pid of a test process (``-<pid>-`` or
    a daemon's hf3fs scratch file           ``-<pid>`` at its end), or of a daemon ``DaemonProc``
      (hicached-hf3fs-<pid>-*)              started (``spawned``)

Under xdist each worker checks its own basetemp and pids and hands its list to the controller
(``workeroutput``), which reports them all at its end; without xdist the one process does both.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

SHM = "/dev/shm"
_PIDS: set[int] = set()  # daemons this process started (DaemonProc)
_LEFT: list[str] = []  # the controller's: what the workers reported
_START = time.time()  # files named with a pid are the suite's only if made since (pids recycle)


def spawned(pid: int) -> None:
    """Count ``pid`` (a daemon this test process started) among the suite's processes."""
    _PIDS.add(pid)


def _recorded_arenas(basetemp: Path) -> set[str]:
    paths = set()
    for lock in basetemp.rglob("hicached.lock"):
        try:
            recorded = lock.read_text(errors="replace").strip()
        except OSError:
            continue
        if recorded:
            paths.update((recorded, recorded + ".presence", recorded + ".meta"))
    return paths


def leftovers(basetemp: Path | None, pids: set[int]) -> list[str]:
    """The files in /dev/shm that this process's tests (or the daemons they started) made and
    left: recorded in a lock file under ``basetemp``, or named with one of ``pids``."""
    found = {p for p in _recorded_arenas(basetemp) if os.path.lexists(p)} if basetemp else set()
    if pids:
        token = re.compile(r"-(%s)(-|$)" % "|".join(str(p) for p in sorted(pids)))
        try:
            names = os.listdir(SHM)
        except OSError:
            names = []
        found.update(p for p in (os.path.join(SHM, n) for n in names
                                 if n.startswith("hicached-") and token.search(n))
                     if _made_since(p, _START))
    return sorted(found)


def _made_since(path: str, t: float) -> bool:
    try:
        return os.lstat(path).st_ctime >= t - 1.0
    except OSError:
        return False


def _remove(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def _basetemp(config: pytest.Config) -> Path | None:
    factory = getattr(config, "_tmp_path_factory", None)  # (pytest's tmp_path plugin)
    try:
        return factory.getbasetemp() if factory is not None else None
    except OSError:
        return None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    mine = leftovers(_basetemp(config), _PIDS | {os.getpid()})
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        config.workeroutput["shm_leftovers"] = mine
        _remove(mine)
        return
    left = sorted(set(_LEFT) | set(mine))
    _remove(left)
    if left:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        msg = (f"the suite left {len(left)} file(s) in {SHM} (removed now; a test or fixture "
               "does not clean up): " + ", ".join(left))
        if reporter is not None:
            reporter.write_sep("=", "shm leftovers", red=True)
            reporter.write_line(msg)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """(xdist, controller) A worker finished: keep what it left."""
    _LEFT.extend(getattr(node, "workeroutput", {}).get("shm_leftovers", ()))
