"""Index benchmark (issue 24): exists latency, daemon heap per page, set / get / mixed load at 1M pages.

One run per source tree, a real daemon each (L3 off, so the index is what is measured; the
presence table at the daemon's DEFAULT sizing: pass ``--daemon-args "--presence-slots N"`` to
try another), on an ipc socket in a temp dir, 4 KiB pages (MLA: 1 token x 1 layer x 2048 bf16),
64-hex keys (blake2b digests, as SGLang's chained page hashes):

  fill to --first pages (10k)    sets of --set-batch pages (128, SGLang's largest) from one
                                 client, into two daemons of the same settings (arena, table)
  fill to --pages (1M)           timed, the first daemon only: the set throughput (pages/s,
                                 GB/s) while the index grows
  exists @ 10k and @ 1M          batch_exists_v2 of 1024 fresh keys (512 stored at random, then
                                 512 never stored), --exists-samples calls on each path of each
                                 daemon, interleaved (the daemon at 10k pages, then the one at
                                 1M, each through the presence table (the default client) and
                                 through the socket (a client with shared_exists=False)), once
                                 both daemons are idle: a shared VM's speed drifts over the
                                 fill's half minute, and side by side the ratio is the index
                                 size's alone. "from table" says whether the table still
                                 answered (a full table, F_OVERFLOW, sends every exists to the
                                 socket). The daemon at 10k then stops.
  get @ 1M                       --get-batches calls of 64 stored pages drawn at random (leased:
                                 4 KiB pages are below the slot-tag grain, so no shared gets)
  RssAnon                        the daemon's /proc/PID/status RssAnon (its heap: not the shared
                                 arena or table) after the clients registered, at 10k and at 1M;
                                 heap per indexed page = (at 1M - before) / pages
  mixed load                     --clients processes (16), each its own Client, for --seconds:
                                 50 % exists of 64 keys (32 stored at random, 32 fresh), 25 % get
                                 of 16 stored pages at random, 25 % set of 16 new pages; total
                                 ops/s and p50 / p99 per kind. Stored keys for the mix are drawn
                                 from the newer half of the index: the arena has ~5 % headroom,
                                 and the mix's sets evict the oldest pages past it. --mix-runs N
                                 mixes in a row: the medians, each run's ops/s, and the daemon's
                                 CPU (cores) meanwhile; --spin-s: the clients' spin_s

``--baseline PATH`` (repeatable; ``--tree`` is the same) runs it all again against another source
tree, one tree after the other (two trees' arenas at once would crowd the machine): the daemon,
this script's measuring process and the mixed-load clients all run with ``PYTHONPATH=PATH``, so
that tree's client code is measured too. The table prints each metric per tree and the ratio
current / baseline. Targets (issue 24): exists p50 at 1M <= 1.3 x its 10k value on both paths;
<= 250 bytes of daemon heap per indexed page; the mixed load's ops/s and p99 no worse than the
baseline's.

    python tools/bench_index.py [--baseline /path/to/old/tree] [--pages 1000000] [--json]
    python tools/bench_index.py --small      # 2k pages, 2 clients, 2 s: a check that it runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time

PAGE_BYTES = 4096
KV_DIM = PAGE_BYTES // 2  # bf16: one token of one layer, 2048 elements = 4 KiB
SLAB_BYTES = 64 << 20  # the daemon's default slab: the arena is a whole number of them
HEADROOM = 1.05  # arena over the filled pages: room for the mixed load's first sets
NS = "bench-index"
MIX = (("exists", 0.50), ("get", 0.25), ("set", 0.25))
MIX_EXISTS_KEYS, MIX_PAGES = 64, 16
EXISTS_KEYS = 1024
HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # its table: bench_index_table.py, beside it
from bench_index_table import print_table


def key(tag: str, i: int) -> str:
    """A 64-hex key: ``tag`` 's' stored by the fill, 'a' never stored, 'w<n>' the mix's sets."""
    return hashlib.blake2b(f"{tag}{i}".encode(), digest_size=32).hexdigest()


def rss_anon(pid: int) -> int:
    """The process's anonymous resident bytes (its heap; shared memory is RssShmem)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no RssAnon in /proc/{pid}/status")


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system, /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int, limit_s: float = 30.0) -> float:
    """Wait until the daemon is idle (under 5 % of a core over 0.25 s: the fill's last commits
    and idle-turn work done), at most ``limit_s``; the seconds waited. Latencies measured while
    the daemon still works on the fill would measure the fill."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        cpu = cpu_s(pid)
        time.sleep(0.25)
        if cpu_s(pid) - cpu < 0.0125:
            break
    return time.monotonic() - t0


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank below (as bench_l2's p99)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(len(s) * q + 0.5) - 1))] if s else float("nan")


def progress(msg: str) -> None:
    print(f"[bench_index {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------- the measuring process


def start_daemon(tmp: str, l2_size: str, extra: list[str], name: str = "bench"):
    """``python -m hicached serve`` (this process's PYTHONPATH: the tree measured) on an ipc
    socket ``name`` in ``tmp``, L3 off; (process, endpoint) once it answers a ping."""
    from hicached import Client
    from hicached.errors import DaemonUnavailable

    endpoint = f"ipc://{tmp}/{name}.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--endpoint", endpoint, "--l2-size", l2_size,
         "--state-dir", f"{tmp}/{name}-state", "--l3-backend", "none", "--log-level", "warning", *extra],
        stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with Client(endpoint, "probe", timeout_s=1.0) as c:
                c.ping()
            return proc, endpoint
        except DaemonUnavailable:
            time.sleep(0.1)
    stop(proc)
    raise SystemExit("daemon did not start (is /dev/shm full of arenas of killed daemons? "
                     "see `df -h /dev/shm`)")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (not SIGKILL: the daemon removes its arena file on the way out), then wait."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_client(endpoint: str, pages: int, **kw):
    """A client in the bench namespace with a kv pool of ``pages`` 4 KiB pages of noise."""
    import torch

    from hicached import Client, HostPool

    c = Client(endpoint, NS, timeout_s=30.0, **kw)
    pool = HostPool.allocate_mla(pages, 1, 1, KV_DIM, dtype=torch.bfloat16)
    pool.kv_buffer.normal_()
    c.register_mem_host_pool_v2(pool, "kv")
    assert pool.page_bytes == PAGE_BYTES, pool.page_bytes
    return c


def fill(c, start: int, end: int, batch: int) -> float:
    """Set stored keys [start, end) in calls of ``batch`` pages; the seconds the calls took
    (keys are made between the calls, outside the time)."""
    import torch

    from hicached import PoolTransfer

    spent, step, last = 0.0, max(1, (end - start) // 10), start
    for lo in range(start, end, batch):
        n = min(batch, end - lo)
        keys = [key("s", i) for i in range(lo, lo + n)]
        t = time.perf_counter()
        res = c.batch_set_v2([PoolTransfer("kv", torch.arange(n), keys=keys)])
        spent += time.perf_counter() - t
        if not all(res["kv"]):
            raise SystemExit(f"set of pages {lo}..{lo + n} failed: arena full? {res['kv'][:8]}")
        if lo + n - last >= step and end - start >= 100_000:
            last = lo + n
            progress(f"  filled {lo + n} pages ({(lo + n - start) / spent:,.0f} pages/s)")
    return spent


def exists_side_by_side(points: dict, samples: int, rng: random.Random,
                        fresh: list[int]) -> dict:
    """exists of 1024 fresh keys (512 stored, then 512 never stored), ``samples`` calls per
    point and path, all interleaved; ``points``: name -> (table client, socket client, pages
    stored) of one daemon. Per point: p50 / p99 in ms per path, and whether the table
    answered."""
    lat = {name: {"table": [], "socket": []} for name in points}
    half = EXISTS_KEYS // 2
    for i in range(samples + 10):  # 10 warm-up calls per point and path
        for name, (table_c, socket_c, stored) in points.items():
            for path, c in (("table", table_c), ("socket", socket_c)):
                keys = [key("s", j) for j in rng.sample(range(stored), half)]
                keys += [key("a", fresh[0] + j) for j in range(half)]
                fresh[0] += half
                t = time.perf_counter()
                r = c.batch_exists_v2(keys)
                dt = time.perf_counter() - t
                if r.kv_hit_pages != half:
                    raise SystemExit(f"exists ({name}, {path}) found {r.kv_hit_pages} pages, "
                                     f"not {half}")
                if i >= 10:
                    lat[name][path].append(dt * 1e3)
    out = {}
    for name, (table_c, _, _) in points.items():
        shared = table_c._conn.shared  # (client internals: was the table there and usable?)
        out[name] = {path: {"p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99)}
                     for path, v in lat[name].items()}
        out[name]["from_table"] = shared is not None and shared.view.usable() is not None
    return out


def get_batches(c, stored: int, batches: int, rng: random.Random) -> dict:
    """``batches`` gets of 64 stored pages drawn at random: pages/s, GB/s, p50 / p99 a call."""
    import torch

    from hicached import PoolTransfer

    lat = []
    idx = torch.arange(64)
    for i in range(batches + 5):
        keys = [key("s", j) for j in rng.sample(range(stored), 64)]
        t = time.perf_counter()
        res = c.batch_get_v2([PoolTransfer("kv", idx, keys=keys)])
        dt = time.perf_counter() - t
        if not all(res["kv"]):
            raise SystemExit(f"get of stored pages missed {res['kv'].count(False)} of 64")
        if i >= 5:
            lat.append(dt)
    total = sum(lat)
    return {"pages_per_s": 64 * batches / total, "gbps": 64 * batches * PAGE_BYTES / total / 1e9,
            "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3}


def mixed_load(endpoint: str, stored: int, clients: int, seconds: float,
               spin_s: float | None = None, rate: float = 0.0) -> dict:
    """``clients`` worker processes (this script, ``--mix-worker``) started together (``spin_s``:
    their ``Client(spin_s=...)``, None: the client's default; ``rate``: ops/s offered by all
    of them together, 0: each starts its next op when the last ends)."""
    procs = []
    try:
        for n in range(clients):
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE), "--mix-worker", endpoint, str(n), str(stored),
                 str(seconds), "" if spin_s is None else str(spin_s), str(rate / clients)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:  # each says "ready" once connected and registered
            if p.stdout.readline().strip() != "ready":
                raise SystemExit(f"mix worker exited with {p.wait()} before it was ready")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 120)
            if p.returncode:
                raise SystemExit(f"mix worker exited with {p.returncode}")
            outs.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lat = {kind: [x for o in outs for x in o["lat_ms"][kind]] for kind, _ in MIX}
    ops = sum(len(v) for v in lat.values())
    elapsed = max(o["elapsed_s"] for o in outs)
    got = sum(o["get_hits"] for o in outs)
    return {"clients": clients, "seconds": elapsed, "rate": rate, "ops": ops,
            "ops_per_s": ops / elapsed,
            "get_hit_share": got / max(1, MIX_PAGES * len(lat["get"])),
            **{kind: {"count": len(v), "p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99)}
               for kind, v in lat.items()}}


def mix_worker(endpoint: str, n: int, stored: int, seconds: float,
               spin_s: float | None = None, rate: float = 0.0) -> None:
    """One mixed-load client: connects, says "ready", waits for "go", runs ``seconds``, prints
    its latencies per kind as JSON. Stored keys from the newer half of the index. ``rate`` >
    0: ops start at Poisson arrivals of that many a second, and an op's latency counts from
    its arrival (an op that starts late waited in the client's queue: that counts too)."""
    import torch

    from hicached import PoolTransfer

    torch.set_num_threads(1)  # 16 KiB copies: no use for more, and idle threads spin
    rng = random.Random(1000 + n)
    lo = stored // 2
    c = make_client(endpoint, MIX_PAGES, **({} if spin_s is None else {"spin_s": spin_s}))
    idx = torch.arange(MIX_PAGES)
    lat: dict[str, list[float]] = {kind: [] for kind, _ in MIX}
    kinds, weights = zip(*MIX, strict=True)
    fresh = written = hits = 0
    arrivals = random.Random(5000 + n)
    print("ready", flush=True)
    sys.stdin.readline()
    start = due = time.perf_counter()
    end = start + seconds
    while (now := time.perf_counter()) < end:
        if rate > 0:
            due += arrivals.expovariate(rate)
            if due >= end:
                break
            if due > now:
                time.sleep(due - now)
        kind = rng.choices(kinds, weights)[0]
        if kind == "exists":
            half = MIX_EXISTS_KEYS // 2
            keys = [key("s", rng.randrange(lo, stored)) for _ in range(half)]
            keys += [key(f"a{n}-", fresh + j) for j in range(half)]
            fresh += half
            t = time.perf_counter()
            c.batch_exists_v2(keys)
        elif kind == "get":
            keys = [key("s", rng.randrange(lo, stored)) for _ in range(MIX_PAGES)]
            t = time.perf_counter()
            hits += sum(c.batch_get_v2([PoolTransfer("kv", idx, keys=keys)])["kv"])
        else:
            keys = [key(f"w{n}-", written + j) for j in range(MIX_PAGES)]
            written += MIX_PAGES
            t = time.perf_counter()
            c.batch_set_v2([PoolTransfer("kv", idx, keys=keys)])
        lat[kind].append(round((time.perf_counter() - (due if rate > 0 else t)) * 1e3, 4))
    elapsed = (end if rate > 0 else now) - start
    c.close()
    print(json.dumps({"lat_ms": lat, "elapsed_s": elapsed, "get_hits": hits}), flush=True)


def measure(args) -> dict:
    """Every phase against the daemons of the tree this process imports ``hicached`` from: one
    filled to ``pages``, and one left at ``first`` for the exists side by side."""
    import torch

    import hicached

    torch.set_num_threads(1)
    pages, first = args.pages, min(args.first, args.pages)
    slabs = -(-int(pages * PAGE_BYTES * HEADROOM) // SLAB_BYTES)
    l2_size = f"{slabs * SLAB_BYTES >> 20}MiB"
    rng, fresh = random.Random(7), [0]
    out: dict = {"tree": str(pathlib.Path(hicached.__file__).resolve().parent.parent),
                 "pages": pages, "first": first, "l2_size": l2_size}
    extra = shlex.split(args.daemon_args)
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        proc, endpoint = start_daemon(tmp, l2_size, extra)
        sproc = None
        try:
            sproc, sendpoint = start_daemon(tmp, l2_size, extra, "first")  # stays at 10k
            c = make_client(endpoint, args.set_batch)
            cs = make_client(endpoint, 64, shared_exists=False)
            s = make_client(sendpoint, args.set_batch)
            ss = make_client(sendpoint, 64, shared_exists=False)
            out["rss_before"] = rss_anon(proc.pid)
            progress(f"{out['tree']}: daemons up ({l2_size} arenas); filling {first} pages")
            fill(c, 0, first, args.set_batch)
            fill(s, 0, first, args.set_batch)
            out["rss_first"] = rss_anon(proc.pid)
            progress(f"filling {first} -> {pages} pages")
            spent = fill(c, first, pages, args.set_batch)
            out["set"] = {"pages_per_s": (pages - first) / spent,
                          "gbps": (pages - first) * PAGE_BYTES / spent / 1e9}
            out["rss_full"] = rss_anon(proc.pid)
            out["heap_bytes_per_page"] = (out["rss_full"] - out["rss_before"]) / pages
            out["settle_s"] = settle(proc.pid) + settle(sproc.pid)
            progress(f"exists at {first} and {pages} pages, side by side (the daemons settled "
                     f"in {out['settle_s']:.2f} s)")
            ex = exists_side_by_side({"first": (s, ss, first), "full": (c, cs, pages)},
                                     args.exists_samples, rng, fresh)
            out["exists_first"], out["exists_full"] = ex["first"], ex["full"]
            s.close()
            ss.close()
            stop(sproc)
            out["presence_full"] = c.stats().get("presence")
            progress(f"get at {pages} pages")
            out["get"] = get_batches(c, pages, args.get_batches, rng)
            runs = []
            for i in range(args.mix_runs):
                progress(f"mixed load {i + 1}/{args.mix_runs}: {args.clients} clients, "
                         f"{args.seconds} s")
                cpu = cpu_s(proc.pid)
                runs.append(mixed_load(endpoint, pages, args.clients, args.seconds, args.spin_s,
                                       args.mix_rate))
                runs[-1]["daemon_cores"] = (cpu_s(proc.pid) - cpu) / runs[-1]["seconds"]
            out["mixed"] = median_mix(runs)
            st = c.stats()
            out["evictions"], out["l2_pages_end"] = st.get("evictions"), st.get("l2_pages")
            c.close()
            cs.close()
        finally:
            stop(proc)
            if sproc is not None:
                stop(sproc)
    return out


def median_mix(runs: list[dict]) -> dict:
    """Several mixed loads on one daemon as one: the median of each figure (ops/s, each
    kind's p50 and p99, the daemon's cores), with every run's ops/s in ``runs_ops_per_s``."""
    out = dict(runs[0], runs_ops_per_s=[r["ops_per_s"] for r in runs])
    for name in ("ops_per_s", "get_hit_share", "daemon_cores"):
        out[name] = pct([r[name] for r in runs], 0.5)
    for kind, _ in MIX:
        out[kind] = {q: pct([r[kind][q] for r in runs], 0.5) for q in runs[0][kind]}
    return out


# ----------------------------------------------------------------- one run per tree


def run_tree(tree: pathlib.Path, argv: list[str]) -> dict:
    """This script's ``--measure`` with ``PYTHONPATH=tree``, run in ``tree`` (daemon and clients
    inherit both: ``python -m`` puts the working directory first on the path, before
    PYTHONPATH, so a daemon started elsewhere would run that directory's code)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, str(HERE), "--measure", *argv], env=env,
                            cwd=str(tree), stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate()
    except KeyboardInterrupt:  # it got the Ctrl-C too: let it stop its daemon and clients
        proc.wait(90)
        print("bench_index: interrupted", file=sys.stderr)
        raise
    if proc.returncode:
        raise SystemExit(f"the run against {tree} failed ({proc.returncode})")
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=1_000_000, help="pages indexed at the end")
    ap.add_argument("--first", type=int, default=10_000, help="pages at the first measurement")
    ap.add_argument("--set-batch", type=int, default=128, help="pages a fill call sets")
    ap.add_argument("--exists-samples", type=int, default=200, help="exists calls per path")
    ap.add_argument("--get-batches", type=int, default=500, help="gets of 64 pages at 1M")
    ap.add_argument("--clients", type=int, default=16, help="mixed-load client processes")
    ap.add_argument("--seconds", type=float, default=15.0, help="mixed-load duration")
    ap.add_argument("--mix-runs", type=int, default=1,
                    help="mixed loads in a row on each daemon (the table shows medians)")
    ap.add_argument("--spin-s", type=float, default=None,
                    help="the mixed-load clients' Client(spin_s=...) (default: the client's)")
    ap.add_argument("--mix-rate", type=float, default=0.0,
                    help="ops/s the mixed load offers (Poisson arrivals; latencies count from "
                         "each op's arrival); 0: closed loop, each client's next op at once")
    ap.add_argument("--small", action="store_true",
                    help="a tiny run: 2k pages (1k first), 20 samples, 2 clients for 2 s")
    ap.add_argument("--daemon-args", default="", help="more `hicached serve` options")
    ap.add_argument("--baseline", "--tree", action="append", default=[], metavar="PATH",
                    help="another source tree to measure in the same run (repeatable)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mix-worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small:  # its own defaults; flags given still win
        ap.set_defaults(pages=2000, first=1000, exists_samples=20, get_batches=20, clients=2,
                        seconds=2.0)
        args = ap.parse_args()
    if args.mix_worker:
        endpoint, n, stored, seconds, spin_s, rate = args.mix_worker
        mix_worker(endpoint, int(n), int(stored), float(seconds),
                   float(spin_s) if spin_s else None, float(rate))
        return
    if args.measure:
        # SIGTERM like Ctrl-C: the finally blocks stop the daemon and the mix's clients
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print(json.dumps(measure(args)))
        return
    argv = ["--pages", str(args.pages), "--first", str(args.first), "--set-batch",
            str(args.set_batch), "--exists-samples", str(args.exists_samples), "--get-batches",
            str(args.get_batches), "--clients", str(args.clients), "--seconds",
            str(args.seconds), "--mix-runs", str(args.mix_runs), "--mix-rate", str(args.mix_rate),
            f"--daemon-args={args.daemon_args}"]
    if args.spin_s is not None:
        argv += ["--spin-s", str(args.spin_s)]
    trees = [HERE.parent.parent] + [pathlib.Path(p).resolve() for p in args.baseline]
    results = [run_tree(t, argv) for t in trees]  # one after another: one big arena at a time
    if args.json:
        print(json.dumps({"trees": results}, indent=2))
    else:
        print_table(results, args.daemon_args)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # every process of the run gets it; finally blocks stopped daemons
        sys.exit(130)
