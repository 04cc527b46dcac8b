"""The real-trace tools of issue 48: ``mooncake_trace`` (Mooncake's format), ``hybrid_oracle
--trace-file``, ``trace_features`` and ``bench_hybrid_cache --trace-file`` (real daemons), on a
small trace written here; and issue 48's table reproduced on the real trace when it is there."""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent.parent / "tools"
REAL = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"


def write_trace(path: pathlib.Path, requests: int = 120, seed: int = 7) -> list[dict]:
    """A Mooncake-format trace: conversations under two shared system prompts, each turn's
    prompt its previous prompt's full blocks plus new ones (a partial last block sometimes)."""
    rng = random.Random(seed)
    next_id = 4  # 0-1 and 2-3: two system prompts of 2 blocks
    convs: list[list[int]] = []
    rows, t = [], 0
    for _ in range(requests):
        if not convs or rng.random() < 0.3:
            convs.append([0, 1] if rng.random() < 0.6 else [2, 3])
        c = convs[rng.randrange(len(convs))]
        new = rng.randint(1, 4)
        c.extend(range(next_id, next_id + new))
        next_id += new
        partial = rng.random() < 0.5
        length = 512 * len(c) + (rng.randint(1, 511) if partial else 0)
        ids = list(c) + ([next_id] if partial else [])
        next_id += partial
        rows.append({"timestamp": t, "input_length": length, "output_length": 10,
                     "hash_ids": ids})
        t += rng.randint(0, 2000)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.fixture
def tools(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))


def test_load_keeps_full_blocks_and_finds_branch_points_online(tools, tmp_path):
    import mooncake_trace

    f = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1500, "hash_ids": [10, 11, 12]},  # 2 full blocks
            {"timestamp": 5, "input_length": 2048, "hash_ids": [10, 11, 13, 14]},  # 11 branches
            {"timestamp": 9, "input_length": 1024, "hash_ids": [10, 11]}]  # all seen
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hy = mooncake_trace.load(str(f), "hybrid")
    assert [r.ids for r in hy.requests] == [[0, 1], [0, 1, 2, 3], [0, 1]]
    assert [r.prompt_pages for r in hy.requests] == [2, 4, 2]
    assert [r.prompt_tokens for r in hy.requests] == [1024, 2048, 1024]
    # 12 is a partial block, never stored: 13 is key 11's first child, no branch point yet
    assert [r.branches for r in hy.requests] == [(), (), ()]
    rows.append({"timestamp": 9, "input_length": 1536, "hash_ids": [10, 11, 15]})
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hy = mooncake_trace.load(str(f), "hybrid")
    assert hy.requests[3].branches == (2,)  # key 11 gets its second child: its state at page 1
    assert mooncake_trace.load(str(f), "attention").requests[3].branches == ()
    assert not mooncake_trace.load(str(f), "attention").with_states
    assert list(hy.parent) == [-1, 0, 1, 2, 1] and list(hy.depth) == [0, 1, 2, 3, 2]
    assert list(hy.times_ms) == [0, 5, 9, 9]
    assert mooncake_trace.load(str(f), "hybrid", requests=2).requests[-1].ids == [0, 1, 2, 3]


@pytest.mark.parametrize("line, says", [
    ("[1, 2]", ":1: a list, not a JSON object"),
    ('{"timestamp": 0, "input_length": 600, "hash_ids": [1]}', "hash_ids must be 2 integers"),
    ('{"timestamp": "x", "input_length": 600, "hash_ids": [1, 2]}', "timestamp 'x'"),
    ('{"timestamp": 0, "input_length": -1, "hash_ids": []}', "input_length -1"),
    ("{nope", ":1: not JSON"),
])
def test_a_malformed_trace_file_names_its_line(tools, tmp_path, line, says):
    import mooncake_trace

    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(mooncake_trace.TraceFileError, match=f".*{says[:20]}".replace("[", r"\[")):
        mooncake_trace.load(str(f))
    with pytest.raises(mooncake_trace.TraceFileError, match="no such file"):
        mooncake_trace.load(str(tmp_path / "none.jsonl"))
    with pytest.raises(ValueError, match="geometry: 'mla'"):
        mooncake_trace.load(str(f), "mla")


def test_a_chain_that_contradicts_itself_is_refused(tools, tmp_path):
    import mooncake_trace

    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}) + "\n"
                 + json.dumps({"timestamp": 1, "input_length": 1024, "hash_ids": [3, 2]}) + "\n")
    with pytest.raises(mooncake_trace.TraceFileError, match="request 2: block 2 at depth 1"):
        mooncake_trace.load(str(f))


def test_oracle_on_a_trace_file_bounds_it_between_lru_and_the_ceiling(tools, tmp_path):
    import hybrid_oracle as oracle
    import mooncake_trace
    from hybrid_trace import summary

    f = tmp_path / "t.jsonl"
    write_trace(f)
    for geometry in mooncake_trace.GEOMETRIES:
        trace = mooncake_trace.load(str(f), geometry)
        state = mooncake_trace.STATE_PAGES * trace.kv_page_bytes if trace.with_states else 0
        info = summary(trace, 0, state)
        assert info["geometry"] == ("hybrid" if geometry == "hybrid" else "attention-only")
        assert (info["stored_states"] > 0) == (geometry == "hybrid")
        rates = {}
        for policy in oracle.POLICIES:
            top = oracle.simulate(trace, 2 * info["working_set_bytes"], policy, state, 0)
            assert top["hit_rate"] == info["ceiling_hit_rate"] > 0, (geometry, policy)
            rates[policy] = oracle.simulate(trace, info["working_set_bytes"] // 10, policy,
                                            state, 0)["hit_rate"]
        assert 0 < rates["lru"] <= rates["belady"] <= info["ceiling_hit_rate"], rates
        assert rates["lru"] <= rates["admit_store"] <= rates["admit"], rates
    out = subprocess.run([sys.executable, str(TOOLS / "hybrid_oracle.py"), "--trace-file",
                          str(f), "--policies", "lru,leaf,belady", "--budgets", "10", "--json"],
                         check=True, capture_output=True, text=True, timeout=120)
    got = json.loads(out.stdout)["geometries"]
    assert [g["trace"]["geometry"] for g in got] == ["attention-only", "hybrid"]
    assert all(set(g["budgets"][0]) == {"budget_pct", "lru", "leaf", "belady"} for g in got)
    bad = subprocess.run([sys.executable, str(TOOLS / "hybrid_oracle.py"), "--trace-file",
                          str(f), "--policies", "lru,lfu"], check=False, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--policies: 'lru,lfu'" in bad.stderr


def test_trace_features_score_what_a_store_sees(tools, tmp_path):
    import mooncake_trace
    import trace_features

    f = tmp_path / "t.jsonl"
    write_trace(f)
    trace = mooncake_trace.load(str(f), "attention")
    feats, labels = trace_features.classes(trace)
    assert sum(map(len, feats)) == len(trace.keys)  # every stored page once
    assert all(len(c) == len(trace_features.FEATURES) for fs in feats for c in fs)
    seen = trace_features.hindsight(trace)
    assert seen["pages"] == len(trace.keys)
    assert set(seen["features"]) == {*trace_features.FEATURES, "all"}
    assert all(0 <= v["auc"] <= 1 for v in seen["features"].values())
    assert trace_features.auc([0.1, 0.2, 0.9], [False, False, True]) == 1.0
    assert trace_features.auc([0.5, 0.5], [False, True]) == 0.5
    from hybrid_trace import summary

    ws = summary(trace, 0, 0)["working_set_bytes"]
    assert trace_features.visible_all(trace, 2 * ws)["hit_rate"] == summary(
        trace, 0, 0)["ceiling_hit_rate"]
    vo = trace_features.visible_online(trace, ws // 10)
    assert set(vo) == set(trace_features.SUBSETS)
    assert all(set(v["by_theta"]) == set(trace_features.THETAS) for v in vo.values())
    lru = vo["all"]["by_theta"][0.0]  # theta 0 demotes nothing: LRU itself
    from hybrid_oracle import simulate

    assert lru == simulate(trace, ws // 10, "lru", 0, 0)["hit_rate"]
    on = trace_features.online(trace, ws // 10)
    assert set(on) == {"atc", "atc_hindsight", "leaf_freq"}
    assert all(0 < v <= 1 for d in on.values() for v in d.values())


def test_bench_replays_a_trace_file_through_real_daemons(tmp_path):
    f = tmp_path / "t.jsonl"
    write_trace(f, requests=80)
    out = subprocess.run(
        [sys.executable, str(TOOLS / "bench_hybrid_cache.py"), "--trace-file", str(f),
         "--policies", "lru,hybrid", "--budgets", "20", "--speedup", "0", "--slab-size",
         str(64 << 10), "--json"],
        check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(TOOLS.parent), os.environ.get("PYTHONPATH")) if p)})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert [g["trace"]["geometry"] for g in r["geometries"]] == ["attention-only", "hybrid"]
    for g in r["geometries"]:
        ceiling = g["trace"]["ceiling_hit_rate"]
        assert [row["budget"] for row in g["budgets"]] == [0.2, None]
        for row in g["budgets"]:
            assert [run["policy"] for run in row["runs"]] == ["lru", "hybrid"]
            assert set(row["oracle"]) == {"lru", "leaf", "admit_store", "admit", "belady"}
            for run in row["runs"]:
                assert run["get_misses"] == 0 and run["orphan_samples"] > 0
                assert run["set"]["count"] > 0
        unbounded = g["budgets"][-1]
        for run in unbounded["runs"]:  # nothing evicted: the ceiling worked out offline
            assert run["hit_rate"] == pytest.approx(ceiling, abs=1e-12)
            assert run["orphans_max_share"] == 0 and run["set_refused"] == 0
        assert unbounded["oracle"]["lru"] == ceiling
    for bad, says in ((["--geometry", "mla"], "--geometry: 'mla'"),
                      (["--policies", "prefix"], "--policies: 'prefix' lacks lru"),
                      (["--slab-size", "4096"], "holding a state (6144 bytes), got 4096")):
        out = subprocess.run([sys.executable, str(TOOLS / "bench_hybrid_cache.py"),
                              "--trace-file", str(f), *bad], check=False, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and says in out.stderr, out.stderr[-2000:]
    out = subprocess.run([sys.executable, str(TOOLS / "bench_hybrid_cache.py"), "--trace-file",
                          str(tmp_path / "none.jsonl")], check=False, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "none.jsonl': no such file" in out.stderr


@pytest.mark.skipif(not (REAL / "conversation_trace.jsonl").exists(),
                    reason="Mooncake's traces are not in ../shared/data/traces")
def test_issue_48s_table_is_reproduced_on_the_real_traces(tools):
    """Issue 48's table (budget a share of the unique full blocks, no warm-up): LRU, and
    "admit" (``admit_store``: stores only what is read again) as ratios to LRU."""
    import hybrid_oracle as oracle
    import mooncake_trace
    from hybrid_trace import summary

    table = {"conversation": {2: (0.079, 2.61), 5: (0.202, 1.59), 10: (0.288, 1.29)},
             "synthetic": {5: (0.153, 1.26), 10: (0.251, 1.28)}}
    for name, rows in table.items():
        trace = mooncake_trace.load(str(REAL / f"{name}_trace.jsonl"), "attention")
        blocks = summary(trace, 0, 0)["stored_kv_pages"]
        for pct, (lru, admit) in rows.items():
            budget = blocks * pct // 100 * trace.kv_page_bytes
            got = {p: oracle.simulate(trace, budget, p, 0, 0)["hit_rate"]
                   for p in ("lru", "admit_store")}
            assert round(got["lru"], 3) == lru, (name, pct, got)
            assert round(got["admit_store"] / got["lru"], 2) == admit, (name, pct, got)
