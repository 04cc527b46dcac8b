"""Micro-benchmark of the host-pool <-> arena page copies against plain memcpy.

For each pool geometry (MHA layer_first / page_first / page_first_direct, MLA, Mamba, DSA indexer)
and each copy path (native torch views, SGLang pointer meta, SGLang flat pages) it times
``to_arena`` and ``from_arena`` of ``--pages`` pages and a plain ``copy_`` of a contiguous tensor of
the same bytes, and prints GB/s and the ratio to memcpy. Patterns: ``consecutive`` (host pages and
arena slots both consecutive: the common case, one copy per part) and ``scattered`` (random host
pages into consecutive slots). Run: ``python tools/bench_kernels.py [--json] [--pages 64]``.

Where CUDA is available a second table times ``kernels/cuda.py``: the same geometries held on the
GPU, copied to and from a CUDA-registered arena, against one plain pinned D2H / H2D copy of the
same bytes (``--no-cuda`` skips it).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from hicached.client.hostpool import HostPool, make_page_io

MIB = 1 << 20


def _pools(num_pages: int) -> list[tuple[str, Callable[[], HostPool]]]:
    """Geometries near real models (per rank), sized so ``num_pages`` pages stay ~100-300 MiB."""
    mha = dict(page_size=16, layers=32, heads=8, head_dim=128, dtype=torch.bfloat16)  # 2 MiB/page
    return [
        ("mha layer_first", lambda: HostPool.allocate_mha(num_pages, layout="layer_first", **mha)),
        ("mha page_first", lambda: HostPool.allocate_mha(num_pages, layout="page_first", **mha)),
        ("mha page_first_direct",
         lambda: HostPool.allocate_mha(num_pages, layout="page_first_direct", **mha)),
        ("mla layer_first (dsv3)",
         lambda: HostPool.allocate_mla(num_pages, 32, 61, 576, "layer_first")),
        ("mla page_first (dsv3)",
         lambda: HostPool.allocate_mla(num_pages, 32, 61, 576, "page_first")),
        ("mamba page_first",
         lambda: HostPool.allocate_mamba(num_pages, 8, (16, 64, 64), [(3, 2048)])),
        ("indexer page_first",
         lambda: HostPool.allocate_indexer(num_pages, 64, 61, 64 * 132, "page_first")),
    ]


def _best_of(fns: list[Callable[[], None]], repeat: int) -> list[float]:
    """Fastest wall time of each fn over ``repeat`` rounds, the fns interleaved per round.

    Interleaving and taking the minimum keep the memcpy baseline and the measured copies under the
    same machine noise (shared hosts drift by 2x over seconds), so the ratios stay meaningful.
    """
    for fn in fns:
        fn()  # warm-up: first touch, lazy inits
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _bench_pool(name: str, pool: HostPool, pages: int, repeat: int, paths: list[str],
                patterns: list[str], gen: torch.Generator) -> list[dict]:
    for buf in pool.buffers:  # fault the pool in and give it non-zero bytes
        buf.view(torch.uint8).fill_(7)
    page_bytes = pool.page_bytes
    nbytes = pages * page_bytes
    arena = torch.full((nbytes,), 3, dtype=torch.uint8)
    src = torch.full((nbytes,), 5, dtype=torch.uint8)
    offsets = [i * page_bytes for i in range(pages)]
    rows = []
    for pattern in patterns:
        if pattern == "consecutive":
            host_pages = list(range(pages))
        else:
            host_pages = torch.randperm(pool.page_num, generator=gen)[:pages].tolist()
        starts = [p * pool.page_size for p in host_pages]
        for path in paths:
            io = make_page_io(pool, path=path)
            memcpy_s, to_s, from_s = _best_of([
                lambda: arena.copy_(src),
                lambda io=io, starts=starts: io.to_arena(starts, arena, offsets),
                lambda io=io, starts=starts: io.from_arena(starts, arena, offsets),
            ], repeat)
            rows.append(dict(
                pool=name, pattern=pattern, path=path, page_mib=page_bytes / MIB,
                to_gbps=nbytes / to_s / 1e9, from_gbps=nbytes / from_s / 1e9,
                memcpy_gbps=nbytes / memcpy_s / 1e9,
                to_ratio=memcpy_s / to_s, from_ratio=memcpy_s / from_s,
            ))
    return rows


def run(pages: int, repeat: int, paths: list[str], patterns: list[str]) -> list[dict]:
    """Benchmark rows (dicts) for every pool geometry x pattern x path."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, build in _pools(2 * pages):
        rows += _bench_pool(name, build(), pages, repeat, paths, patterns, gen)
    return rows


def _cuda_time(fn: Callable[[], None], repeat: int) -> float:
    """Fastest of ``repeat`` timed calls of ``fn``, each followed by a device synchronize."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def run_cuda(pages: int, repeat: int, patterns: list[str]) -> list[dict]:
    """Rows for ``kernels/cuda.py``: device pool <-> registered arena vs a plain DMA copy."""
    from hicached.kernels.cuda import DeviceCopier, HostRegistration

    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, build in _pools(2 * pages):
        pool = build()
        buffers = [b.to("cuda") for b in pool.buffers]
        copier = DeviceCopier(pool.kind, pool.layout, pool.page_size, buffers)
        nbytes = pages * copier.page_bytes
        arena = torch.empty(nbytes, dtype=torch.uint8)
        device_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        offsets = [i * copier.page_bytes for i in range(pages)]
        reg = HostRegistration(arena)
        try:
            d2h = _cuda_time(lambda a=arena, d=device_flat: a.copy_(d, non_blocking=True), repeat)
            h2d = _cuda_time(lambda a=arena, d=device_flat: d.copy_(a, non_blocking=True), repeat)
            for pattern in patterns:
                host_pages = (list(range(pages)) if pattern == "consecutive" else
                              torch.randperm(copier.num_pages, generator=gen)[:pages].tolist())
                to_s = _cuda_time(lambda c=copier, p=host_pages, a=arena, o=offsets:
                                  c.to_arena(p, a, o), repeat)
                from_s = _cuda_time(lambda c=copier, p=host_pages, a=arena, o=offsets:
                                    c.from_arena(p, a, o), repeat)
                rows.append({
                    "pool": name, "pattern": pattern, "path": "cuda",
                    "page_mib": copier.page_bytes / MIB, "to_gbps": nbytes / to_s / 1e9,
                    "from_gbps": nbytes / from_s / 1e9, "memcpy_gbps": nbytes / d2h / 1e9,
                    "to_ratio": d2h / to_s, "from_ratio": h2d / from_s,
                })
        finally:
            reg.close()
    return rows


def _print_table(rows: list[dict], pages: int) -> None:
    print(f"{pages} pages per call, torch threads={torch.get_num_threads()}; "
          "ratio = path GB/s / memcpy GB/s")
    header = (f"{'pool':<24}{'pattern':<13}{'path':<9}{'MiB/pg':>7}{'to GB/s':>9}"
              f"{'from GB/s':>10}{'memcpy':>8}{'to x':>7}{'from x':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['pool']:<24}{r['pattern']:<13}{r['path']:<9}{r['page_mib']:>7.2f}"
              f"{r['to_gbps']:>9.1f}{r['from_gbps']:>10.1f}{r['memcpy_gbps']:>8.1f}"
              f"{r['to_ratio']:>7.2f}{r['from_ratio']:>8.2f}")


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: parse flags, run the benchmark, print a table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64, help="pages per call (default 64)")
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed rounds, best of (default 7)")
    parser.add_argument("--paths", default="native,pointer,flat",
                        help="comma list of native, pointer, flat")
    parser.add_argument("--patterns", default="consecutive,scattered",
                        help="comma list of consecutive, scattered")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--no-cuda", action="store_true",
                        help="skip the CUDA table even where a GPU is available")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.pages, args.repeat, args.paths.split(","), args.patterns.split(","))
    cuda_rows = []
    if torch.cuda.is_available() and not args.no_cuda:
        cuda_rows = run_cuda(args.pages, args.repeat, args.patterns.split(","))
    if args.json:
        print(json.dumps(rows + cuda_rows, indent=1))
        return
    _print_table(rows, args.pages)
    if cuda_rows:
        print("\nCUDA: device pool <-> registered arena; ratio = path GB/s / plain pinned "
              "copy GB/s (memcpy column: D2H)")
        _print_table(cuda_rows, args.pages)


if __name__ == "__main__":
    main()
