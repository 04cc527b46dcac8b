"""Fault injection for L3 tests: the real file backend, made slow or failing on purpose.

Daemons load these as ``--l3-backend l3_doubles:SlowFileBackend`` (an out-of-tree backend named
``module:Class``) with this directory on their PYTHONPATH. Only the faults are invented; every
page still goes through the real ``FileBackend``.
"""

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
