"""Per-page work of one batch shared between the I/O worker that runs the batch and one helper
thread: how a backend overlaps its checksums with its transfers.

A load reads page i and hashes it; on one thread the hash waits for the read and the next read
waits for the hash. With two threads pulling pages from one shared list, one thread's hash runs
while the other's read does (``os.preadv`` and ``xxhash`` both release the GIL), so the hashing
hides behind the reading instead of adding to it. Measured on the 2-vCPU VM, 64 pages of 1 MiB
from the page cache: read then hash on one thread 0.78 x the reads alone, reads and hashes on
two threads 1.17 x (``docs/benchmarks.md``).

    worker:  read 0 | hash 0 | read 2 | hash 2 | ...        (each takes the next page not taken)
    helper:      read 1 | hash 1 | read 3 | hash 3 | ...

``run`` returns only once both threads are done with the batch, so every page it loads is
verified before the batch's result (and so L2) sees it, and no thread still writes a slot the
controller may reuse. A batch of fewer than ``MIN_PAGES`` pages or ``MIN_BYTES`` bytes runs on
the worker alone: handing it over would cost more than it saves. A helper busy with another
batch is not waited for: the worker does the whole batch itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

MIN_PAGES = 2
MIN_BYTES = 1 << 20  # below this a batch is done before the helper would wake


class Fanout:
    """One helper thread (started on first use) that shares batches with their caller."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def run(self, work: Callable[[T], None], items: Sequence[T], nbytes: int) -> None:
        """``work(item)`` for each of ``items`` (``nbytes`` in all), on this thread and the
        helper; returns when every call has returned. An exception a call raised is raised
        here, after the other thread stopped (it takes no further item)."""
        if len(items) < MIN_PAGES or nbytes < MIN_BYTES:
            for item in items:
                work(item)
            return
        lock = threading.Lock()
        it = iter(items)
        failed = False

        def drain() -> None:
            nonlocal failed
            while True:
                with lock:
                    if failed:
                        return
                    item = next(it, _END)
                if item is _END:
                    return
                try:
                    work(item)
                except BaseException:
                    failed = True  # (both threads only ever set it)
                    raise

        helper = self._pool.submit(drain)
        try:
            drain()
        finally:
            if not helper.cancel():  # not started yet (busy with another batch): not waited for
                helper.result()

    def close(self) -> None:
        """Stop the helper once its batch (if any) is done."""
        self._pool.shutdown(wait=True)


_END = object()
