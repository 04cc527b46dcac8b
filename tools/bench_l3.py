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
    (the mooncake section needs pip install 'hicached[mooncake]')
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from hicached import Client, HostPool, PoolTransfer
from hicached.arena import Arena
from hicached.backends.integrity import identity_seed, page_digest
from hicached.backends.mooncake.trailer import FORMAT_PART, TRAILER_BYTES
from hicached.backends.mooncake.transfers import object_key
from hicached.daemon.sessions import namespace_digest
from hicached.errors import DaemonUnavailable

# Mooncake's C++ client logs each connection step at INFO: warnings only (as the daemon does)
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

PAGES, PAGE_SIZE, LAYERS, KV_DIM = 64, 64, 16, 512  # MLA bf16: 64*16*512*2 = 1 MiB a page
NAMESPACE = "bench-l3-mla-1mib"
SEGMENT = 512 * 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gbps(nbytes: int, seconds: list[float]) -> dict:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"median": statistics.median(rates), "best": max(rates)}


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far (/proc/stat; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(v) - v[3] - v[4], sum(v)  # idle and iowait are not busy


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


class Procs:
    """Background processes of one section, stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(os.path.join(self.logdir, f"{name}.log"), "ab") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


# ---------------------------------------------------------------- mooncake


def mooncake_store(master: str, segment: int):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * 2**20, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"Mooncake setup() returned {rc}")
    return s


# The segment provider, run as ``python -c PROVIDER master segment_bytes`` (no torch import):
# mount the segment, say ready, close on SIGTERM.
PROVIDER = """
import os, signal, sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
if rc != 0:
    sys.exit(f"setup() returned {rc}")
signal.signal(signal.SIGTERM, lambda *_: (s.close(), os._exit(0)))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def start_master_and_provider(procs: Procs) -> str:
    import mooncake

    port = free_port()
    procs.start("master", [os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"),
                           f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                           f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1"])

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            return False

    wait_for(listening, 30, "mooncake_master")
    master = f"127.0.0.1:{port}"
    procs.start("provider", [sys.executable, "-c", PROVIDER, master, str(SEGMENT)])
    log = pathlib.Path(procs.logdir, "provider.log")
    wait_for(lambda: b"ready" in log.read_bytes(), 60, "the segment provider")
    return master


def start_daemon(procs: Procs, master: str | None, extra: list[str], name: str = "daemon",
                 checksums: bool = True, key_prefix: str = "hicached") -> str:
    """A daemon on Mooncake (``master``) or, with None, on its file L3; ``checksums=False``
    turns L3 checksums off in it (``HICACHED_BENCH_NO_CHECKSUMS``: to measure their cost)."""
    endpoint = f"ipc://{procs.logdir}/{name}.sock"
    l3 = []
    if master is not None:
        opts = {"master_server_address": master, "protocol": "tcp", "global_segment_size": 0,
                "local_buffer_size": "16MiB", "local_hostname": "127.0.0.1", "timeout_s": 10,
                "key_prefix": key_prefix}
        l3 = ["--l3-backend", "mooncake", "--l3-options", json.dumps(opts)]
    procs.start(name, [sys.executable, "-m", "hicached", "serve", "--endpoint", endpoint,
                       "--l2-size", "512MiB", "--state-dir", f"{procs.logdir}/{name}-state",
                       *l3, "--log-level", "warning", *extra],
                env=None if checksums else {"HICACHED_BENCH_NO_CHECKSUMS": "1"})

    def up() -> bool:
        try:
            with Client(endpoint, "probe", timeout_s=1.0) as c:
                c.ping()
            return True
        except DaemonUnavailable:
            return False

    wait_for(up, 60, "the daemon")
    return endpoint


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
                        for what in paired:
                            paired[what].append(this[f"{what}_off"] / this[f"{what}_on"])
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
    CHECKSUM_STORES[:] = [s.strip() for s in args.stores.split(",") if s.strip()]
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
