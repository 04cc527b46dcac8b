"""Store-call guards: deadlines on helper threads (no queueing behind a stuck call) and the
breaker's degrade / fast-miss / probe / recover cycle."""

import threading
import time

import pytest

from hicached.backends.guard import Breaker, CallerBusy, CallTimeout, DeadlineCaller


def test_deadline_caller_abandons_and_never_queues_behind_a_stuck_call():
    c = DeadlineCaller("t", max_threads=2)
    release = threading.Event()
    assert c.call(lambda x: x * 2, 21, timeout_s=5) == 42
    t = time.monotonic()
    with pytest.raises(CallTimeout, match="within 0.1 s"):
        c.call(release.wait, timeout_s=0.1)
    assert time.monotonic() - t < 2.0
    assert (c.abandoned_total, c.abandoned_running) == (1, 1)
    # the next call runs on the other helper at once
    assert c.call(lambda: "free", timeout_s=5) == "free"
    with pytest.raises(CallTimeout):
        c.call(release.wait, timeout_s=0.1)
    with pytest.raises(CallerBusy):  # both helpers stuck: refused, not queued
        c.call(lambda: 1, timeout_s=5)
    assert not c.wait_idle(0.05)
    release.set()
    assert c.wait_idle(5)
    assert (c.abandoned_total, c.abandoned_running) == (2, 0)
    assert c.call(lambda: "again", timeout_s=5) == "again"
    c.close()


def test_deadline_caller_reraises_the_call_error():
    c = DeadlineCaller("t")
    with pytest.raises(ZeroDivisionError):
        c.call(lambda: 1 / 0, timeout_s=5)
    assert c.call(lambda: 3, timeout_s=5) == 3
    c.close()


def test_breaker_degrades_backs_off_probes_and_recovers(caplog):
    now = [100.0]
    b = Breaker("store X", backoff_s=1.0, max_backoff_s=4.0, clock=lambda: now[0])
    assert b.admit() and b.admit()
    b.failed("RPC_FAIL")
    b.failed("RPC_FAIL")  # a concurrent failure of the same episode: not logged again
    assert [r.message for r in caplog.records].count(
        "store X unavailable: RPC_FAIL; answering misses (retrying every <= 4 s) until it "
        "recovers; further failures are only counted") == 1
    assert b.stats()["degraded"] and b.stats()["degraded_episodes"] == 1
    assert not b.admit()  # fast miss until the backoff passes (doubled to 2 s by the 2nd fail)
    now[0] += 2.0
    assert b.admit()  # the probe ...
    assert not b.admit()  # ... is the only caller let through
    b.failed("RPC_TIMEOUT")  # backoff doubles to 4 s (the maximum)
    now[0] += 3.9
    assert not b.admit()
    now[0] += 0.1
    assert b.admit()
    b.ok()
    st = b.stats()
    assert not st["degraded"] and st["fast_misses"] == 3 and st["failures"] == 3
    assert st["last_error"] == "RPC_TIMEOUT"
    assert any("store X recovered after 6.0 s" in r.message for r in caplog.records)
    b.failed("again")  # a new episode starts from the first backoff
    assert b.stats()["degraded_episodes"] == 2
    now[0] += 1.0
    assert b.admit()
