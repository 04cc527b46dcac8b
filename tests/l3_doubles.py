"""Fault injection for L3 tests: the real file backend, made slow or failing on purpose.

Daemons load these as ``--l3-backend l3_doubles:SlowFileBackend`` (an out-of-tree backend named
``module:Class``) with this directory on their PYTHONPATH. Only the faults are invented; every
page still goes through the real ``FileBackend``.
"""

import threading
import time

from hicached.backends.file import FileBackend


class SlowFileBackend(FileBackend):
    """``get_delay_s`` / ``put_delay_s`` / ``exists_delay_s``: each batch_get / batch_put /
    exists sleeps first; ``fail_puts``: every put fails."""

    name = "slow-file"

    def __init__(self, root: str, get_delay_s: float = 0.0, fail_puts: bool = False,
                 put_delay_s: float = 0.0, exists_delay_s: float = 0.0):
        super().__init__(root)
        self.get_delay_s = get_delay_s
        self.put_delay_s = put_delay_s
        self.exists_delay_s = exists_delay_s
        self.fail_puts = fail_puts

    def exists(self, ns, pool, keys):
        time.sleep(self.exists_delay_s)
        return super().exists(ns, pool, keys)

    def batch_get(self, ns, pool, keys, offsets, page_bytes):
        time.sleep(self.get_delay_s)
        return super().batch_get(ns, pool, keys, offsets, page_bytes)

    def batch_put(self, ns, pool, keys, offsets, page_bytes):
        time.sleep(self.put_delay_s)
        if self.fail_puts:
            raise OSError("injected: store unreachable")
        return super().batch_put(ns, pool, keys, offsets, page_bytes)


class RecordingBackend(FileBackend):
    """The file backend, recording which keys it was asked about and sent, and from which
    thread; ``exists_fails`` makes the question fail."""

    def __init__(self, root, exists_fails=False, **options):
        super().__init__(root, **options)
        self.exists_fails = exists_fails
        self.asked, self.sent, self.threads = [], [], set()

    def exists(self, ns, pool, keys):
        self.threads.add(threading.current_thread().name)
        self.asked.extend(keys)
        if self.exists_fails:
            raise OSError("injected: exists unreachable")
        return super().exists(ns, pool, keys)

    def batch_put(self, ns, pool, keys, offsets, page_bytes):
        self.threads.add(threading.current_thread().name)
        self.sent.extend(keys)
        return super().batch_put(ns, pool, keys, offsets, page_bytes)


PAGE = 4096  # bytes of the pages commit_pages writes


def commit_pages(index, arena, keys, fill):
    out = []
    for i, key in enumerate(keys):
        e = index.reserve(("ns", "kv"), key, PAGE, PAGE)
        arena.tensor[e.offset:e.offset + PAGE].fill_(fill + i)
        index.commit(e)
        out.append(e)
    return out


def wait_jobs(workers, tier):
    deadline = time.monotonic() + 10
    while workers.in_flight and time.monotonic() < deadline:
        tier.collect()
        time.sleep(0.01)
    assert workers.in_flight == 0
