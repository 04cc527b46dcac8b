"""``Client.wait_committed``: a set's Commit goes without an answer; waiting for it makes the
pages visible to every other client (the PD prefill's "ready"), with at most one Ping, and says
so when it cannot know (a stopped daemon, a dropped socket)."""

import signal

import pytest
from conftest import sigstop
from pools import kv_pool, pages

from hicached import PoolTransfer
from hicached import protocol as P
from hicached.errors import DaemonUnavailable

NS = "model-a"


def pings(client):
    """Every Ping the client sends from now on."""
    sent = []
    original = client._conn.roundtrip

    def roundtrip(msg, *a, **kw):
        if isinstance(msg, P.Ping):
            sent.append(msg)
        return original(msg, *a, **kw)
    client._conn.roundtrip = roundtrip
    return sent


@pytest.mark.parametrize("shared", [False, True])
def test_pages_are_visible_to_another_client_after_the_wait(daemon, shared):
    with daemon.client(NS, shared_exists=shared, shared_gets=shared) as c, \
            daemon.client(NS) as other:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        sent = pings(c)
        c.wait_committed()  # nothing sent yet: nothing to wait for
        assert sent == []
        keys = [f"k{i}" for i in range(4)]
        assert all(c.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=keys)])["kv"])
        c.wait_committed()
        assert other.batch_exists(keys) == 4
        assert len(sent) == 1 or (shared and not sent)  # (the table may ack it first)
        c.wait_committed()  # known read now: no second round trip
        assert len(sent) <= 1


def test_a_stopped_daemon_then_a_dropped_socket_raise(daemon):
    with daemon.client(NS, shared_exists=False, shared_gets=False, timeout_s=1.0) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        assert all(c.batch_set_v2([PoolTransfer("kv", pages(0, 2), keys=["a", "b"])])["kv"])
        sigstop(daemon.proc.pid)
        try:
            with pytest.raises(DaemonUnavailable, match="no answer"):
                c.wait_committed(0.3)
            with pytest.raises(DaemonUnavailable, match="may be lost"):
                c.wait_committed(0.3)  # the socket that carried it was dropped
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert all(c.batch_set_v2([PoolTransfer("kv", pages(2, 2), keys=["c", "d"])])["kv"])
        c.wait_committed()  # a later commit on a new socket: known again
        with daemon.client(NS) as other:
            assert other.batch_exists(["c", "d"]) == 2
