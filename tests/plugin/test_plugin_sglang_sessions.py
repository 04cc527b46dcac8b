"""The plugin's per-thread daemon sessions (``hicached/plugin/sessions.py``).

SGLang calls one backend from its backup, prefetch and prefetch-I/O threads at once. With one
shared ``Client`` an exists waited for another thread's set to finish copying its pages into
set-ahead slots (that copy runs under the client's lock); each thread now has its own client.
"""

import threading
import time

import torch
from sglang_env import (
    PAGE,
    SGLangLikePool,
    fill_random,
    idx,
    keys_of,
    kv_bytes,
)

from hicached import HostPool


class GatedPool(SGLangLikePool):
    """A host pool whose page copies block in the thread ``armed`` names until ``release``
    is set (the copy reads the pool's pointers through ``get_page_buffer_meta``)."""

    def __init__(self, pool):
        super().__init__(pool)
        self.armed = None
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        if name != "get_page_buffer_meta":
            return super().__getattr__(name)

        def meta(indices):
            if self.armed is threading.current_thread():
                self.entered.set()
                self.release.wait(30)
            return self._pool.get_page_buffer_meta(indices)
        return meta


def test_an_exists_is_answered_while_another_thread_copies_a_large_set(sg, plugin, daemon):
    """The backup thread's second set copies its 80 KiB pages into set-ahead slots while its
    request travels; the copy is held there. The prefetch thread's exists (a round trip: the
    keys are not in L2 and an L3 is attached) and a get are answered meanwhile."""
    big = fill_random(HostPool.allocate_mha(64, PAGE, layers=4, heads=8, head_dim=160,
                                            layout="page_first", dtype=torch.bfloat16), 1)
    assert big.page_bytes >= 64 * 1024  # set-ahead slots are used for pages this large
    pool = GatedPool(big)
    b = plugin(daemon.endpoint, {"kv": pool}, extra={"interface_v1": 1})
    first, second = keys_of("first-", 8), keys_of("second-", 8)
    result = {}

    def backup():
        result["first"] = b.batch_set_v1(first, idx(0, 8))  # its answer grants set-ahead slots
        b.client().wait_committed()  # this thread's session: the others see the pages now
        pool.armed = threading.current_thread()
        result["second"] = b.batch_set_v1(second, idx(8, 8))
        b.client().wait_committed()

    thread = threading.Thread(target=backup, name="backup")
    thread.start()
    try:
        assert pool.entered.wait(10), "the second set never copied"
        t0 = time.monotonic()
        assert b.batch_exists(keys_of("absent-", 4)) == 0
        assert b.batch_exists(first) == 8
        assert b.batch_get_v1(first, idx(40, 8)) == [True] * 8
        took = time.monotonic() - t0
        assert not pool.release.is_set() and thread.is_alive()  # the set is still copying
        assert took < 2.0, f"exists/get waited {took:.1f} s behind the set"
    finally:
        pool.release.set()
        thread.join(30)
    assert result == {"first": [True] * 8, "second": [True] * 8}
    assert b.batch_exists(second) == 8
    assert b.batch_get_v1(second, idx(48, 8)) == [True] * 8
    for i in range(8):
        assert torch.equal(kv_bytes(big, 40 + i, 1), kv_bytes(big, i, 1))
        assert torch.equal(kv_bytes(big, 48 + i, 1), kv_bytes(big, 8 + i, 1))
    assert b._sessions.sessions == 2  # the attaching (here: test) thread and the backup thread


def test_each_thread_has_a_session_closed_after_the_thread_ends(sg, plugin, daemon):
    b = plugin(daemon.endpoint, {"kv": HostPool.allocate_mha(16, PAGE, layers=1, heads=1,
                                                             head_dim=8)})
    keys = keys_of("s-", 2)
    assert b.batch_set_v1(keys, idx(0, 2)) == [True, True]
    main = b.client()
    main.wait_committed()  # the other threads' sessions see the pages now
    seen, called, done = [], threading.Barrier(4), threading.Event()

    def work(hold=True):
        seen.append((b.batch_exists(keys), b.client()))
        if hold:  # alive until the test has counted the sessions
            called.wait(10)
            done.wait(10)

    workers = [threading.Thread(target=work) for _ in range(3)]
    for t in workers:
        t.start()
    called.wait(10)
    assert [n for n, _ in seen] == [2, 2, 2]
    clients = {id(c) for _, c in seen}
    assert len(clients) == 3 and id(main) not in clients and b.client() is main
    assert b._sessions.sessions == 4
    done.set()
    for t in workers:
        t.join()
    ended = [c for _, c in seen]
    late = threading.Thread(target=work, args=(False,))  # closes the ended threads' sessions
    late.start()
    late.join()
    assert b._sessions.sessions == 2 and all(c._conn.closed for c in ended)
    b.close()
    assert b._sessions.sessions == 0 and main._conn.closed and seen[-1][1]._conn.closed
    assert b.batch_exists(keys) == 0  # closed: a miss
