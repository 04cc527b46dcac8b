"""The status page in a real browser (headless chromium, ``browser.py``; skipped, saying why,
where there is none): loaded from a real daemon while clients work, then once they stopped, its
charts, tiles and bars must hold the numbers ``/stats`` reports."""

import threading
import time

import torch
from admin_helpers import admin_daemon, http
from browser import Dom, chromium, dump_dom
from pools import kv_pool, mamba_pool, pages

from hicached import PoolHitPolicy, PoolTransfer

TRAILING = PoolHitPolicy.TRAILING_PAGES
QUOTA = 48 << 10  # tenant-b's: 48 of its 1 KiB pages, fewer than it writes


def workload(d, rounds: int, stopped: threading.Event, close: threading.Event, errors: list):
    """model-a: kv pages with a Mamba state, read back (L2 hits), and absent keys (misses);
    tenant-b: more than its quota (quota evictions), then its first pages again (from L3)."""
    try:
        with d.client("model-a") as a, d.client("tenant-b") as b:
            kv, ma, kv_b = kv_pool(seed=1), mamba_pool(seed=2), kv_pool(seed=3)
            a.register_mem_host_pool_v2(kv, "kv")
            a.register_mem_host_pool_v2(ma, "mamba")
            b.register_mem_host_pool_v2(kv_b, "kv")
            for i in range(rounds):
                keys = [f"secret-a{i}-{j}" for j in range(4)]
                assert a.batch_set_v2([
                    PoolTransfer("kv", pages(0, 4), keys=keys),
                    PoolTransfer("mamba", torch.tensor([1]), keys=keys[-1:],
                                 hit_policy=TRAILING)])["kv"] == [True] * 4
                a.ping()
                got = a.batch_get_v2([
                    PoolTransfer("kv", pages(4, 4), keys=keys),
                    PoolTransfer("mamba", torch.tensor([2]), keys=keys[-1:],
                                 hit_policy=TRAILING)])
                assert got["kv"] == [True] * 4, got
                assert a.batch_get_v1([f"secret-absent{i}"], pages(8, 1)) == [False]
                b.batch_set_v2([PoolTransfer("kv", pages(0, 8),
                                             keys=[f"secret-b{i}-{j}" for j in range(8)])])
                b.ping()
                time.sleep(0.05)  # several samples over the run
            b.batch_get_v1([f"secret-b0-{j}" for j in range(8)], pages(8, 8))  # from L3
            stopped.set()
            close.wait(60)  # the sessions stay open while the page is checked
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
        stopped.set()


def settled(url: str) -> tuple[dict, dict]:
    """(/stats, /status.json) once the latest sample is /stats (no traffic, L3 writes done)."""
    deadline = time.monotonic() + 20
    while True:
        _, stats = http("GET", url + "/stats")
        _, view = http("GET", url + "/status.json")
        s, l3 = view["stats"], stats["tiers"]["l3"]
        same = all(s[k] == stats[k] for k in ("pools", "bytes_moved", "namespaces", "sessions"))
        same = same and all(s["tiers"]["l2"][k] == stats["tiers"]["l2"][k] for k in (
            "used_bytes", "pages", "evictions", "no_space", "leases", "orphan_bytes"))
        if same and s["tiers"]["l3"] == l3 and not l3["jobs_in_flight"] + l3["dirty_pages"]:
            return stats, view
        assert time.monotonic() < deadline, (stats, view["stats"])
        time.sleep(0.1)


def test_the_charts_hold_what_stats_reports(make_daemon):
    chromium()  # skips here, saying why, without a browser
    d, url = admin_daemon(make_daemon, key="", extra=[
        "--status-sample-s", "0.2", "--namespace-quotas", f'{{"tenant-b": {QUOTA}}}'])
    stopped, close, errors = threading.Event(), threading.Event(), []
    t = threading.Thread(target=workload, args=(d, 24, stopped, close, errors))
    t.start()
    try:
        time.sleep(1.0)
        busy = Dom(dump_dom(url + "/"))  # while the clients work
        assert stopped.wait(60) and not errors, errors
        stats, view = settled(url)
        page = dump_dom(url + "/")
        assert http("GET", url + "/stats")[1] == stats  # nothing moved while the page loaded
    finally:
        close.set()
        t.join(30)
    assert int(busy.body["data-rendered"]) >= 1 and int(busy.body["data-samples"]) > 1
    assert busy.by_id("state")["data-status"] == "serving"
    assert busy.find("path", "line", "chart-hit-rate"), "no hit-rate line while clients work"
    assert "secret-" not in page  # never keys
    dom = Dom(page)
    assert int(dom.body["data-rendered"]) >= 1 and int(dom.body["data-samples"]) >= len(view["t"])
    check_page(dom, stats, view)


def check_page(dom: Dom, stats: dict, view: dict) -> None:
    """Every number the page shows against ``/stats`` taken with nothing moving."""
    l2, l3 = stats["tiers"]["l2"], stats["tiers"]["l3"]
    store = l3["backend_stats"]
    assert dom.by_id("state")["data-status"] == stats["status"] == "serving"
    tiles = {"l2-used": l2["used_bytes"], "l2-capacity": l2["capacity_bytes"],
             "l2-pages": l2["pages"], "eviction": l2["eviction"],
             "orphan-bytes": l2["orphan_bytes"], "sessions": stats["sessions"],
             "leases": l2["leases"], "l3-backend": l3["backend"], "l3-health": "ok",
             "l3-dirty": l3["dirty_pages"], "l3-queue": l3["jobs_in_flight"],
             "integrity-failures": store["integrity_failures"], "l3-store": store["bytes"]}
    for key, want in tiles.items():
        assert dom.by_id(f"tile-{key}")["data-value"] == str(want), key
    assert stats["sessions"] == 2 and l2["eviction"] in ("hybrid", "prefix", "lru")

    ns = {a["data-namespace"]: a for a in dom.find("div", "ns")}
    assert set(ns) == {n["namespace"] for n in stats["namespaces"]} >= {"model-a", "tenant-b"}
    for n in stats["namespaces"]:
        row = ns[n["namespace"]]
        assert int(row["data-used-bytes"]) == n["used_bytes"] and int(
            row["data-sessions"]) == n["sessions"]
        assert row["data-quota-bytes"] == ("" if n["quota_bytes"] is None
                                           else str(n["quota_bytes"]))
    quota = next(n for n in stats["namespaces"] if n["namespace"] == "tenant-b")
    assert quota["quota_bytes"] == QUOTA and quota["evictions"] > 0  # the workload did it

    def legend(chart: str) -> dict:
        return {a["data-name"]: a for a in dom.find("li", "series", f"chart-{chart}")}

    def limits(chart: str) -> dict:
        return {a["data-name"]: float(a["data-value"])
                for a in dom.find("li", "limit", f"chart-{chart}")}

    # hit rates and pages served per tier and pool: the totals /stats counts, all in the window
    rate, served = legend("hit-rate"), legend("served")
    asked = {(t, p) for p, v in stats["pools"].items() for t in ("l2", "l3")
             if v[f"{t}_hits"] + v[f"{t}_misses"]}
    assert {("l2", "kv"), ("l2", "mamba"), ("l3", "kv")} <= asked
    assert set(rate) == set(served) == {f"{t.upper()} {p}" for t, p in asked}
    for t, p in asked:
        name, want = f"{t.upper()} {p}", stats["pools"][p]
        assert (int(rate[name]["data-hits"]), int(rate[name]["data-misses"])) == (
            want[f"{t}_hits"], want[f"{t}_misses"]), name
        assert int(served[name]["data-total"]) == int(served[name]["data-window"]) == want[
            f"{t}_hits"], name  # the ring spans the whole run: its sum of rates is the total
    assert stats["pools"]["kv"]["l3_hits"] > 0  # tenant-b's first pages came back from L3

    moved = legend("bytes-moved")
    assert {k: int(moved[k.replace("_", " ")]["data-total"]) for k in stats["bytes_moved"]} == (
        stats["bytes_moved"])
    ev = legend("evictions")
    assert int(ev["L2 evictions"]["data-total"]) == l2["evictions"]
    assert int(ev["no-space answers"]["data-total"]) == l2["no_space"]
    assert int(ev["quota evictions"]["data-total"]) == sum(
        n["evictions"] for n in stats["namespaces"]) > 0
    assert int(ev["quota rejections"]["data-total"]) == sum(
        n["rejections"] for n in stats["namespaces"])

    occ = legend("l2")
    assert float(occ["used"]["data-last"]) == l2["used_bytes"]
    assert float(occ["orphans (no hit can use)"]["data-last"]) == l2["orphan_bytes"]
    assert limits("l2") == {"capacity": l2["capacity_bytes"]}
    per_ns = legend("namespaces")
    for n in stats["namespaces"]:
        assert float(per_ns[n["namespace"]]["data-last"]) == n["used_bytes"]
    assert limits("namespaces") == {"quota tenant-b": QUOTA}

    queue = legend("l3-queue")
    assert float(queue["dirty pages"]["data-last"]) == l3["dirty_pages"]
    assert float(queue["write queue (jobs)"]["data-last"]) == l3["jobs_in_flight"]
    assert queue["degraded"]["data-last"] == "0" and queue["degraded"]["data-band"] == "true"
    fail = legend("l3-failures")
    assert int(fail["integrity failures"]["data-total"]) == store["integrity_failures"]
    assert int(fail["errors"]["data-total"]) == l3["l3_errors"]
    clients = legend("clients")
    assert float(clients["sessions"]["data-last"]) == stats["sessions"]
    assert float(clients["leases"]["data-last"]) == l2["leases"]

    # lines drawn: a point per sample where the series has a value (levels: every sample)
    samples = int(dom.body["data-samples"])
    for chart in ("l2", "clients"):
        for path in dom.find("path", "line", f"chart-{chart}"):
            assert int(path["data-points"]) == samples, (chart, path)
    lines = dom.find("path", "line", "chart-served")
    assert lines and all(int(p["data-points"]) > 5 for p in lines)
    # the slowest calls: the ring's, slowest first
    calls = dom.find("tr", "call")
    assert calls and [float(c["data-ms"]) for c in calls] == sorted(
        (float(c["data-ms"]) for c in calls), reverse=True)
    assert {c["data-op"] for c in calls} <= {c["op"] for c in view["slowest"]}
    assert legend("latency")  # a line per op among them
