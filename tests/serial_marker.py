"""Tests that must run alone: ``@pytest.mark.serial`` (a pytest plugin, loaded by
``conftest.py``). Under xdist (pyproject's ``addopts``) the suite runs on several workers at
once; a serial test (a benchmark's smoke run, a test that fills the machine's memory or times
the machine) waits until no other worker is inside a test, and the others wait while it runs.

A readers-writer lock on two files in the run's shared basetemp, held from a test's setup to
its teardown (``pytest_runtest_protocol``): every test takes ``gate`` for a moment and then
``run`` shared; a serial test takes ``gate`` and keeps it while it takes ``run`` exclusive, so
no other test starts behind it (it is not starved by workers taking turns) and it starts once
the running ones ended. Without xdist (one process) there is nothing to wait for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest


def _lock_dir(config: pytest.Config) -> Path | None:
    """The basetemp the workers share (xdist gives each ``<basetemp>/<worker id>``)."""
    if not hasattr(config, "workerinput") or not config.option.basetemp:
        return None
    return Path(config.option.basetemp).parent


@contextlib.contextmanager
def _held(path: Path, how: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # (releases the lock)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    where = _lock_dir(item.config)
    if where is None:
        return (yield)
    gate, run = where / "serial.gate", where / "serial.run"
    if item.get_closest_marker("serial") is not None:
        with _held(gate, fcntl.LOCK_EX), _held(run, fcntl.LOCK_EX):
            return (yield)
    with _held(gate, fcntl.LOCK_EX):
        fd = os.open(run, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        return (yield)
    finally:
        os.close(fd)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "serial: runs alone, no other test at the same time (tests/serial_marker.py)")
