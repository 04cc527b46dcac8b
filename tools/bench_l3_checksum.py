"""Section ``checksum`` of ``bench_l3.py``: what L3 checksums cost. The hash's own GB/s, then
four daemons side by side, two with checksums and two without (``HICACHED_BENCH_NO_CHECKSUMS``):
64 MiB written through to L3 and got back cold, on the file L3 and (with the Mooncake client
installed) on Mooncake, with the machine's CPU use during the runs without. Target: on / off
>= 0.90."""

from __future__ import annotations

import shlex
import statistics
import tempfile
import time

import torch
from l3_harness import (
    KV_DIM,
    LAYERS,
    NAMESPACE,
    PAGE_SIZE,
    PAGES,
    Procs,
    cpu_ticks,
    gbps,
    start_daemon,
    start_master_and_provider,
)

from hicached import Client, HostPool, PoolTransfer
from hicached.backends.integrity import identity_seed, page_digest


def hash_speed(page_bytes: int = 256 << 10, total: int = 512 << 20) -> dict:
    """The checksum's own GB/s here: XXH3-64 over pages that are not in any CPU cache (a
    512 MiB buffer walked once per rep) and over one page again and again (in cache)."""
    data = torch.randint(0, 256, (total,), dtype=torch.uint8).numpy()
    seed = identity_seed("ns", "kv", "key", page_bytes)
    cold, warm = [], []
    for _ in range(3):
        t = time.perf_counter()
        for off in range(0, total, page_bytes):
            page_digest(seed, data[off:off + page_bytes])
        cold.append(time.perf_counter() - t)
        page = data[:page_bytes]
        t = time.perf_counter()
        for _ in range(total // page_bytes):
            page_digest(seed, page)
        warm.append(time.perf_counter() - t)
    return {"cold": total / min(cold) / 1e9, "in_cache": total / min(warm) / 1e9,
            "page_bytes": page_bytes}


def _pair_run(c: Client, src: HostPool, rep: int, tag: str,
              busy: dict[str, list[int]] | None = None) -> tuple[float, float]:
    """One rep on one daemon: batch_set_v2 of PAGES fresh pages and the time until L3 has
    them all (the write), then an L2 flush and a cold batch_get_v2 of them (L3 -> L2 -> here).
    ``busy``: the machine's CPU ticks (busy, all) during each are added to its "write" and
    "get"."""
    keys = [f"{tag}-{rep}-{i}" for i in range(PAGES)]
    idx = torch.arange(PAGES * PAGE_SIZE)
    ticks = [cpu_ticks()]
    t = time.perf_counter()
    assert all(c.batch_set_v2([PoolTransfer("kv", idx, keys=keys)])["kv"])
    # the daemon answers once L3 holds them all (no polling: a stats call a millisecond took
    # the daemon's loop and the client's core from the write it was timing)
    c.wait_stored([PoolTransfer("kv", idx, keys=keys)], timeout_s=120)
    write_s = time.perf_counter() - t
    ticks.append(cpu_ticks())
    c.flush("l2")
    ticks.append(cpu_ticks())
    t = time.perf_counter()
    res = c.batch_get_v2([PoolTransfer("kv", idx, keys=keys)])
    get_s = time.perf_counter() - t
    ticks.append(cpu_ticks())
    if busy is not None:
        for what, (a, b) in (("write", ticks[:2]), ("get", ticks[2:])):
            busy[what][0] += b[0] - a[0]
            busy[what][1] += b[1] - a[1]
    assert all(res["kv"]), res
    c.flush("l3")  # room for the next rep (a Mooncake segment holds a few reps only)
    return write_s, get_s


def bench_checksum(reps: int, daemon_args: str = "") -> dict:
    """What L3 checksums cost: daemons side by side, two with checksums and two without
    (``HICACHED_BENCH_NO_CHECKSUMS``), each rep on all four in turn: the write-through of 64 MiB
    (hashed on the writer thread) and a cold get of it (read, verified, then copied out). On
    the file L3 (page cache: the store is as fast as memory, the worst case for the hash) and,
    where the Mooncake client is installed, on Mooncake over loopback TCP."""
    out: dict = {"hash_gbps": hash_speed()}
    stores = [s for s in CHECKSUM_STORES if s == "file" or _has_mooncake()]
    for store in stores:
        logdir = tempfile.mkdtemp(prefix=f"bench-sum-{store}-")
        procs = Procs(logdir)
        try:
            master = start_master_and_provider(procs) if store == "mooncake" else None
            # two daemons of each kind, started and run in mirrored order: a daemon's own
            # place (its start, its files, its arena) moves its figures by more than the
            # checksums do, so neither kind may own one place
            kinds = [("a", True), ("b", False), ("c", False), ("d", True)]
            ends = {name: start_daemon(procs, master, shlex.split(daemon_args), name=name,
                                       checksums=on, key_prefix=name) for name, on in kinds}
            times = {f"{what}_{on}": [] for what in ("write", "get") for on in ("on", "off")}
            clients = {name: Client(ends[name], NAMESPACE) for name, _ in kinds}
            try:
                src = HostPool.allocate_mla(PAGES, PAGE_SIZE, LAYERS, KV_DIM,
                                            dtype=torch.bfloat16)
                src.kv_buffer.normal_()
                for c in clients.values():
                    c.register_mem_host_pool_v2(src, "kv")
                paired = {"write": [], "get": []}  # per rep: off time / on time
                idle_off = {"write": [0, 0], "get": [0, 0]}  # CPU ticks in the runs without
                for rep in range(reps + 1):  # rep 0 warms up
                    turn = kinds[rep % 4:] + kinds[:rep % 4]
                    this = {f"{what}_{on}": 0.0 for what in ("write", "get")
                            for on in ("on", "off")}
                    for name, on in turn:
                        w, g = _pair_run(clients[name], src, rep, name,
                                         idle_off if rep and not on else None)
                        if rep:
                            tag = "on" if on else "off"
                            times[f"write_{tag}"].append(w)
                            times[f"get_{tag}"].append(g)
                            this[f"write_{tag}"] += w
                            this[f"get_{tag}"] += g
                    if rep:  # the four runs of a rep lie within a second of each other
                        for what, ratios in paired.items():
                            ratios.append(this[f"{what}_off"] / this[f"{what}_on"])
            finally:
                for c in clients.values():
                    c.close()
            nbytes = PAGES * src.page_bytes
            r = {k: gbps(nbytes, v) for k, v in times.items()}
            r["get_on_over_off"] = r["get_on"]["median"] / r["get_off"]["median"]
            r["write_on_over_off"] = r["write_on"]["median"] / r["write_off"]["median"]
            for what, ratios in paired.items():
                r[f"{what}_paired"] = statistics.median(ratios)
                b, all_ = idle_off[what]
                # where every CPU is busy without checksums, the hash's CPU time adds to the
                # wall time whatever overlaps it: the hash's own cost (cold) over the cores
                r[f"{what}_busy_off"] = b / all_ if all_ else None
            out[store] = r
        finally:
            procs.stop()
    return out


CHECKSUM_STORES = ["file", "mooncake"]  # --stores


def set_stores(stores: list[str]) -> None:
    """The stores the section measures (``--stores``)."""
    CHECKSUM_STORES[:] = stores


def _has_mooncake() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return True


def print_checksum(r: dict, reps: int) -> None:
    h = r["hash_gbps"]
    print(f"L3 checksums (XXH3-64 bound to the page's identity), {reps} reps of {PAGES} pages "
          f"x 1 MiB, daemons with and without them side by side (median GB/s)")
    print(f"  the hash alone here: {h['cold']:.1f} GB/s on {h['page_bytes'] >> 10} KiB pages "
          f"not in cache, {h['in_cache']:.1f} GB/s in cache")
    for store in ("file", "mooncake"):
        if store not in r:
            continue
        s = r[store]
        print(f"  {store:8s} cold get (L3 -> L2 -> client)  on {s['get_on']['median']:6.2f}  "
              f"off {s['get_off']['median']:6.2f}   ratio {s['get_on_over_off']:.2f}, "
              f"paired {s['get_paired']:.2f} (target >= 0.90)")
        print(f"  {store:8s} L3 write (write-through)     on {s['write_on']['median']:6.2f}  "
              f"off {s['write_off']['median']:6.2f}   ratio {s['write_on_over_off']:.2f}, "
              f"paired {s['write_paired']:.2f} (target >= 0.90)")
        if s.get("get_busy_off") is not None:
            print(f"  {store:8s} the machine's CPUs busy without checksums: "
                  f"{s['write_busy_off']:.0%} during the writes, {s['get_busy_off']:.0%} "
                  f"during the gets (where none is idle, the hash's CPU time cannot be hidden)")
    print("  (ratio: of the medians; paired: the median over reps of each rep's own ratio, "
          "its four runs taken within a second)")
