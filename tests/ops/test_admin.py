"""The admin HTTP API over real HTTP against real daemons: SGLang's admin endpoints and key
rule, attach / detach / status with the file backend while a client works, flush tiers,
/health, /ready, /stats and /metrics."""

import os
import threading

import torch
from admin_helpers import KEY, admin_daemon, http, sample, scrape
from conftest import wait_until
from pools import kv_pool, kv_tokens, pages

from hicached import PoolTransfer
from hicached import protocol as P

MUTATING = [("PUT", "/hicache/storage-backend", {"hicache_storage_backend": "file"}),
            ("DELETE", "/hicache/storage-backend", None),
            ("GET", "/hicache/storage-backend", None),
            ("POST", "/hicache/storage-backend/clear", None),
            ("POST", "/flush_cache", None),
            ("GET", "/flush_cache", None)]


def test_admin_key_rules_and_key_never_logged(make_daemon):
    d, url = admin_daemon(make_daemon, extra=["--log-level", "debug"])
    for method, path, body in MUTATING:
        status, ans = http(method, url + path, body)
        assert status == 401 and ans["code"] == "unauthorized", (method, path)
        status, ans = http(method, url + path, body, key="wrong-key")
        assert status == 401, (method, path)
        status, ans = http(method, url + path, body, headers={"Authorization": KEY})
        assert status == 401, (method, path)  # the key without "Bearer "
    status, ans = http("GET", url + "/hicache/storage-backend", key=KEY)
    assert status == 200 and ans["hicache_storage_backend"] == "file"
    status, ans = http("GET", url + "/hicache/storage-backend",
                       headers={"Authorization": f"bearer {KEY}"})
    assert status == 200  # the scheme's case does not matter (RFC 7235)
    status, ans = http("GET", url + "/no/such/path")
    assert status == 404 and ans["code"] == "not_found"  # JSON, as every other error
    status, ans = http("PATCH", url + "/hicache/storage-backend", key=KEY)
    assert status == 405 and ans["code"] == "method_not_allowed"
    status, ans = http("POST", url + "/flush_cache", key=KEY)
    assert status == 200 and ans["tier"] == "l2"
    for path in ("/health", "/ready", "/stats", "/metrics"):  # read-only: open
        assert http("GET", url + path)[0] == 200, path
    assert d.stop() == 0
    assert KEY not in d.output()
    assert "admin: flush l2 from 127.0.0.1" in d.output()  # acting calls are logged, keyless


def test_mutating_endpoints_refused_without_a_configured_key(make_daemon):
    _d, url = admin_daemon(make_daemon, key="")
    for method, path, body in MUTATING:
        status, ans = http(method, url + path, body, key="anything")
        assert status == 400, (method, path)
        assert "--admin-api-key" in ans["error"] and ans["code"] == "admin_api_key_missing"
    assert http("GET", url + "/health") == (200, {"status": "ok"})


def _write(c, keys, src_page=0):
    got = c.batch_set_v2([PoolTransfer("kv", pages(src_page, len(keys)), keys=keys)])["kv"]
    c.ping()  # the commit is fire-and-forget: land it before HTTP calls look at the daemon
    return got


def test_attach_detach_status_while_a_client_works(make_daemon, tmp_path):
    d, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    l3_dir = tmp_path / "attached-l3"
    status, st = http("GET", url + "/hicache/storage-backend", key=KEY)
    assert status == 200 and st["hicache_storage_backend"] is None and not st["attached"]
    stop = threading.Event()
    errors = []

    def traffic():  # a second client writing and reading through attach and detach
        try:
            with d.client() as c:
                src, dst = kv_pool(seed=7), kv_pool()
                c.register_mem_host_pool_v2(src, "kv")
                c.register_mem_host_pool_v2(dst, "kv")
                i = 0
                while not stop.is_set():
                    keys = [f"bg{i}-{j}" for j in range(4)]
                    assert _write(c, keys) == [True] * 4
                    assert c.batch_get_v1(keys, pages(8, 4)) == [True] * 4
                    i += 1
        except Exception as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        with d.client() as c:
            src = kv_pool(seed=3)
            c.register_mem_host_pool_v2(src, "kv")
            assert _write(c, ["before0", "before1"]) == [True, True]
            body = {"hicache_storage_backend": "file",
                    "hicache_storage_backend_extra_config_json":
                        f'{{"root": "{l3_dir}", "prefetch_threshold": 256}}',
                    "hicache_storage_prefetch_policy": "timeout",
                    "hicache_write_policy": "write_through"}
            status, st = http("PUT", url + "/hicache/storage-backend", body, key=KEY)
            assert status == 200, st
            assert st["hicache_storage_backend"] == "file" and st["attached"]
            assert st["hicache_storage_prefetch_policy"] == "timeout"
            assert st["engine_options"] == {"prefetch_threshold": 256}  # not a backend option
            # a different backend while one is attached: conflict
            status, ans = http("PUT", url + "/hicache/storage-backend",
                               {"hicache_storage_backend": "none"}, key=KEY)
            assert status == 409 and ans["code"] == "backend_conflict"
            # the same backend again: only the policies change
            status, st = http("PUT", url + "/hicache/storage-backend",
                              {"hicache_storage_backend": "file",
                               "hicache_write_policy": "write_back"}, key=KEY)
            assert status == 200 and st["hicache_write_policy"] == "write_back"
            http("PUT", url + "/hicache/storage-backend", {"hicache_storage_backend": "file",
                 "hicache_write_policy": "write_through"}, key=KEY)
            assert _write(c, ["after0", "after1"]) == [True, True]
            files = lambda: {f for _, _, fs in os.walk(l3_dir) for f in fs}
            assert wait_until(lambda: {"after0", "after1"} <= files())
            assert "before0" not in files()  # committed before the attach: not written through
            # flush L2 over HTTP: the pages come back from the attached L3
            status, ans = http("POST", url + "/flush_cache?tier=l2", key=KEY)
            assert status == 200 and ans["pages"] >= 4
            dst = kv_pool()
            c.register_mem_host_pool_v2(dst, "kv")
            assert c.batch_get_v1(["after0", "after1", "before0"], pages(0, 3)) == [
                True, True, False]
            assert torch.equal(kv_tokens(dst, 0, 2), kv_tokens(src, 0, 2))
            status, st = http("DELETE", url + "/hicache/storage-backend", key=KEY)
            assert status == 200 and st["hicache_storage_backend"] is None
            assert st["message"] == "HiCache storage backend detached."
            status, st = http("DELETE", url + "/hicache/storage-backend", key=KEY)
            assert status == 200 and st["message"].startswith("No HiCache")  # idempotent
            assert http("GET", url + "/hicache/storage-backend", key=KEY)[1][
                "hicache_write_policy"] == "write_through"  # policies persist across detach
            assert _write(c, ["detached0"]) == [True]  # L2 keeps serving
            assert c.batch_exists(["detached0"]) == 1
    finally:
        stop.set()
        t.join()
    assert not errors, errors


def test_attach_errors_map_to_statuses(make_daemon, tmp_path):
    _d, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    put = lambda body: http("PUT", url + "/hicache/storage-backend", body, key=KEY)
    status, ans = put({"hicache_storage_backend": "tape"})
    assert status == 400 and "tape" in ans["error"] and "file" in ans["error"]
    status, ans = put({"hicache_storage_backend": "file", "hicache_write_policy": "sometimes"})
    assert status == 400 and "hicache_write_policy" in ans["error"]
    status, ans = put({"hicache_storage_backend": "file",
                       "hicache_storage_prefetch_policy": "eager"})
    assert status == 400 and "hicache_storage_prefetch_policy" in ans["error"]
    status, ans = put({"hicache_storage_backend": "file",
                       "hicache_storage_backend_extra_config_json": "{not json"})
    assert status == 400 and "not valid JSON" in ans["error"]
    status, ans = put({"hicache_storage_backend": "file",
                       "hicache_storage_backend_extra_config_json": "@/etc/passwd"})
    assert status == 400 and "@file" in ans["error"]
    status, ans = put({"hicache_storage_backend": "file", "hicache_storage_backnd": "x"})
    assert status == 400 and "hicache_storage_backnd" in ans["error"]
    status, ans = put({"hicache_storage_backend": "file",
                       "hicache_storage_backend_extra_config_json": '{"colour": "red"}'})
    assert status == 400 and "colour" in ans["error"]  # the backend refuses the option
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    status, ans = put({"hicache_storage_backend": "file",
                       "hicache_storage_backend_extra_config_json":
                           f'{{"root": "{blocker}/l3"}}'})
    assert status in (400, 502) and ans["code"].startswith("backend")
    status, ans = http("POST", url + "/hicache/storage-backend/clear", key=KEY)
    assert status == 400 and "no L3 backend" in ans["error"]
    status, ans = http("POST", url + "/flush_cache?tier=l4", key=KEY)
    assert status == 400 and "l4" in ans["error"]
    assert http("GET", url + "/hicache/storage-backend", key=KEY)[1]["attached"] is False
    # attached: the same backend again changes policies only; other options are refused
    root = tmp_path / "l3a"
    cfg = f'{{"root": "{root}"}}'
    status, ans = put({"hicache_storage_backend": "file",
                       "hicache_storage_backend_extra_config_json": cfg})
    assert status == 200 and ans["attached"] and ans["hicache_write_policy"] == "write_through"
    status, ans = put({"hicache_storage_backend": "file", "hicache_write_policy": "write_back",
                       "hicache_storage_backend_extra_config_json": cfg})
    assert status == 200 and ans["hicache_write_policy"] == "write_back"
    status, ans = put({"hicache_storage_backend": "file", "hicache_write_policy": "write_back",
                       "hicache_storage_backend_extra_config_json":
                           f'{{"root": "{tmp_path / "l3b"}"}}'})
    assert status == 409 and "root" in ans["error"] and "detach" in ans["error"]
    status, ans = http("GET", url + "/hicache/storage-backend", key=KEY)
    assert ans["hicache_storage_backend_extra_config"] == cfg  # the record is unchanged
    status, ans = put({"hicache_storage_backend": "file", "hicache_write_policy": "write_through"})
    assert status == 200 and ans["hicache_write_policy"] == "write_through"  # no options: kept
    assert ans["hicache_storage_backend_extra_config"] == cfg
    # a mistyped name while one is attached: 400 naming the valid ones (was 409 "detach it
    # first", and after the detach a 400 anyway); the attached backend stays
    status, ans = put({"hicache_storage_backend": "mooncak"})
    assert (status, ans["code"]) == (400, "backend") and "unknown L3 backend 'mooncak'" in ans[
        "error"] and "mooncake" in ans["error"], ans
    assert http("GET", url + "/hicache/storage-backend", key=KEY)[1]["backend"] == "file"


def test_flush_tiers_and_clear(make_daemon):
    d, url = admin_daemon(make_daemon)
    with d.client() as c:
        src = kv_pool(seed=5)
        c.register_mem_host_pool_v2(src, "kv")
        keys = [f"f{i}" for i in range(6)]
        assert _write(c, keys) == [True] * 6
        assert wait_until(lambda: c.stats()["l3_writes"] == 6)
        status, ans = http("POST", url + "/flush_cache", key=KEY)  # default: L2 only
        assert status == 200 and ans == {"success": True, "tier": "l2", "pages": 6,
                                         "message": "Cache flushed: 6 pages dropped from L2."}
        assert c.stats()["l2_pages"] == 0
        l3_pages = lambda: http("GET", url + "/stats")[1]["tiers"]["l3"][
            "backend_stats"]["pages"]
        assert l3_pages() == 6  # L3 still has them
        status, ans = http("POST", url + "/hicache/storage-backend/clear", key=KEY)
        assert status == 200 and ans["tier"] == "l3" and ans["pages"] == 6
        assert l3_pages() == 0
        assert c.batch_exists(keys) == 0
        assert _write(c, keys) == [True] * 6
        assert wait_until(lambda: c.stats()["l3_writes"] == 12)  # written through again
        status, ans = http("GET", url + "/flush_cache?tier=all", key=KEY)
        assert status == 200 and ans["pages"] == 12  # 6 from L2 + 6 from L3
        assert c.batch_exists(keys) == 0 and c.stats()["l2_pages"] == 0
        status, ans = http("POST", url + "/clear_hicache_storage_backend", key=KEY)
        assert status == 200 and ans["pages"] == 0  # SGLang's deprecated alias


def test_health_ready_and_stats(make_daemon):
    d, url = admin_daemon(make_daemon)
    assert http("GET", url + "/health") == (200, {"status": "ok"})
    status, ready = http("GET", url + "/ready")
    assert status == 200 and ready["ready"] and ready["l3_backend"] == "file"
    assert ready["arena"] == d.cfg.arena_path and ready["arena_bytes"] == 16 * 1024**2
    with d.client() as c:
        src, dst = kv_pool(seed=9), kv_pool()
        c.register_mem_host_pool_v2(src, "kv")
        keys = [f"s{i}" for i in range(4)]
        assert _write(c, keys) == [True] * 4
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1([*keys, "nope"], pages(0, 5)) == [True] * 4 + [False]
        page_bytes = 2 * PAGE_TOKENS * 2 * 2 * 8 * 4
        status, st = http("GET", url + "/stats")
        assert status == 200 and st["status"] == "serving"
        l2 = st["tiers"]["l2"]
        assert l2["pages"] == 4 and l2["hits"] == 4 and l2["misses"] == 1
        assert l2["capacity_bytes"] == 16 * 1024**2 and l2["used_bytes"] == 4 * page_bytes
        assert st["pools"]["kv"] == {"l2_pages": 4, "l2_bytes": 4 * page_bytes, "l2_hits": 4,
                                     "l2_misses": 1, "l3_hits": 0, "l3_misses": 1}
        assert st["tiers"]["l3"]["backend"] == "file" and st["tiers"]["l3"]["l3_errors"] == 0
        assert st["bytes_moved"]["client_to_l2"] == 4 * page_bytes
        assert st["bytes_moved"]["l2_to_client"] == 4 * page_bytes
        assert st["sessions"] == 1


PAGE_TOKENS = 4


def test_pages_an_exists_prefetched_count_as_l3_hits(make_daemon):
    """SGLang's flow: exists (which starts pulling L3 pages into L2), then get. The pages the
    get reads were in L2 by then, but came from L3: L3 hits, and L2 hits only when read again."""
    d, url = admin_daemon(make_daemon)
    keys = [f"pf{i}" for i in range(4)]
    with d.client(release_delay_s=0) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=3), "kv")
        assert _write(c, keys) == [True] * 4
        assert wait_until(lambda: c.stats()["l3_writes"] == 4)
        c.flush("l2")
        assert c.batch_exists(keys) == 4
        assert wait_until(lambda: c.stats()["l2_pages"] == 4)  # prefetched
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        assert c.batch_get_v1(keys, pages(0, 4)) == [True] * 4
        assert c.batch_get_v1(keys[:2], pages(4, 2)) == [True] * 2  # from L2 now
    m = scrape(url)
    assert sample(m, "hicached_hits_total", tier="l3", pool="kv") == 4
    assert sample(m, "hicached_hits_total", tier="l2", pool="kv") == 2


def test_metrics_move_with_traffic(make_daemon):
    d, url = admin_daemon(make_daemon)
    before = scrape(url)
    assert sample(before, "hicached_up") == 1
    assert sample(before, "hicached_arena_bytes") == 16 * 1024**2
    assert sample(before, "hicached_l3_backend_info", backend="file",
                  write_policy="write_through") == 1
    with d.client(release_delay_s=0) as c:  # releases at once: the HTTP flush finds them
        src, dst = kv_pool(seed=1), kv_pool()
        c.register_mem_host_pool_v2(src, "kv")
        keys = [f"m{i}" for i in range(8)]
        assert _write(c, keys) == [True] * 8
        assert wait_until(lambda: c.stats()["l3_writes"] == 8)
        assert c.batch_exists([*keys, "x"]) == 8
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(keys[:4], pages(0, 4)) == [True] * 4
        http("POST", url + "/flush_cache", key=KEY)
        assert c.batch_get_v1([*keys[4:], "gone"], pages(0, 5)) == [True] * 4 + [False]
    m = scrape(url)
    page_bytes = 2 * PAGE_TOKENS * 2 * 2 * 8 * 4
    assert sample(m, "hicached_requests_total", op="reserve", outcome="ok") == 1
    assert sample(m, "hicached_requests_total", op="lease", outcome="ok") == 2
    assert sample(m, "hicached_request_duration_seconds_count", op="exists") == 1
    assert sample(m, "hicached_request_duration_seconds_count", op="lease") == 2
    assert sample(m, "hicached_hits_total", tier="l2", pool="kv") == 4
    assert sample(m, "hicached_hits_total", tier="l3", pool="kv") == 4  # loaded after the flush
    assert sample(m, "hicached_misses_total", tier="l2", pool="kv") == 5
    assert sample(m, "hicached_misses_total", tier="l3", pool="kv") == 1
    assert sample(m, "hicached_exists_keys_total", pool="kv") == 9
    assert sample(m, "hicached_exists_hit_pages_total", pool="kv") == 8
    assert sample(m, "hicached_bytes_moved_total", direction="client_to_l2") == 8 * page_bytes
    assert sample(m, "hicached_bytes_moved_total", direction="l2_to_client") == 8 * page_bytes
    assert sample(m, "hicached_bytes_moved_total", direction="l2_to_l3") == 8 * page_bytes
    assert sample(m, "hicached_bytes_moved_total", direction="l3_to_l2") == 4 * page_bytes
    assert sample(m, "hicached_l3_writes_total") == 8 and sample(m, "hicached_l3_loads_total") == 4
    assert sample(m, "hicached_l2_pages", pool="kv") == 4
    assert sample(m, "hicached_arena_used_bytes") == 4 * page_bytes
    assert sample(m, "hicached_l3_store_pages") == 8  # the file L3's own accounts
    assert 8 * page_bytes < sample(m, "hicached_l3_store_bytes") \
        < sample(m, "hicached_l3_store_capacity_bytes")
    assert sample(m, "hicached_l3_store_evictions_total") == 0
    assert sample(m, "hicached_l2_flush_slabs_left") == 0
    assert sample(m, "hicached_presence_keys") == 4  # the 4 pages L2 holds, one key each
    assert sample(m, "hicached_presence_slots") >= 1 << 14
    assert sample(m, "hicached_presence_full") == 0
    for name in ("hicached_evictions_total", "hicached_expired_leases_total",
                 "hicached_expired_reservations_total", "hicached_l3_errors_total",
                 "hicached_l3_degraded", "hicached_draining", "hicached_l3_writing_bytes"):
        assert sample(m, name) == 0, name
    assert not any(name == "hicached_l3_writing_bytes_total" for name, _ in m)  # a level
    assert all(name.startswith("hicached_") for name, _ in m)
    assert wait_until(lambda: sample(scrape(url), "hicached_sessions") == 0)  # Bye applied


def test_admin_port_taken_is_a_clear_startup_error(make_daemon, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        try:
            make_daemon(name="clash", extra=["--admin-port", str(port)])
        except RuntimeError as e:
            assert "admin_port" in str(e) and str(port) in str(e)
        else:
            raise AssertionError("daemon started on a taken admin port")


def test_a_store_whose_writes_fail_is_degraded_and_not_ready(make_daemon, tmp_path):
    """Lookups may still answer while every write fails: /ready, the metric and the tier's
    status say the store fails, and say it no more once writes succeed again."""
    import json as _json
    opts = _json.dumps({"root": str(tmp_path / "l3"), "fail_puts": True})
    d, url = admin_daemon(make_daemon, extra=["--l3-backend", "l3_doubles:SlowFileBackend",
                                              "--l3-options", opts])
    assert http("GET", url + "/ready")[0] == 200
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(seed=2), "kv")
        assert c.batch_set_v1(["f0", "f1"], pages(0, 2)) == [True] * 2  # (in L2)
        assert wait_until(lambda: c.stats()["l3_write_failures"] == 2)
        status, ready = http("GET", url + "/ready")
        assert status == 503 and ready["reasons"] == ["L3 backend failing"]
        assert sample(scrape(url), "hicached_l3_degraded") == 1
        assert c.backend_status()["degraded"] is True
        # the same store, now writing: ready again (the policy-only re-attach keeps it)
        http("DELETE", url + "/hicache/storage-backend", key=KEY)
        c.attach_backend("l3_doubles:SlowFileBackend", {"root": str(tmp_path / "l3")})
        assert c.batch_set_v1(["f2"], pages(2, 1)) == [True]
        assert wait_until(lambda: c.stats()["l3_writes"] >= 1)
        assert http("GET", url + "/ready")[0] == 200
        assert sample(scrape(url), "hicached_l3_degraded") == 0
    assert "writes fail" in d.output()


def test_a_page_waited_for_while_another_client_wrote_it_is_no_l3_hit(make_daemon):
    """An L3 hit is a page loaded from an attached L3, nothing else: here no L3 is attached,
    and a get waits for a page another client reserved but had not committed yet."""
    d, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    with d.client() as writer, d.client(release_delay_s=0) as reader:
        writer.register_mem_host_pool_v2(kv_pool(seed=5), "kv")
        reader.register_mem_host_pool_v2(kv_pool(), "kv")
        res = writer._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", ["w0"])]))
        assert res.offsets[0][0] >= 0  # reserved, not committed: the reader's get waits
        got = []
        t = threading.Thread(target=lambda: got.append(reader.batch_get_v1(["w0"], pages(0, 1))))
        t.start()
        assert wait_until(lambda: sample(scrape(url), "hicached_parked_gets") == 1)
        writer._conn.call(lambda s, r: P.Commit(r, s, res.reservation_id, [[True]]))
        t.join(10)
        assert got == [[True]]
    m = scrape(url)
    assert sample(m, "hicached_hits_total", tier="l2", pool="kv") == 1
    assert m.get(("hicached_hits_total", frozenset({"tier": "l3", "pool": "kv"}.items())),
                 0) == 0  # (was 1: every page not in L2 when asked counted as an L3 hit)
    stats = http("GET", url + "/stats")[1]
    assert stats["tiers"]["l3"]["hits"] == 0 and stats["pools"]["kv"]["l3_hits"] == 0
