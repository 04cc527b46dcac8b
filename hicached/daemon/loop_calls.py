"""Calls from other threads onto the control loop: a queue of ``(fn, Future)`` and a pipe that
wakes the loop.

``LoopCalls`` owns the queue and both ends of the pipe. Any thread may ``call_soon`` (queue
``fn``, wake the loop) or ``call`` (the same, then wait for the result; on the loop's own thread
``fn`` runs at once). The loop polls ``wake_fd`` and runs what is queued with ``run``, then
``after_each()`` (the controller's books: what an answer did not wait for). ``close`` fails
later calls with ``ShuttingDown`` and closes the pipe. It calls nothing but the functions it is
given.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hicached.errors import HicachedError, ShuttingDown


class LoopCalls:
    """The loop's inbox of calls from other threads (see the module docstring)."""

    def __init__(self, after_each: Callable[[], None] = lambda: None) -> None:
        self.after_each = after_each
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (fn, Future) for the loop
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self.loop_thread: int | None = None  # set by the loop when it starts (``enter``)
        self.closed = False

    def enter(self) -> None:
        """The calling thread is the control loop's from now on (``call`` runs there at once)."""
        self.loop_thread = threading.get_ident()

    def on_loop(self) -> bool:
        """Whether the caller is the control loop's thread."""
        return threading.get_ident() == self.loop_thread

    def wake(self) -> None:
        """Wake the loop (safe from a signal handler: one write, no lock)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def call_soon(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the control loop; thread-safe. The future holds its result."""
        fut: Future = Future()
        if self.closed:
            fut.set_exception(ShuttingDown("daemon is stopped"))
            return fut
        self._calls.put((fn, fut))
        self.wake()
        return fut

    def call(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """``fn()`` run on the control loop, its result returned (or its exception raised)."""
        if self.on_loop():
            return fn()
        try:
            return self.call_soon(fn).result(timeout_s)
        except FutureTimeout:
            raise HicachedError(f"daemon control loop did not answer within {timeout_s} s") from None

    def run(self, error: Exception | None = None) -> None:
        """On the loop: run the queued calls (``error``: fail each with it instead)."""
        try:
            os.read(self.wake_fd, 65536)
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            if error is not None:
                fut.set_exception(error)
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            self.after_each()

    def refuse(self) -> None:
        """Later calls fail with ``ShuttingDown`` (the daemon is closing)."""
        self.closed = True

    def close(self) -> None:
        """``refuse``, and the pipe closed."""
        self.closed = True
        os.close(self.wake_fd)
        os.close(self._wake_w)
