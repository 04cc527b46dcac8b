"""The plugins' back-off and its end when the daemon is back (``hicached/plugin/backoff.py``).

A daemon restart (a crash and ``Restart=on-failure``, a ``systemctl restart``, a warm restart)
must not cost an engine its hits for the rest of a back-off grown to many seconds: once the new
daemon is ready, the engine's next calls reach it (issue 49: within 1 s of ready).
"""

import signal
import socket
import time

import dataclasses

import pytest
import torch
from conftest import sigstop
from sglang_env import PAGE, fill_random, idx, keys_of, kv_bytes, kv_pool

from hicached import HostPool
from hicached.daemon.config import DaemonConfig

from hicached.plugin.backoff import MAX_BACKOFF_S, RetryClock, socket_ident
from hicached.plugin.health import PluginHealth
from hicached.plugin.namespace import RankNamespace
from hicached.plugin.sessions import RankSessions
from hicached.plugin.settings import PluginSettings


def listening(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(8)
    return s


def test_backoff_doubles_up_to_the_cap_on_time_alone_for_tcp():
    clock = RetryClock("tcp://127.0.0.1:1", 4.0)
    waits = []
    for _ in range(5):
        clock.failed(now=100.0)
        waits.append(clock.wait_s(now=100.0))
    assert waits == [4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert clock.wait_s(now=100.0 + MAX_BACKOFF_S) == 0.0
    clock.succeeded()
    assert clock.wait_s(now=100.0) == 0.0
    clock.failed(now=200.0)
    assert clock.wait_s(now=201.0) == 3.0  # back to the first interval


def test_the_same_socket_file_keeps_backing_off_a_new_one_ends_it(tmp_path):
    path = tmp_path / "d.sock"
    old = listening(path)  # a hung daemon: its socket accepts, but calls time out
    clock = RetryClock(f"ipc://{path}", 10.0)
    clock.failed(now=0.0)
    assert clock.wait_s(now=1.0) == 9.0  # the same file: no retry, however often asked
    old.close()  # it died: the file stays, nobody listens
    assert clock.wait_s(now=2.0) == 8.0
    path.unlink()
    assert clock.wait_s(now=3.0) == 7.0  # no file: nobody to try
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(str(path))  # a new daemon's file, not yet listening: asked again next call
    assert clock.wait_s(now=4.0) == 6.0
    bound.listen(8)  # it listens: this call tries
    assert clock.wait_s(now=5.0) == 0.0
    clock.failed(now=6.0)  # and fails (say, not answering yet): that file is noted
    assert clock.wait_s(now=7.0) == 19.0
    bound.close()


def test_socket_ident_tells_a_new_file_from_the_old_one(tmp_path):
    path = tmp_path / "d.sock"
    assert socket_ident(str(path)) is None
    s = listening(path)
    first = socket_ident(str(path))
    s.close()
    path.unlink()
    s = listening(path)  # (the filesystem may give the same inode number: the ctime differs)
    assert socket_ident(str(path)) not in (None, first)
    s.close()


def call_until(fn, ok, deadline_s: float):
    """``fn()`` until ``ok(result)`` or ``deadline_s`` passed; (result, seconds taken)."""
    start = time.monotonic()
    while True:
        result = fn()
        if ok(result) or time.monotonic() - start > deadline_s:
            return result, time.monotonic() - start
        time.sleep(0.01)


def test_sglang_plugin_hits_within_a_second_of_a_restarted_daemons_ready(sg, plugin,
                                                                         make_daemon):
    """The daemon is SIGKILLed under an engine; its calls miss with a back-off of 8 s (as one
    grown after a few failures); a new daemon starts on the same endpoint: the engine's calls
    reach it within 1 s of its ready, not 8 s later."""
    d = make_daemon(name="restarts")
    keys = keys_of("rs-", 4)
    b = plugin(d.endpoint, {"kv": kv_pool(seed=40)},
               extra={"timeout_s": 2.0, "retry_interval_s": 8.0})
    assert b.batch_set_v1(keys, idx(0, 4)) == [True] * 4
    d.stop(signal.SIGKILL)  # its socket file stays behind
    assert b.batch_get_v1(keys, idx(0, 4)) == [False] * 4  # found gone: a miss, back-off on
    t = time.monotonic()
    assert [b.batch_exists(keys) for _ in range(20)] == [0] * 20  # misses at once
    assert time.monotonic() - t < 1.0
    assert b._sessions.backing_off_s > 5.0
    d.start()  # returns once the new daemon answers a client: its ready, observed
    ready = time.monotonic()
    written, _ = call_until(lambda: b.batch_set_v1(keys, idx(0, 4)), lambda r: all(r), 1.0)
    assert written == [True] * 4 and time.monotonic() - ready < 1.0
    assert b.batch_exists(keys) == 4
    counters = b.get_stats().counters
    assert counters["episodes"] == 1 and counters["errors"] == 0


def test_sglang_plugin_hits_adopted_pages_within_a_second_of_a_warm_restart(sg, plugin,
                                                                            make_daemon):
    """A warm restart (``on_stop = "keep"``: the next daemon adopts the arena): the engine's
    exists and gets hit the pages it wrote before, within 1 s of the new daemon's ready, with
    their bytes; nothing is written again."""
    if "on_stop" not in {f.name for f in dataclasses.fields(DaemonConfig)}:
        pytest.skip("needs the daemon's warm restart (on_stop)")
    d = make_daemon(name="warm", extra=["--on-stop", "keep", "--l3-backend", "none"])
    pool = fill_random(HostPool.allocate_mha(16, PAGE, layers=4, heads=4, head_dim=16,
                                             layout="page_first", dtype=torch.float32), 41)
    keys = keys_of("warm-", 4)  # 8 KiB pages: journaled (the daemon keeps pages >= 4 KiB)
    b = plugin(d.endpoint, {"kv": pool}, extra={"timeout_s": 2.0, "retry_interval_s": 8.0})
    assert b.batch_set_v1(keys, idx(0, 4)) == [True] * 4
    b.client().wait_committed()
    assert d.stop(signal.SIGTERM) == 0  # kept
    assert b.batch_exists(keys) == 0 and b._sessions.backing_off_s > 5.0
    d.start()
    ready = time.monotonic()
    hits, _ = call_until(lambda: b.batch_exists(keys), lambda n: n == 4, 1.0)
    assert hits == 4 and time.monotonic() - ready < 1.0, d.output()
    assert b.batch_get_v1(keys, idx(8, 4)) == [True] * 4
    assert torch.equal(kv_bytes(pool, 8, 4), kv_bytes(pool, 0, 4))


def test_vllm_sessions_reach_a_restarted_daemon_within_a_second(make_daemon):
    """The vLLM connector's sessions (``RankSessions`` with a fixed namespace, as
    ``plugin/vllm.py`` makes them): the same restart, SIGTERM this time."""
    d = make_daemon(name="vllm-restarts")
    settings = PluginSettings(endpoint=d.endpoint, timeout_s=2.0, retry_interval_s=8.0)
    sessions = RankSessions(settings, None, "hicached-vllm worker",
                            PluginHealth("hicached-vllm worker", record_metrics=False),
                            namespace=RankNamespace("vllm-ns", "", False, True),
                            event_hash="vllm_bytes")

    def ping() -> bool:
        return sessions.guard("ping", lambda: False, lambda c: c.ping() or True)

    try:
        assert ping()
        assert d.stop(signal.SIGTERM) == 0  # a clean stop: its socket file is gone
        assert not ping() and sessions.backing_off_s > 5.0
        d.start()
        ready = time.monotonic()
        reached, _ = call_until(ping, bool, 1.0)
        assert reached and time.monotonic() - ready < 1.0
    finally:
        sessions.close()


def test_a_hung_daemon_is_not_retried_before_its_backoff(make_daemon):
    """A daemon that stops answering (SIGSTOP) keeps its socket file: calls keep missing at
    once for the whole back-off, they do not try it (each would wait its timeout)."""
    interval_s = 0.5
    d = make_daemon(name="hung")
    settings = PluginSettings(endpoint=d.endpoint, timeout_s=0.5, retry_interval_s=interval_s)
    health = PluginHealth("hung", record_metrics=False)
    sessions = RankSessions(settings, None, "hung", health,
                            namespace=RankNamespace("hung-ns", "", False, True))
    tried = []

    def ping() -> bool:
        def call(c):
            tried.append(1)
            return c.ping() or True
        return sessions.guard("ping", lambda: False, call)

    try:
        assert ping()
        sigstop(d.proc.pid)
        try:
            assert not ping()  # timed out: back off
            t = time.monotonic()
            while time.monotonic() - t < interval_s * 0.8:
                assert not ping()
                time.sleep(0.01)
            assert len(tried) == 2  # the first call and the one that timed out
        finally:
            d.proc.send_signal(signal.SIGCONT)
        reached, _ = call_until(ping, bool, 5.0)  # after its back-off it is tried again
        assert reached
    finally:
        sessions.close()
