"""The benchmarks under tools/ still run end to end (tiny runs: their figures are not checked
here, only that they measure what they say and that the bytes they move are right)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent.parent / "tools"


def _run(*argv: str, env: dict | None = None, timeout: int = 100) -> dict:
    proc = subprocess.run([sys.executable, str(TOOLS / argv[0]), *argv[1:], "--json"],
                          check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_bench_l2_measures_both_paths_against_the_same_bytes():
    r = _run("bench_l2.py", "--reps", "2", "--exists-samples", "5", "--threads", "1",
             "--l2-size", "256MiB")
    assert r["bytes_per_call"] == 64 << 20
    (one,) = r["copies"]  # --threads 1: only the one-thread run
    assert one["torch_threads"] == 1
    for key in ("set_gbps", "get_gbps", "memcpy_rotating_gbps", "memcpy_same_bytes_gbps",
                "memcpy_private_fixed_gbps"):
        assert one[key]["median"] > 0 and one[key]["best"] >= one[key]["median"], key
    assert one["set_over_memcpy"] > 0 and one["get_over_memcpy"] > 0
    assert r["exists_1024x3"]["from_table"] is True  # x86: answered from the presence table
    assert r["exists_1024x3_socket"]["from_table"] is False
    assert 0 < r["exists_1024x3"]["p50_ms"] <= r["exists_1024x3"]["p99_ms"]


def test_bench_l3_3fs_section_reads_back_what_it_wrote(tmp_path):
    r = _run("bench_l3.py", "--section", "3fs", "--reps", "1",
             env={"HICACHED_BENCH_3FS_DIR": str(tmp_path)})["3fs"]
    assert r["io"] == "posix" and r["n_pages"] == 256 and r["verify_failures"] == 0
    assert r["plain_preadv_gbps"]["median"] > 0 and r["hf3fs_get_gbps"]["median"] > 0


def test_bench_l3_checksum_section_compares_daemons_with_and_without():
    r = _run("bench_l3.py", "--section", "checksum", "--reps", "1", "--stores", "file",
             timeout=180)["checksum"]
    assert r["hash_gbps"]["cold"] > 0 and r["hash_gbps"]["in_cache"] > 0
    f = r["file"]
    assert set(f) >= {"get_on", "get_off", "write_on", "write_off", "get_on_over_off",
                      "get_paired", "write_paired"}
    assert f["get_on"]["median"] > 0 and f["write_off"]["median"] > 0 and "mooncake" not in r
    assert f["get_paired"] > 0 and f["write_paired"] > 0
    assert 0 < f["write_busy_off"] <= 1 and 0 < f["get_busy_off"] <= 1  # the CPUs, unchecked


def test_bench_index_tiny_run_prints_every_row_side_by_side(capsys):
    r = _run("bench_index.py", "--small", "--clients", "1", "--seconds", "1", timeout=60)
    (one,) = r["trees"]  # no --baseline: the current tree only
    assert one["tree"] == str(TOOLS.parent) and one["pages"] == 2000 and one["first"] == 1000
    for at in ("exists_first", "exists_full"):
        for path in ("table", "socket"):
            assert 0 < one[at][path]["p50_ms"] <= one[at][path]["p99_ms"], (at, path)
        assert one[at]["from_table"] is True  # x86, and 2k keys fit the default table
    assert one["presence_full"]["keys"] == 2000 and one["presence_full"]["full"] is False
    assert one["rss_before"] > 0 and one["set"]["pages_per_s"] > 0 and one["get"]["gbps"] > 0
    mixed = one["mixed"]
    assert mixed["clients"] == 1 and mixed["ops_per_s"] > 0 and mixed["get_hit_share"] == 1.0
    assert all(mixed[kind]["count"] > 0 for kind in ("exists", "get", "set"))
    # the side-by-side table, as --baseline prints it (this run twice: every ratio numeric is 1)
    spec = importlib.util.spec_from_file_location("bench_index", TOOLS / "bench_index.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.print_table([one, one])
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("metric"))
    assert out[head].split() == ["metric", "current", "baseline1", "ratio"]
    rows = {name: cells for name, *cells in (re.split(r"\s{2,}", line.strip())
                                             for line in out[head + 1:])}
    for name in ("exists p50 via table @1k (ms)", "exists p99 via socket @2k (ms)",
                 "heap bytes / indexed page (target <= 250)", "set 1k->2k (k pages/s)",
                 "get 64 pages @2k (k pages/s)", "mixed, 1 clients: ops/s", "get p99 (ms)"):
        assert rows[name][-1] == "1.00", (name, rows[name])
    assert rows["presence table @2k: keys / slots, full"][-1] == "-"


def test_bench_hybrid_cache_tiny_run_replays_the_trace_per_budget(capsys, monkeypatch):
    r = _run("bench_hybrid_cache.py", "--small", "--policies", "lru", timeout=120)
    trace = r["trace"]
    assert trace["requests"] == 120 and trace["warmup_requests"] == 12
    assert trace["working_set_bytes"] == (trace["stored_kv_pages"] * 16384
                                          + trace["stored_states"] * 32 * 16384)
    runs = {(x["budget"], x["policy"]): x for x in r["runs"]}
    assert set(runs) == {(0.1, "lru"), (0.25, "lru"), (None, "lru")}
    top = runs[None, "lru"]  # nothing evicted: the hit rate worked out offline, exactly
    assert top["evictions"] == 0 and top["hit_rate"] == trace["ceiling_hit_rate"]
    assert top["orphans_client"]["max"] == 0 and top["dead_kv"]["max"] == 0
    assert 0 < runs[0.1, "lru"]["hit_rate"] < runs[0.25, "lru"]["hit_rate"] < top["hit_rate"] < 1
    for x in r["runs"]:
        assert x["l2_bytes"] % (1 << 20) == 0 and x["over_lru"] == 1.0
        assert x["get_misses"] == 0 and x["set_refused"] == 0
        assert x["bytes_read_per_hit_token"] > 256  # a KV page's bytes a token, plus the states
        assert x["orphans_client"]["samples"] == 6  # every 20 requests
        assert 0 <= x["orphans_client"]["mean"] <= x["orphans_client"]["max"] < x["l2_bytes"]
        for kind in ("exists", "get", "set"):
            assert x[kind]["count"] > 0 and 0 < x[kind]["p50_ms"] <= x[kind]["p99_ms"], kind
    assert r["targets"] == []  # LRU only: nothing to compare
    # the report, with the same runs as a second policy's: its targets against LRU's
    spec = importlib.util.spec_from_file_location("bench_hybrid_cache",
                                                  TOOLS / "bench_hybrid_cache.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # (its dataclasses look themselves up)
    spec.loader.exec_module(bench)
    both = r["runs"] + [dict(x, policy="hybrid:2") for x in r["runs"]]
    bench.add_ratios(both)
    met = {what.split(":")[0].split(" at most")[0]: ok
           for policy, what, ok in bench.targets(both) if policy == "hybrid:2"}
    orphans = max(x["orphans_client"]["max"] / x["l2_bytes"] for x in r["runs"])
    assert met == {"10 %": runs[0.1, "lru"]["over_ceiling"] >= 0.85, "no budget below LRU": True,
                   "orphans": orphans <= 0.01, "exists p99": True, "get p99": True,
                   "set p99": True}
    args = bench.argparse.Namespace(state_pages=32, slab_size=1 << 20, set_batch=128,
                                    daemon_args="")
    bench.print_report(trace, both, args)
    out = capsys.readouterr().out
    assert "L2 10% of the working set" in out and "L2 unbounded (ceiling)" in out
    assert "WARNING" not in out and "targets (issue 25)" in out
    assert len([line for line in out.splitlines() if line.startswith("hybrid:2 ")]) == 3


def test_hybrid_oracle_bounds_the_trace_between_lru_and_the_ceiling(monkeypatch):
    """The offline policies of ``hybrid_oracle.py`` on a small trace: no eviction gives the
    ceiling worked out by ``hybrid_trace``, the oracle never does worse than the simulated LRU,
    and the CLI prints every policy per budget and refuses bad input."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import hybrid_oracle as oracle
    from hybrid_trace import KV_PAGE_BYTES, make_trace, summary

    trace = make_trace("mix2", 5, 240)
    state = 32 * KV_PAGE_BYTES
    info = summary(trace, 24, state)
    rates = {}
    for policy in oracle.POLICIES:
        top = oracle.simulate(trace, 2 * info["working_set_bytes"], policy, state, 24)
        assert top["hit_rate"] == info["ceiling_hit_rate"], policy  # nothing evicted
        for pct in (5, 20):
            rates[policy, pct] = oracle.simulate(trace, info["working_set_bytes"] * pct // 100,
                                                 policy, state, 24)["hit_rate"]
    for pct in (5, 20):
        assert 0 < rates["lru", pct] < rates["belady", pct] <= info["ceiling_hit_rate"]
        assert rates["lru", pct] < rates["admit", pct] <= rates["belady", pct]
        assert rates["lru", pct] <= rates["visible", pct] <= info["ceiling_hit_rate"]
    assert rates["belady", 5] < rates["belady", 20]
    seen = oracle.simulate(trace, info["working_set_bytes"] // 20, "visible", state, 24)
    assert seen["theta"] in oracle.THETAS and seen["classes"] > 10  # features a store sees
    with pytest.raises(ValueError, match="policy: 'lfu'"):
        oracle.simulate(trace, 1 << 20, "lfu", state, 24)
    r = _run("hybrid_oracle.py", "--requests", "200", "--budgets", "10,30")
    assert [row["budget_pct"] for row in r["budgets"]] == [10.0, 30.0]
    assert all(set(row) == {"budget_pct", *oracle.POLICIES} for row in r["budgets"])
    assert r["trace"]["requests"] == 200
    bad = subprocess.run([sys.executable, str(TOOLS / "hybrid_oracle.py"), "--budgets", "0,x"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--budgets: '0,x'" in bad.stderr


def test_hybrid_index_replay_drives_the_index_as_the_daemon_does(monkeypatch):
    """The trace on the page index in process: with room for everything, the ceiling worked out
    offline, exactly; under pressure, evictions, fewer hits, and no orphan left by the chain
    policies; the CLI times every set call per policy and refuses bad input."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import hybrid_index_replay as replay
    from hybrid_trace import KV_PAGE_BYTES, make_trace, summary

    trace = make_trace("mix2", 5, 240)
    info = summary(trace, 24, 32 * KV_PAGE_BYTES)
    most = {}
    for policy in ("lru", "hybrid"):
        top = replay.replay(trace, policy, 2 * info["working_set_bytes"], 32, 24)
        assert top["hit_rate"] == info["ceiling_hit_rate"] and top["evictions"] == 0, policy
        low = replay.replay(trace, policy, info["working_set_bytes"] // 10, 32, 24)
        assert low["evictions"] > 0 and 0 < low["hit_rate"] < top["hit_rate"], policy
        assert low["sets"] > 0 and 0 < low["set_p50_ms"] <= low["set_p99_ms"], policy
        assert policy == "lru" or low["orphan_bytes_at_end"] == 0
        assert 0 < low["set_evicted_p99"] <= low["set_evicted_max"], policy
        most[policy] = (low["set_evicted_p99"], low["set_evicted_max"])
    # a set evicts about what it stores under either policy: a leaf segment goes only as far as
    # the call needs (a state's segment of ~100 KV pages would double a call's evictions), save
    # one whose going empties a slab the other class waits for: it goes whole (issue 48's
    # pressure pattern; docs/eviction.md, rule 5), a leaf segment (at most a request's pages)
    # more at most
    longest = max(len(r.keys) for r in trace.requests)
    assert most["hybrid"][0] <= most["lru"][0] + 32, most
    assert most["hybrid"][1] <= most["lru"][1] + longest, (most, longest)
    r = _run("hybrid_index_replay.py", "--requests", "150", "--budgets", "10",
             "--policies", "lru,prefix,hybrid:2")
    assert [x["policy"] for x in r["runs"]] == ["lru", "prefix", "hybrid:2"]
    assert all(x["budget_pct"] == 10 and x["evictions"] > 0 for x in r["runs"])
    bad = subprocess.run([sys.executable, str(TOOLS / "hybrid_index_replay.py"),
                          "--policies", "lru,mru"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--policies: 'mru'" in bad.stderr


def test_bench_engine_under_pressure_keeps_the_base_prompts_head_unless_lru():
    """``bench_engine.py --pressure``: the reference engine asks a prompt sharing 90 % of a base
    prompt after unrelated ones evicted half a prompt's worth of L2: LRU took the base's head."""
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_engine.py"), "--pressure",
                           "--prompt-tokens", "512", "--noise", "2", "--policies", "lru,hybrid",
                           # (it holds the run's 3 prompts, ~1 MiB; mapping the default 2 GiB
                           # pre-faulted, by the daemon and each engine, took seconds)
                           "--unbounded-l2", "64MiB"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("unbounded", "lru", "hybrid")}
    hit = {policy: float(row[2].rstrip("%")) for policy, row in rows.items()}
    assert hit["lru"] == 0.0 < hit["hybrid"] <= hit["unbounded"], proc.stdout
    assert rows["hybrid"][5] == "0" and int(rows["lru"][5]) > 0  # orphan KiB


def test_status_demo_serves_three_engines():
    stats = _run("status_demo.py", "--seconds", "2", "--sample-s", "0.1")
    assert {n["namespace"] for n in stats["namespaces"]} == {
        "llama-70b|tp0of1", "qwen3-next|tp0of1", "tenant-b"}
    assert stats["pools"]["kv"]["l2_hits"] > 0 and stats["pools"]["mamba"]["l2_hits"] > 0
    assert stats["bytes_moved"]["client_to_l2"] > 0 and stats["bytes_moved"]["l2_to_l3"] > 0


def test_bench_index_loop_tiny_run_times_every_phase_of_each_policy():
    r = _run("bench_index_loop.py", "--pages", "3000", "--calls", "5", timeout=60)
    assert [one["policy"] for one in r["results"]] == ["lru", "hybrid"]
    for one in r["results"]:
        assert one["pages"] == 3000 and one["fill_pages_per_s"] > 0 and one["evictions"] > 0
        for phase in ("set", "set_evicting", "get", "small_set", "small_get"):
            m = one[phase]
            assert m["calls"] == 5 and m["pages"] > 0, phase
            assert 0 < m["p50_us"] <= m["p99_us"] and m["wall_us_per_call"] > 0, phase


@pytest.mark.parametrize("nodes", [1, 2])
def test_bench_pd_moves_only_the_delta_with_the_decode_radix_and_outputs_stay_equal(nodes):
    """``bench_pd.py`` at toy size: 2 prefixes of 64 tokens, 4 conversations of 2 turns, 8-token
    pages. Without the decode radix every request moves its prompt's whole pages (72 then 80
    tokens: 9 and 10 pages); with it the two first turns on a new prefix move all 9, every
    other request one page (the 8-token message past what the decode holds). The same on two
    nodes (two daemons sharing a mooncake_master: the pages go through L3). Two nodes run the
    modes side by side (the default), one node one after the other (``--sequential``)."""
    if nodes == 2:
        pytest.importorskip("mooncake.store", reason="two nodes need the mooncake extra")
    own_l2 = ("--decode-l2", "64MiB") if nodes == 2 else ("--sequential",)
    r = _run("bench_pd.py", "--nodes", str(nodes), "--prefixes", "2", "--prefix-tokens", "64", "--suffix-tokens", "8",
             "--conversations", "4", "--turns", "2", "--new-tokens", "2", "--page-size", "8",
             "--track-interval", "16", "--kv-heads", "2", "--head-dim", "16", *own_l2,
             timeout=300)
    assert r["outputs_equal"] and r["max_logit_diff"] <= 1e-5 and r["nodes"] == nodes
    assert r["decode_l2"] == ("64MiB" if nodes == 2 else "")
    assert r["page_bytes"] == 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 attention layers, fp32
    off, on = r["off"], r["on"]
    assert off["requests"] == on["requests"] == 8
    assert off["pages_per_request"] == (4 * 9 + 4 * 10) / 8 and off["matched_tokens_mean"] == 0
    assert on["pages_per_request"] == (2 * 9 + 6 * 1) / 8
    assert on["matched_tokens_mean"] == (2 * 64 + 4 * 72) / 8
    assert off["bytes_per_request"] == off["pages_per_request"] * r["page_bytes"] \
        + r["state_bytes"]  # and one state each
    assert r["on_over_off"]["bytes_per_request"] < 1  # (at this size the states weigh most)
    for s in (off, on):
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"]
        # where the mean TTFT went: parts of it, each measured
        assert 0 < s["publish_mean_ms"] < s["prefill_mean_ms"] < s["ttft_mean_ms"]
        assert 0 < s["load_mean_ms"] < s["ttft_mean_ms"] - s["prefill_mean_ms"]
        assert 0 < s["pool_used_tokens_max"] <= s["pool_tokens"]
    if nodes == 1:
        assert off["store_loads_per_request"] == on["store_loads_per_request"] == 0
    else:
        # every page the decode loads crossed the store, once per node: what the decode's
        # daemon read (pages and states) is below what the decode moved when it keeps copies
        assert 0 < off["store_loads_per_request"] < off["pages_per_request"]
        assert 0 < on["store_loads_per_request"] <= on["pages_per_request"] + 1
    bad = subprocess.run([sys.executable, str(TOOLS / "bench_pd.py"), "--decode-l2", "64MiB"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--decode-l2 needs --nodes 2" in bad.stderr


def test_bench_fairness_tiny_run_measures_small_calls_with_and_without_the_huge_caller(capsys):
    """``bench_fairness.py --small``: the small clients' calls of both kinds of window, side by
    side, the ratio of their p99, and the huge client's calls (each kind, each cycle)."""
    r = _run("bench_fairness.py", "--small", timeout=180)
    assert (r["clients"], r["huge_keys"], r["rounds"]) == (2, 1024, 2)
    for phase in ("alone", "huge"):
        for kind in ("all", "exists", "get", "set"):
            m = r[phase][kind]
            assert m["count"] > 0 and 0 < m["p50_ms"] <= m["p99_ms"] <= m["max_ms"], (phase, kind)
        assert r[phase]["all"]["count"] == sum(r[phase][k]["count"]
                                               for k in ("exists", "get", "set"))
    assert r["ratio"]["p99_ms"] == r["huge"]["all"]["p99_ms"] / r["alone"]["all"]["p99_ms"]
    counts = {kind: m["count"] for kind, m in r["huge_calls"].items()}
    assert set(counts) == {"exists", "set", "get"} and len(set(counts.values())) == 1
    assert counts["set"] >= 2  # at least one cycle in each of the two windows
    spec = importlib.util.spec_from_file_location("bench_fairness", TOOLS / "bench_fairness.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.print_report(r)
    out = capsys.readouterr().out
    assert "p99 with the huge client / alone:" in out and "huge calls: exists p50" in out
    bad = subprocess.run([sys.executable, str(TOOLS / "bench_fairness.py"), "--clients", "0"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--clients: 0 (at least 1)" in bad.stderr


def test_ctrl_c_sweep_sorts_each_run_and_finds_nothing_left():
    r = _run("ctrl_c_sweep.py", "--runs", "2", "--first", "0.5", "--last", "0.6",
             "--l2-size", "16MiB")
    assert [run["delay_s"] for run in r["runs"]] == [0.5, 0.6]
    # past Python's own start: the one line (or the stop once up), and the end by SIGINT
    assert all(run["kind"] in ("interrupted", "stopped") and run["status"] == -2
               for run in r["runs"]), r
    assert r["arena_files_left"] == 0


def test_chaos_atomic_tiny_run_checks_every_get_and_finds_no_torn_key():
    """tools/chaos_atomic.py (issue 45, item 8) for a few seconds a phase: processes killed
    inside sets and gets and started again, an L2 flush, then every get checked: no key comes
    back as a KV hit with its INDEXER page missing, no page with another key's bytes."""
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "chaos_atomic.py"), "--seconds", "4", "--check-s", "4",
         "--procs", "2", "--check-procs", "2", "--chains", "30", "--check-chains", "4",
         "--stateless", "0.3"], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["churn"]["gets"] > 0 and r["check"]["gets"] > 0 and r["check"]["keys"] > 0
    assert r["check"]["torn"] == r["check"]["wrong"] == r["churn"]["wrong"] == 0
    assert r["crashes"] == 0 and r["processes"] > 4  # at least one killed and started again


def test_bench_warm_restart_kills_under_load_find_no_wrong_byte_and_no_leaked_slot():
    r = _run("bench_warm_restart.py", "--kills", "3", "--l2-size", "32MiB", "--slab-size",
             "4MiB", "--clients", "2", timeout=180)
    assert r["kills"] == 3 and len(r["per_kill"]) == 3
    assert r["wrong_pages"] == 0 and r["leaked_bytes"] == 0 and r["shm_ok"] is True
    assert r["cold_starts"] == 0  # every restart adopted the arena the kill left
    assert all(k["adopted"] > 0 and k["evictions_before"] > 0 for k in r["per_kill"])
    assert r["pages_compared_by_old_clients"] > 0 and r["pages_read_back_by_new_clients"] > 0


def test_bench_engine_warm_restart_hits_the_prefix_right_after_it_and_not_after_a_cold_one():
    """``bench_engine.py --warm-restart``: fresh engines right after a warm restart (and after
    a crash) find the same prefix as before it in L2; after a cold restart without L3, none."""
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_engine.py"), "--warm-restart",
                           "--prompt-tokens", "256", "--repeats", "1",
                           "--unbounded-l2", "64MiB"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hit = {line[:32].strip(): float(line[32:].split()[0].rstrip("%"))
           for line in proc.stdout.splitlines()[2:] if "%" in line}
    assert hit["recompute"] == 0.0 < hit["before the restart"], proc.stdout
    assert hit["after a warm restart (SIGTERM)"] == hit["before the restart"], proc.stdout
    assert hit["after a crash (SIGKILL)"] == hit["before the restart"], proc.stdout
    assert hit["after a cold restart, no L3"] == 0.0, proc.stdout


@pytest.mark.parametrize("tool", sorted(p.name for p in TOOLS.glob("*.py")
                                        if "argparse" in p.read_text()))
def test_every_tools_help_prints_its_usage(tool):
    """``--help``, what an operator types first, prints the usage and exits 0 (a ``%`` in a help
    text, unescaped, made argparse raise instead)."""
    proc = subprocess.run([sys.executable, str(TOOLS / tool), "--help"], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:200]
