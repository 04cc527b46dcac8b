"""L3 benchmark: a store used directly vs the same pages through a daemon, in one run.

Section ``mooncake`` starts its own ``mooncake_master`` and a segment provider process (so every
page crosses Mooncake's TCP transport on loopback: the shape of a remote L3 tier), then a daemon
with ``--l3-backend mooncake`` that contributes no memory itself. The daemon stores 64 pages of
1 MiB (batch_set_v2, written through to Mooncake). Then, interleaved in every repetition (this
VM's speed drifts by 2x within seconds, so the figures are taken side by side):
  direct    a plain Mooncake client: batch_get_into of the *same objects* into a registered buffer
  L2 cold   flush the daemon's L2, then batch_get_v2: Mooncake -> arena (zero-copy) -> host pool
  L2 hit    batch_get_v2 again: arena -> host pool only
plus batch_put_from of the same bytes under fresh keys (direct put). Target: L2 cold >= 0.95 x
direct (the daemon adds one memcpy and two control round trips per call).

Section ``3fs``: the hf3fs backend's batch_get vs plain preadv of the same bytes
(``tools/bench_hf3fs.py``) on /var/tmp, or on $HICACHED_BENCH_3FS_DIR (a 3FS mount).

Section ``checksum``: what L3 checksums cost. The hash's own GB/s, then two daemons, with and
without checksums, side by side: 64 MiB written through to L3 and got back cold, on the file L3
and (with the Mooncake client installed) on Mooncake. Target: on / off >= 0.90.

    python tools/bench_l3.py [--reps 10] [--section mooncake|3fs|checksum] [--daemon-args "..."]
                             [--json]
    (the mooncake section needs the mooncake extra: pip install -e '.[mooncake]' in the clone)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import tempfile
import time
import uuid

import torch

from hicached import Client, HostPool, PoolTransfer
from hicached.arena import Arena
from hicached.backends.mooncake.trailer import FORMAT_PART, TRAILER_BYTES
from hicached.backends.mooncake.transfers import object_key
from hicached.daemon.sessions import namespace_digest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling modules)
from bench_l3_checksum import bench_checksum, print_checksum, set_stores
from l3_harness import (
    KV_DIM,
    LAYERS,
    NAMESPACE,
    PAGE_SIZE,
    PAGES,
    Procs,
    cpu_ticks,
    gbps,
    mooncake_store,
    start_daemon,
    start_master_and_provider,
    wait_for,
)


def bench_mooncake(reps: int, daemon_args: str = "") -> dict:
    """Direct Mooncake vs the same pages through a daemon (L2 cold) vs an L2 hit."""
    logdir = tempfile.mkdtemp(prefix="bench-l3-")
    procs = Procs(logdir)
    direct = buf = None
    try:
        master = start_master_and_provider(procs)
        endpoint = start_daemon(procs, master, shlex.split(daemon_args))
        with Client(endpoint, NAMESPACE) as c:
            src = HostPool.allocate_mla(PAGES, PAGE_SIZE, LAYERS, KV_DIM, dtype=torch.bfloat16)
            src.kv_buffer.normal_()
            dst = HostPool.allocate_mla(PAGES, PAGE_SIZE, LAYERS, KV_DIM, dtype=torch.bfloat16)
            dst.kv_buffer.fill_(1)  # fault in
            page_bytes = src.page_bytes
            nbytes = PAGES * page_bytes
            keys = [f"page-{i}" for i in range(PAGES)]
            idx = torch.arange(PAGES * PAGE_SIZE)
            c.register_mem_host_pool_v2(src, "kv")
            t = time.perf_counter()
            assert all(c.batch_set_v2([PoolTransfer("kv", idx, keys=keys)])["kv"])
            wait_for(lambda: c.stats()["l3_writes"] >= PAGES, 120, "the write-through")
            write_through_s = time.perf_counter() - t
            c.register_mem_host_pool_v2(dst, "kv")

            # the direct client reads the very objects the daemon wrote
            direct = mooncake_store(master, 0)
            # (each object is the page and its 16-byte checksum trailer: trailer.py)
            whole = page_bytes + TRAILER_BYTES
            stride = -(-whole // 64) * 64
            buf = Arena.create(f"/dev/shm/bench-l3-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                               2 * PAGES * stride)
            buf.tensor.fill_(0)
            base = buf.tensor.data_ptr()
            assert direct.register_buffer(base, buf.size_bytes) == 0
            ns = namespace_digest(NAMESPACE)
            names = [object_key(f"hicached/{FORMAT_PART}", ns, "kv", k) for k in keys]
            get_ptrs = [base + i * stride for i in range(PAGES)]
            put_ptrs = [base + PAGES * stride + i * stride for i in range(PAGES)]
            sizes = [whole] * PAGES

            times: dict[str, list[float]] = {"direct_put": [], "direct_get": [], "l2_cold": [],
                                             "l2_hit": [], "daemon_load": []}
            busy = [0, 0]  # machine CPU ticks (busy, all) during the direct gets
            for rep in range(reps + 1):  # rep 0 warms up
                fresh = [f"bench-direct/{rep}/{i}" for i in range(PAGES)]
                t = time.perf_counter()
                rcs = direct.batch_put_from(fresh, put_ptrs, sizes)
                put_s = time.perf_counter() - t
                assert rcs == [0] * PAGES, rcs
                direct.remove_by_regex("^bench-direct/", True)

                c.flush("l2")
                st0 = c.stats()
                assert st0["l2_pages"] == 0, {k: st0[k] for k in ("l2_pages", "leases", "parked_gets", "l3_tier")}
                b0, t0 = cpu_ticks()
                t = time.perf_counter()
                rcs = direct.batch_get_into(names, get_ptrs, sizes)
                get_s = time.perf_counter() - t
                b1, t1 = cpu_ticks()
                assert rcs == sizes, rcs
                if rep:
                    busy[0] += b1 - b0
                    busy[1] += t1 - t0

                t = time.perf_counter()
                res = c.batch_get_v2([PoolTransfer("kv", idx, keys=keys)])
                cold_s = time.perf_counter() - t
                assert all(res["kv"]), res
                # the daemon's own batch_get_into time in this get (the backend's counter)
                load_s = c.stats()["l3"]["get_s"] - st0["l3"]["get_s"]

                t = time.perf_counter()
                res = c.batch_get_v2([PoolTransfer("kv", idx, keys=keys)])
                hit_s = time.perf_counter() - t
                assert all(res["kv"]), res
                if rep:
                    for k, v in zip(times, (put_s, get_s, cold_s, hit_s, load_s)):
                        times[k].append(v)
            assert torch.equal(dst.kv_buffer, src.kv_buffer), "the daemon returned other bytes"
            flat = src.kv_buffer.view(torch.uint8).reshape(-1)
            for i in range(PAGES):
                got = buf.tensor[i * stride:i * stride + page_bytes]
                assert torch.equal(got, flat[i * page_bytes:(i + 1) * page_bytes]), \
                    "the direct get returned other bytes"
            st = c.stats()
            l3 = st["l3"]
        out = {k: gbps(nbytes, v) for k, v in times.items()}
        # A get through L2 moves each byte twice: the store's load into the arena, then the
        # client's copy out (an L2 hit's speed). Where the load already keeps every CPU busy
        # (loopback TCP here), the two cannot overlap, so no design that passes pages through
        # L2 beats direct / (direct + that copy): the bound the ratio is read against.
        d, h = out["direct_get"]["median"], out["l2_hit"]["median"]
        out.update(bytes_per_call=nbytes, page_bytes=page_bytes, reps=reps,
                   serial_bound=h / (h + d),
                   busy_during_direct=busy[0] / busy[1] if busy[1] else None,
                   write_through_s=write_through_s, l3_loads=st["l3_loads"],
                   daemon_l3_stats=l3, logs=logdir,
                   cold_over_direct=out["l2_cold"]["median"] / out["direct_get"]["median"])
        return out
    finally:
        if direct is not None:
            direct.close()
        if buf is not None:
            buf.close()
        procs.stop()


def bench_3fs(reps: int, daemon_args: str = "") -> dict:
    """The 3FS backend's POSIX path vs a plain file read of the same bytes (tools/bench_hf3fs.py),
    on /var/tmp (or $HICACHED_BENCH_3FS_DIR, e.g. a 3FS mount). No daemon: ``daemon_args`` is
    taken only so every section has one signature."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from bench_hf3fs import bench_hf3fs

    return bench_hf3fs(os.environ.get("HICACHED_BENCH_3FS_DIR", "/var/tmp"), 1 << 20, 256,
                       reps=reps)


def print_3fs(r: dict, reps: int) -> None:
    print(f"3FS backend ({r.get('io', 'posix')} path) vs plain file read: {r['n_pages']} pages of "
          f"{r['page_bytes'] // 1024} KiB, {reps} reps (median GB/s)")
    print(f"  plain preadv          {r['plain_preadv_gbps']['median']:6.2f}")
    print(f"  hf3fs batch_get       {r['hf3fs_get_gbps']['median']:6.2f}   "
          f"ratio {r['ratio']:.2f} x plain")


SECTIONS = {"mooncake": bench_mooncake, "3fs": bench_3fs, "checksum": bench_checksum}


def print_mooncake(r: dict, reps: int) -> None:
    print(f"Mooncake (TCP over loopback, segment in another process): {PAGES} pages x "
          f"{r['page_bytes'] // 1024} KiB = {r['bytes_per_call'] / 2**20:.0f} MiB per call, "
          f"{reps} reps (median / best GB/s)")
    rows = [("direct batch_put_from", "direct_put", ""),
            ("direct batch_get_into", "direct_get", "(registered buffer)"),
            ("daemon get, L2 cold", "l2_cold",
             f"ratio {r['cold_over_direct']:.2f} x direct (target >= 0.95)"),
            ("daemon get, L2 hit", "l2_hit", "(arena -> host pool only)")]
    for label, key, note in rows:
        print(f"  {label:22s} {r[key]['median']:6.2f} / {r[key]['best']:6.2f}   {note}")
    print(f"  (inside the daemon, its batch_get_into alone: {r['daemon_load']['median']:.2f} / "
          f"{r['daemon_load']['best']:.2f} GB/s over the same loads)")
    busy = r["busy_during_direct"]
    print(f"  serial bound {r['serial_bound']:.2f} x direct: the load, then the L2-hit copy, one "
          "after the other"
          + (f" (the machine's CPUs were {busy:.0%} busy during the direct loads)"
             if busy is not None else ""))
    print(f"  write-through of the {PAGES} pages after batch_set_v2: {r['write_through_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--section", choices=sorted(SECTIONS), action="append",
                    help="run only these sections (default: all)")
    ap.add_argument("--daemon-args", default="",
                    help="extra `hicached serve` options (mooncake section), "
                    'e.g. "--l3-load-chunk 8MiB"')
    ap.add_argument("--stores", default="file,mooncake",
                    help="checksum section: the L3 stores to measure (file, mooncake)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    set_stores([s.strip() for s in args.stores.split(",") if s.strip()])
    results = {name: SECTIONS[name](args.reps, args.daemon_args)
               for name in (args.section or SECTIONS)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, r in results.items():
        {"mooncake": print_mooncake, "3fs": print_3fs,
         "checksum": print_checksum}[name](r, args.reps)


if __name__ == "__main__":
    main()
