"""Lease releases piggybacked on the client's next request (``hicached/client/piggyback.py``)."""

import threading
import time

import pytest
import torch
from conftest import wait_until
from pools import kv_pool, kv_tokens, pages

from hicached.client.piggyback import PendingReleases


class Recorder:
    def __init__(self):
        self.sent: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, ids):
        with self.lock:
            self.sent.append(list(ids))


def test_zero_delay_sends_each_release_at_once():
    r = Recorder()
    p = PendingReleases(r, 0.0)
    p.add(7)
    p.add(8)
    assert r.sent == [[7], [8]]
    assert p.take() == []


def test_taken_ids_are_never_sent_alone():
    r = Recorder()
    p = PendingReleases(r, 0.3)
    p.add(1)
    p.add(2)
    assert p.take() == [1, 2]
    time.sleep(0.5)
    assert r.sent == [] and p.sent_alone == 0
    p.close()


def test_ids_left_waiting_go_out_alone_after_the_delay():
    r = Recorder()
    p = PendingReleases(r, 0.05)
    t = time.monotonic()
    p.add(1)
    p.add(2)
    assert wait_until(lambda: r.sent == [[1, 2]], 5)
    assert time.monotonic() - t >= 0.05
    assert p.sent_alone == 1
    p.add(3)  # the thread goes on serving later ids
    assert wait_until(lambda: r.sent == [[1, 2], [3]], 5)
    p.close()


def test_a_failing_send_does_not_kill_the_thread():
    sent = []

    def send(ids):
        sent.append(ids)
        if len(sent) == 1:
            raise RuntimeError("socket gone")

    p = PendingReleases(send, 0.01)
    p.add(1)
    assert wait_until(lambda: len(sent) == 1, 5)
    p.add(2)
    assert wait_until(lambda: sent == [[1], [2]], 5)
    p.close()


def test_closed_or_dropped_ids_are_forgotten():
    r = Recorder()
    p = PendingReleases(r, 0.05)
    p.add(1)
    p.drop()
    p.close()
    p.add(2)
    time.sleep(0.2)
    assert r.sent == [] and p.take() == []
    with pytest.raises(ValueError):
        PendingReleases(r, -1)


def test_the_sender_thread_ends_when_idle_and_comes_back(monkeypatch):
    from hicached.client import piggyback

    monkeypatch.setattr(piggyback, "IDLE_EXIT_S", 0.1)
    r = Recorder()
    p = PendingReleases(r, 0.01)
    p.add(1)
    assert wait_until(lambda: r.sent == [[1]], 5)
    assert wait_until(lambda: p._thread is None, 5)  # nothing more to send: it ended
    p.add(2)
    assert wait_until(lambda: r.sent == [[1], [2]], 5)
    p.close()


def test_unleased_reads_wait_for_the_thread_or_close_never_a_carrier():
    sent = []
    p = PendingReleases(lambda *a: sent.append(a), 0.5)
    p.add_reads([64, 7], 1)
    p.add(3)
    assert p.take() == [3]  # a carrier takes the ids only
    p.add_reads([128, 8], 0)
    assert wait_until(lambda: sent == [([], [64, 7, 128, 8], 1)], 5)
    p.add_reads([192, 9], 2)
    p.add(4)
    assert wait_until(lambda: sent[1:] == [([4], [192, 9], 2)], 5)
    p.add_reads([256, 10], 1)
    assert p.close() == ([256, 10], 1)  # for the client's last Release, before its Bye
    p.add_reads([320, 11], 1)  # closed: ignored
    assert p.close() == ([], 0) and len(sent) == 2
    now = []
    q = PendingReleases(lambda *a: now.append(a), 0.0)  # no delay: at once
    q.add_reads([64, 7], 1)
    assert now == [([], [64, 7], 1)]
    d = PendingReleases(lambda *a: now.append(a), 0.05)
    d.add_reads([64, 7], 1)
    d.drop()  # a new session: the pairs named the old daemon's slots
    time.sleep(0.2)
    assert len(now) == 1 and d.close() == ([], 0)


def test_reads_past_what_one_release_reports_go_out_at_once(monkeypatch):
    from hicached.client import piggyback

    monkeypatch.setattr(piggyback, "MAX_TOUCHED", 2)
    sent = []
    p = PendingReleases(lambda *a: sent.append(a), 30.0)
    p.add_reads([1, 2, 3, 4, 5, 6], 1)  # 3 pairs: one Release reports 2
    assert wait_until(lambda: sent == [([], [1, 2, 3, 4], 1), ([], [5, 6], 0)], 5)
    p.close()


# ---------------------------------------------------------------- through a real daemon


def leases(observer):
    return observer.stats()["leases"]


@pytest.fixture
def pair(daemon):
    """A client that keeps its releases (30 s delay; its exists go through the socket, a carrier),
    an observer, and 4 stored pages."""
    with daemon.client(release_delay_s=30.0, shared_exists=False) as c, daemon.client() as obs:
        src = kv_pool(seed=5)
        c.register_mem_host_pool_v2(src, "kv")
        keys = [f"p{i}" for i in range(4)]
        assert all(c.batch_set_v1(keys, pages(0, 4)))
        dst = kv_pool()
        c.register_mem_host_pool_v2(dst, "kv")
        yield c, obs, keys, src, dst


def test_each_carrier_request_ends_the_pending_lease(pair):
    c, obs, keys, src, dst = pair
    assert all(c.batch_get_v1(keys, pages(0, 4)))
    assert torch.equal(kv_tokens(dst, 0, 4), kv_tokens(src, 0, 4))
    assert leases(obs) == 1  # held until the client's next request
    c.batch_exists_v2(keys)  # Exists carries it
    assert leases(obs) == 0
    assert all(c.batch_get_v1(keys, pages(0, 4)))
    assert all(c.batch_get_v1(keys, pages(0, 4)))  # Lease carries the previous one
    assert leases(obs) == 1
    assert all(c.batch_set_v1(["q0"], pages(8, 1)))  # Reserve carries it
    assert leases(obs) == 0
    assert c._conn.releases.sent_alone == 0


def test_other_requests_send_the_release_first(pair):
    c, obs, keys, _, _ = pair
    assert all(c.batch_get_v1(keys, pages(0, 4)))
    assert c.stats()["leases"] == 0  # ordered before GetStats on the same socket
    assert all(c.batch_get_v1(keys, pages(0, 4)))
    c.flush("l2")  # the pages just read are unpinned by then, so the flush drops them
    assert obs.stats()["l2_pages"] == 0


def test_an_idle_client_releases_after_its_delay(daemon):
    with daemon.client(release_delay_s=0.05) as c, daemon.client() as obs:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        assert all(c.batch_set_v1(["a", "b"], pages(0, 2)))
        assert all(c.batch_get_v1(["a", "b"], pages(2, 2)))
        assert wait_until(lambda: leases(obs) == 0, 5)
        assert c._conn.releases.sent_alone == 1


def test_closing_a_client_ends_its_pending_lease(pair):
    c, obs, keys, _, _ = pair
    assert all(c.batch_get_v1(keys, pages(0, 4)))
    assert leases(obs) == 1
    c.close()  # Bye frees the session's leases
    assert wait_until(lambda: leases(obs) == 0, 5)


def test_a_pending_release_of_a_restarted_daemon_is_dropped(make_daemon):
    d = make_daemon()
    with d.client(release_delay_s=30.0) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=2), "kv")
        assert all(c.batch_set_v1(["a"], pages(0, 1)))
        assert all(c.batch_get_v1(["a"], pages(1, 1)))
        d.stop()
        d.start()
        assert c.batch_exists(["a"]) in (0, 1)  # joins the new daemon; the old id is dropped
        assert c._conn.releases.take() == []
        assert c.stats()["leases"] == 0


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # its sockets are closed by the GC
def test_a_client_dropped_without_close_is_still_collected(daemon):
    """The sender thread holds its client weakly: an engine that drops a client keeps no zmq
    context or arena mapping alive through it."""
    import gc
    import weakref

    c = daemon.client(release_delay_s=30.0)
    c.register_mem_host_pool_v2(kv_pool(seed=3), "kv")
    assert all(c.batch_set_v1(["a"], pages(0, 1)))
    assert all(c.batch_get_v1(["a"], pages(1, 1)))  # a release waits; the thread runs
    thread = c._conn.releases._thread
    assert thread is not None and thread.is_alive()
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None
