"""The benchmarks under tools/ still run end to end (tiny runs: their figures are not checked
here, only that they measure what they say and that the bytes they move are right)."""

from __future__ import annotations

import json
import os
import pathlib
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
