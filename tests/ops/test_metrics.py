"""daemon.metrics.Metrics on its own (no daemon): what it keeps of requests parked for L3."""

import time
from types import SimpleNamespace

from hicached import protocol as P
from hicached.daemon import metrics as M


def test_a_parked_request_keeps_only_its_start_and_is_timed_when_answered(monkeypatch):
    m = M.Metrics(daemon=None)
    t0 = time.perf_counter()
    lookup = P.Exists(1, 7, ["a", "b"])
    m.on_request(lookup, None, t0)  # no answer yet: it waits for L3
    assert m._parked == {id(lookup): t0}
    assert m.requests == {}
    m.on_parked_answer(lookup, P.Error(1, "busy", "try again"))
    assert m._parked == {} and m.requests == {("exists", "busy"): 1}
    m.on_parked_answer(lookup, P.Error(1, "busy", "again"))  # not parked (any more): ignored
    assert m.requests == {("exists", "busy"): 1}

    monkeypatch.setattr(M, "MAX_PARKED", 2)  # the oldest are forgotten past the bound
    parked = [P.Exists(i, 7, ["k"]) for i in range(3)]
    for i, msg in enumerate(parked):
        m.on_request(msg, None, float(i))
    assert list(m._parked.items()) == [(id(parked[1]), 1.0), (id(parked[2]), 2.0)]


def test_the_slowest_calls_are_kept_until_taken(monkeypatch):
    monkeypatch.setattr(M, "SLOW_KEPT", 3)
    # the metrics' clock stands still while they are answered: on a loaded machine a moment
    # between reading the clock here and there made a 9 ms call 10 ms
    now = time.perf_counter()
    monkeypatch.setattr(M, "time", SimpleNamespace(perf_counter=lambda: now, time=time.time))
    m = M.Metrics(daemon=None)
    for ms in (5, 1, 9, 2, 7, 3):  # answered now, read `ms` milliseconds ago
        m._finish("lease", "ok" if ms != 9 else "busy", now - ms / 1e3)
    taken = m.take_slow()
    assert [(c["op"], c["outcome"], round(c["ms"])) for c in taken] == [
        ("lease", "busy", 9), ("lease", "ok", 7), ("lease", "ok", 5)]
    assert all(abs(c["t"] - time.time()) < 60 for c in taken)  # when answered, unix time
    assert m.take_slow() == [] and m._slow_floor == 0.0  # the next round starts empty
    m._finish("reserve", "ok", now - 1e-6)
    assert [c["op"] for c in m.take_slow()] == ["reserve"]
    assert M.NullMetrics().take_slow() == []
