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
    assert set(f) >= {"get_on", "get_off", "write_on", "write_off", "get_on_over_off"}
    assert f["get_on"]["median"] > 0 and f["write_off"]["median"] > 0 and "mooncake" not in r


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
