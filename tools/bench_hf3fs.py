"""3FS backend benchmark: ``batch_get`` bandwidth vs a plain ``preadv`` of the same bytes.

On a directory (a 3FS mount, or any directory: the backend then uses its POSIX path), for
``n_pages`` pages of ``page_bytes``:
  plain   the same bytes in one plain file, read back with one ``os.preadv`` per page straight
          into the arena (the floor any file-based L3 pays: no metadata, no checks)
  hf3fs   ``Hf3fsBackend.batch_get`` of every page into the arena (pointers cached from the
          first pass, as in a daemon: per page a vectored slot read + a head re-read + checks)
  put     ``batch_put`` of the pages once (first write: segment growth included), next to
          the plain file's first ``pwritev`` of the same bytes (one pass each, indicative)
Both reads run alternately, ``reps`` times each, so they see the same machine (this VM drifts);
"warm" reads come from the page cache; with ``cold=True`` the files are fsynced and dropped
from the page cache (``POSIX_FADV_DONTNEED``) before every read (not meaningful on 3FS, which
has no client page cache on this path). GB/s = 1e9 bytes per second of page payload.

    python tools/bench_hf3fs.py [--dir /mnt/3fs/bench] [--page-bytes 1MiB] [--pages 256]
                                [--reps 5] [--cold] [--io auto|posix|usrbio]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid

import torch

from hicached.arena import Arena
from hicached.backends.hf3fs.backend import Hf3fsBackend
from hicached.settings import parse_size


def _rates(nbytes: int, seconds: list[float]) -> dict:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"median": round(statistics.median(rates), 3), "best": round(max(rates), 3)}


def _drop_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fs_of(path: str) -> str:
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", path],
                             capture_output=True, text=True, timeout=10, check=False
                             ).stdout.split()
        return " on ".join(out)
    except (OSError, subprocess.SubprocessError):
        return "?"


def bench_hf3fs(dir: str, page_bytes: int, n_pages: int, reps: int = 5, cold: bool = False,
                io: str = "posix") -> dict:
    """Run the benchmark in a fresh subdirectory of ``dir`` (removed afterwards); returns the
    figures as a dict (``ratio`` = hf3fs / plain, medians)."""
    work = tempfile.mkdtemp(prefix="bench-hf3fs-", dir=dir)
    total = page_bytes * n_pages
    arena = Arena.create(f"/dev/shm/hicached-bench-{uuid.uuid4().hex[:8]}", 2 * total)
    backend = None
    try:
        src = arena.tensor[:total]
        src.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
        dst_off = total
        keys = [f"page-{i}" for i in range(n_pages)]
        src_offs = [i * page_bytes for i in range(n_pages)]
        dst_offs = [dst_off + o for o in src_offs]

        plain_path = os.path.join(work, "plain.bin")
        fd = os.open(plain_path, os.O_RDWR | os.O_CREAT, 0o600)
        t = time.perf_counter()
        for o in src_offs:
            os.pwritev(fd, [arena.view(o, page_bytes)], o)
        plain_put_s = time.perf_counter() - t

        backend = Hf3fsBackend(os.path.join(work, "hf3fs"), capacity=2 * total + (64 << 20),
                               io=io, grace_s=0)
        backend.open(arena)
        t = time.perf_counter()
        stored = backend.batch_put("bench", "kv", keys, src_offs, page_bytes)
        put_s = time.perf_counter() - t
        assert all(stored), "batch_put failed"
        segs = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(work, "hf3fs",
                                                                          "segments"))
                for f in fs]
        assert backend.batch_get("bench", "kv", keys, dst_offs, page_bytes) == [True] * n_pages
        assert torch.equal(arena.tensor[dst_off:dst_off + total], src), "bytes differ"

        times: dict[str, list[float]] = {"plain": [], "hf3fs": []}
        for _ in range(reps):
            if cold:
                _drop_cache([plain_path])
            t = time.perf_counter()
            for s, d in zip(src_offs, dst_offs):
                if os.preadv(fd, [arena.view(d, page_bytes)], s) != page_bytes:
                    raise RuntimeError("short read of the plain file")
            times["plain"].append(time.perf_counter() - t)
            if cold:
                _drop_cache(segs)
            t = time.perf_counter()
            ok = backend.batch_get("bench", "kv", keys, dst_offs, page_bytes)
            times["hf3fs"].append(time.perf_counter() - t)
            assert all(ok), "batch_get missed"
        os.close(fd)
        plain, hf3fs = _rates(total, times["plain"]), _rates(total, times["hf3fs"])
        st = backend.stats()
        return {
            "dir": dir, "fs": _fs_of(dir), "page_bytes": page_bytes, "n_pages": n_pages,
            "reps": reps, "cache": "cold" if cold else "warm", "io": st["io"],
            "plain_preadv_gbps": plain, "hf3fs_get_gbps": hf3fs,
            "ratio": round(hf3fs["median"] / plain["median"], 3),
            "hf3fs_put_gbps": round(total / put_s / 1e9, 3),
            "plain_write_gbps": round(total / plain_put_s / 1e9, 3),
            "verify_failures": st["verify_failures"],
        }
    finally:
        if backend is not None:
            backend.close()
        arena.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="directory to test (a 3FS mount path)")
    ap.add_argument("--page-bytes", default="1MiB")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before reads")
    ap.add_argument("--io", default="posix", choices=("auto", "posix", "usrbio"))
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    a = ap.parse_args()
    r = bench_hf3fs(a.dir, parse_size(a.page_bytes), a.pages, a.reps, a.cold, a.io)
    if not a.json:
        print(f"{r['n_pages']} pages of {r['page_bytes']} B on {r['fs']} ({r['cache']}, "
              f"io {r['io']}):")
        print(f"  plain preadv     {r['plain_preadv_gbps']['median']:7.2f} GB/s median "
              f"({r['plain_preadv_gbps']['best']:.2f} best)")
        print(f"  hf3fs batch_get  {r['hf3fs_get_gbps']['median']:7.2f} GB/s median "
              f"({r['hf3fs_get_gbps']['best']:.2f} best)")
        print(f"  ratio            {r['ratio']:7.3f}")
        print(f"  first write: hf3fs put {r['hf3fs_put_gbps']:.2f} GB/s, plain pwritev "
              f"{r['plain_write_gbps']:.2f} GB/s (one pass each)")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
