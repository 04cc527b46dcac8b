"""ops.status: the status page's ring of samples and its series (on made-up stats), then the
page and its data over real HTTP from a real daemon (the browser test: test_status_browser.py)."""

import base64
import hashlib
import json
import re
import time

import pytest
from admin_helpers import admin_daemon, http
from pools import kv_pool, pages

from hicached import PoolTransfer
from hicached.errors import ConfigError
from hicached.ops import status as S
from hicached.daemon.config import load_config
from hicached.daemon.metrics import OPS


def made_stats(hits=0, misses=0, moved=0, used=0, orphans=0, namespaces=(), degraded=False):
    """A ``/stats`` answer with the fields the ring reads (``metrics.stats_json``'s shape)."""
    return {
        "status": "serving", "requests": 0, "sessions": 1,
        "tiers": {
            "l2": {"pages": 0, "used_bytes": used, "capacity_bytes": 1 << 20, "hits": hits,
                   "misses": misses, "evictions": 0, "no_space": 0, "eviction": "hybrid",
                   "orphan_bytes": orphans, "leases": 0, "reservations": 0,
                   "expired_leases": 0, "parked_gets": 0, "parked_exists": 0},
            "l3": {"backend": "file", "attached": True, "write_policy": "write_through",
                   "degraded": degraded, "dirty_pages": 0, "loading_pages": 0,
                   "jobs_in_flight": 0, "l3_errors": 0, "backend_stats": {
                       "integrity_failures": 0}},
        },
        "pools": {"kv": {"l2_hits": hits, "l2_misses": misses, "l3_hits": 0, "l3_misses": 0},
                  "mamba": {"l2_hits": 0, "l2_misses": 0, "l3_hits": 0, "l3_misses": 0}},
        "bytes_moved": {"client_to_l2": moved, "l2_to_client": 0},
        "namespaces": [{"namespace": n, "used_bytes": u, "sessions": 1, "quota_bytes": q,
                        "evictions": 0, "rejections": 0} for n, u, q in namespaces],
    }


def series(view: dict, chart: str) -> dict:
    return {s["name"]: s for s in next(c for c in view["charts"] if c["id"] == chart)["series"]}


def test_rates_hit_rates_levels_and_limits_between_samples():
    ring = S.StatusRing(interval_s=2.0)
    ring.add(100.0, made_stats(namespaces=[("a", 0, 4096)]), [], 0.001, True)
    ring.add(102.0, made_stats(hits=30, misses=10, moved=4000, used=2048,
                               namespaces=[("a", 2048, 4096), ("b", 1024, None)]), [], 0.001, True)
    ring.add(104.0, made_stats(hits=30, misses=30, moved=4000, used=3072,
                               namespaces=[("a", 3072, 4096)]), [], 0.001, True)
    v = ring.derive()
    assert v["t"] == [100.0, 102.0, 104.0] and v["window_s"] == 600.0
    assert v["stats"]["tiers"]["l2"]["used_bytes"] == 3072  # the latest /stats answer
    rate = series(v, "hit-rate")
    assert list(rate) == ["L2 kv"]  # pools and tiers asked for nothing are left out
    assert rate["L2 kv"]["values"] == [None, 75.0, 0.0]
    assert (rate["L2 kv"]["hits"], rate["L2 kv"]["misses"], rate["L2 kv"]["window_pct"]) == (
        30, 30, 50.0)
    served = series(v, "served")["L2 kv"]
    assert (served["values"], served["total"], served["window"]) == ([None, 15.0, 0.0], 30, 30)
    assert series(v, "bytes-moved")["client to l2"]["values"] == [None, 2000.0, 0.0]
    ns = next(c for c in v["charts"] if c["id"] == "namespaces")
    assert {s["name"]: s["values"] for s in ns["series"]} == {
        "a": [0, 2048, 3072], "b": [None, 1024, None]}  # a namespace that went: a gap
    assert ns["limits"] == [{"name": "quota a", "value": 4096, "of": "a"}]
    l2 = next(c for c in v["charts"] if c["id"] == "l2")
    assert l2["limits"][0]["value"] == 1 << 20 and series(v, "l2")["used"]["last"] == 3072


def test_the_ring_is_bounded_and_its_view_derived_once_per_sample():
    ring = S.StatusRing(interval_s=1.0, size=3)
    for i in range(5):
        ring.add(float(i), made_stats(hits=10 * i, misses=10 * i), [], 0.0, True)
    v = ring.derive()
    assert v["t"] == [2.0, 3.0, 4.0] and v["window_s"] == 3.0
    served = series(v, "served")["L2 kv"]
    assert (served["total"], served["window"]) == (40, 20)  # window: what the ring still spans
    body = ring.view()
    assert ring.view() is body  # no new sample: the same bytes
    ring.add(5.0, made_stats(hits=50, misses=50), [], 0.0, True)
    assert json.loads(ring.view())["t"] == [3.0, 4.0, 5.0]


def test_an_orphan_count_not_taken_carries_the_last_one():
    ring = S.StatusRing(interval_s=1.0)
    ring.add(1.0, made_stats(orphans=512), [], 0.0, True)
    later = made_stats(orphans=None)  # not counted on this sample
    ring.add(2.0, later, [], 0.0, False)
    v = ring.derive()
    assert v["stats"]["tiers"]["l2"]["orphan_bytes"] == 512 and v["orphans_at"] == 1.0
    assert series(v, "l2")["orphans (no hit can use)"]["values"] == [512, 512]


def test_slowest_calls_degraded_band_and_namespace_cap(monkeypatch):
    monkeypatch.setattr(S, "MAX_NAMESPACES", 2)
    ring = S.StatusRing(interval_s=1.0)
    slow1 = [{"op": "lease", "outcome": "ok", "ms": 30.0, "t": 1.0},
             {"op": "reserve", "outcome": "ok", "ms": 2.0, "t": 1.0}]
    slow2 = [{"op": "lease", "outcome": "busy", "ms": 50.0, "t": 2.0}]
    many = [("big", 900, None), ("small", 10, None), ("mid", 500, 1000)]
    ring.add(1.0, made_stats(namespaces=many), slow1, 0.0, True)
    ring.add(2.0, made_stats(degraded=True), slow2, 0.0, True)
    v = ring.derive()
    assert [(c["op"], c["ms"]) for c in v["slowest"]] == [
        ("lease", 50.0), ("lease", 30.0), ("reserve", 2.0)]
    lat = series(v, "latency")
    assert lat["lease"]["values"] == [30.0, 50.0] and lat["reserve"]["values"] == [2.0, None]
    assert series(v, "l3-queue")["degraded"] == {"name": "degraded", "values": [0, 1],
                                                 "last": 1, "band": True}
    assert set(series(v, "namespaces")) == {"big", "mid"}  # the largest MAX_NAMESPACES


def test_status_sample_s_is_checked(tmp_path):
    assert load_config(None, {}, {"state_dir": str(tmp_path)}).status_sample_s == 2.0
    with pytest.raises(ConfigError, match="status_sample_s"):
        load_config(None, {}, {"state_dir": str(tmp_path), "status_sample_s": 0})


def test_page_and_its_data_over_http(make_daemon):
    d, url = admin_daemon(make_daemon, key="", extra=["--status-sample-s", "0.1"])
    status, page = http("GET", url + "/")
    assert status == 200 and page.startswith("<!doctype html>") and "status.json" in page
    body, headers = S.status_page()
    assert body.decode() == page
    script = re.search(r"<script>(.*?)</script>", page, re.DOTALL).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in headers["Content-Security-Policy"]
    assert "connect-src 'self'" in headers["Content-Security-Policy"]
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere
    keys = [f"secret-key-{i}" for i in range(4)]
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=keys)])["kv"] == [True] * 4
        c.ping()
        assert c.batch_get_v1(keys + ["absent"], pages(4, 5)) == [True] * 4 + [False]
        c.ping()
        deadline = time.monotonic() + 20
        while True:  # until a sample has seen the get
            status, v = http("GET", url + "/status.json")
            assert status == 200
            rate = series(v, "hit-rate") if v["charts"] else {}
            if "L2 kv" in rate and rate["L2 kv"]["hits"] == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        _, stats = http("GET", url + "/stats")
    assert rate["L2 kv"]["misses"] == 1 and v["interval_s"] == 0.1
    assert len(v["t"]) >= 2 and v["t"] == sorted(v["t"])
    for k in ("pools", "bytes_moved", "namespaces"):
        assert v["stats"][k] == stats[k], k  # no traffic since: the sample is /stats now
    assert v["slowest"] and {c["op"] for c in v["slowest"]} <= set(OPS.values())
    raw = json.dumps(v)
    assert not any(k in raw for k in keys)  # never keys (nor page bytes)
    n = len(v["t"])
    time.sleep(0.5)
    assert len(http("GET", url + "/status.json")[1]["t"]) > n  # it keeps sampling

