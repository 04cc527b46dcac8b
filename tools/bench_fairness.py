"""Fairness benchmark (issue 45, item 6): do one client's huge calls stall everyone else's small ones?

A real daemon (``python -m hicached serve``, L3 off) on an ipc socket in a temp dir, 4 KiB
pages, 64-hex keys, and client processes of this script:

  small clients   --clients processes (4), each its own Client, in a loop for the whole run:
                  exists of --small-keys keys (8: half stored, half never stored), get of
                  --small-pages stored pages (4), set of --small-pages new pages, one after the
                  other, --think-ms (1) apart. Every call goes through the daemon's socket
                  (``shared_exists=False``, ``shared_gets=False``): the daemon's loop is what is
                  measured, not the presence table that answers most exists in production.
  huge client     one process that first sets new pages until the arena was filled once over
                  (the daemon in its steady state: evicting, its index grown to its size), then,
                  while told to, repeats: exists of --huge-keys keys (16384, the last set's), set
                  of --huge-keys new pages, get of those pages (leased, ``remember_pages=0``);
                  each call's time is recorded.

The run alternates windows of --seconds (2) each, --rounds (4) times: the small clients alone,
then the small clients with the huge client. A small call counts in the window its start falls
in. Printed side by side: the small calls' p50 / p99 (all kinds together, then per kind) in
each kind of window, and the ratio with / alone (target: p99 within 2x), and the huge calls'
own times. Alternating windows in one run keeps a shared machine's drift out of the ratio.

    python tools/bench_fairness.py [--clients 4] [--huge-keys 16384] [--rounds 4] [--json]
    python tools/bench_fairness.py --small      # 2 clients, 1024-key huge calls: a check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

PAGE_BYTES = 4096
KV_DIM = PAGE_BYTES // 2  # bf16: one token of one layer, 2048 elements = 4 KiB
NS = "bench-fairness"
KINDS = ("exists", "get", "set")
HUGE_KINDS = ("exists", "set", "get")
HERE = pathlib.Path(__file__).resolve()


def key(tag: str, i: int) -> str:
    """A 64-hex key, as SGLang's chained page hashes."""
    return hashlib.blake2b(f"{tag}{i}".encode(), digest_size=32).hexdigest()


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank below (as bench_index's)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(len(s) * q + 0.5) - 1))] if s else float("nan")


def progress(msg: str) -> None:
    print(f"[bench_fairness {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------- the daemon


def start_daemon(tmp: str, l2_size: str, extra: list[str]):
    """``python -m hicached serve`` (this process's PYTHONPATH) on an ipc socket in ``tmp``, L3
    off; (process, endpoint) once it answers a ping."""
    from hicached import Client
    from hicached.errors import DaemonUnavailable

    endpoint = f"ipc://{tmp}/fair.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--endpoint", endpoint, "--l2-size", l2_size,
         "--state-dir", f"{tmp}/state", "--l3-backend", "none", "--log-level", "warning",
         *extra], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with Client(endpoint, "probe", timeout_s=1.0) as c:
                c.ping()
            return proc, endpoint
        except DaemonUnavailable:
            time.sleep(0.1)
    stop(proc)
    raise SystemExit("daemon did not start (see `df -h /dev/shm`)")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the daemon removes its arena file on the way out), then wait."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_client(endpoint: str, pages: int, **kw):
    """A client of the bench namespace, every call through the socket, with a kv pool of
    ``pages`` 4 KiB pages of noise."""
    import torch

    from hicached import Client, HostPool

    c = Client(endpoint, NS, timeout_s=60.0, shared_exists=False, shared_gets=False, **kw)
    pool = HostPool.allocate_mla(pages, 1, 1, KV_DIM, dtype=torch.bfloat16)
    pool.kv_buffer.normal_()
    c.register_mem_host_pool_v2(pool, "kv")
    assert pool.page_bytes == PAGE_BYTES, pool.page_bytes
    return c


# ----------------------------------------------------------------- the workers


def small_worker(endpoint: str, n: int, keys: int, pages: int, think_s: float) -> None:
    """One small client: stores its own pages, says "ready", waits for "go", loops (exists,
    get, set) until a line "stop" arrives, then prints its calls as JSON: per call its start
    (``time.monotonic``, comparable across the processes of a machine), kind and ms."""
    import threading

    import torch

    from hicached import PoolTransfer

    torch.set_num_threads(1)
    c = make_client(endpoint, max(pages, 1))
    idx = torch.arange(pages)
    stored = [key(f"s{n}-", i) for i in range(64)]
    for lo in range(0, len(stored), pages):
        c.batch_set_v2([PoolTransfer("kv", idx[:len(stored[lo:lo + pages])],
                                     keys=stored[lo:lo + pages])])
    print("ready", flush=True)
    sys.stdin.readline()
    stopped = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stopped.set()), daemon=True).start()
    calls: list[tuple[float, str, float]] = []
    i = fresh = written = 0
    half = keys // 2
    while not stopped.is_set():
        kind = KINDS[i % 3]
        i += 1
        if kind == "exists":
            ks = [stored[(i + j) % len(stored)] for j in range(keys - half)]
            ks += [key(f"a{n}-", fresh + j) for j in range(half)]
            fresh += half
            t = time.monotonic()
            c.batch_exists_v2(ks)
        elif kind == "get":
            ks = [stored[(i + j) % len(stored)] for j in range(pages)]
            t = time.monotonic()
            c.batch_get_v2([PoolTransfer("kv", idx, keys=ks)])
        else:
            ks = [key(f"w{n}-", written + j) for j in range(pages)]
            written += pages
            t = time.monotonic()
            c.batch_set_v2([PoolTransfer("kv", idx, keys=ks)])
        calls.append((t, kind, round((time.monotonic() - t) * 1e3, 4)))
        if think_s:
            time.sleep(think_s)
    c.close()
    print(json.dumps(calls), flush=True)


def huge_worker(endpoint: str, keys: int, warmup: int) -> None:
    """The huge client: sets ``warmup`` calls of ``keys`` new pages (the daemon in its steady
    state: the arena full, the index grown to its size), says "ready"; for each line "go
    SECONDS" repeats (exists, set, get) of ``keys`` keys until SECONDS have passed (the cycle
    under way is finished), then prints its calls as JSON; "stop" (or EOF) ends it."""
    import torch

    from hicached import PoolTransfer

    torch.set_num_threads(1)
    c = make_client(endpoint, keys, remember_pages=0)
    idx = torch.arange(keys)
    for w in range(warmup):
        c.batch_set_v2([PoolTransfer("kv", idx, keys=[key(f"warm{w}-", i)
                                                      for i in range(keys)])])
    cycle = 0
    last = [key("h-none-", i) for i in range(keys)]  # nothing stored yet: the first exists
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.startswith("go"):
            break
        end = time.monotonic() + float(line.split()[1])
        calls: list[tuple[float, str, float]] = []
        while time.monotonic() < end:
            new = [key(f"h{cycle}-", i) for i in range(keys)]
            cycle += 1
            for kind in HUGE_KINDS:
                t = time.monotonic()
                if kind == "exists":
                    c.batch_exists_v2(last)
                elif kind == "set":
                    c.batch_set_v2([PoolTransfer("kv", idx, keys=new)])
                else:
                    c.batch_get_v2([PoolTransfer("kv", idx, keys=new)])
                calls.append((t, kind, round((time.monotonic() - t) * 1e3, 4)))
            last = new
        print(json.dumps(calls), flush=True)
    c.close()


# ----------------------------------------------------------------- the measuring process


def spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), "--worker", *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def tell(p: subprocess.Popen, line: str) -> None:
    p.stdin.write(line + "\n")
    p.stdin.flush()


def summarize(lat: list[float]) -> dict:
    return {"count": len(lat), "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
            "max_ms": max(lat, default=float("nan"))}


def measure(args) -> dict:
    """The whole run against one daemon (see the module docstring)."""
    import hicached
    from hicached.settings import parse_size

    out: dict = {"tree": str(pathlib.Path(hicached.__file__).resolve().parent.parent),
                 "clients": args.clients, "huge_keys": args.huge_keys,
                 "small_keys": args.small_keys, "small_pages": args.small_pages,
                 "seconds": args.seconds, "rounds": args.rounds, "l2_size": args.l2_size}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        daemon, endpoint = start_daemon(tmp, args.l2_size, shlex.split(args.daemon_args))
        try:
            progress(f"{out['tree']}: daemon up; {args.clients} small clients and a huge one")
            small = [spawn("small", endpoint, str(n), str(args.small_keys), str(args.small_pages),
                           str(args.think_ms / 1000)) for n in range(args.clients)]
            procs += small
            # the arena filled once over: eviction and the index at their steady state
            warmup = -(-parse_size(args.l2_size) // (args.huge_keys * PAGE_BYTES)) + 1
            progress(f"warming up: {warmup} sets of {args.huge_keys} pages")
            huge = spawn("huge", endpoint, str(args.huge_keys), str(warmup))
            procs.append(huge)
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise SystemExit(f"a worker exited with {p.wait()} before it was ready")
            for p in small:
                tell(p, "go")
            windows: list[tuple[str, float, float]] = []
            huge_calls: list = []
            for r in range(args.rounds):
                progress(f"round {r + 1}/{args.rounds}: alone, then with the huge client")
                t0 = time.monotonic()
                time.sleep(args.seconds)
                windows.append(("alone", t0, time.monotonic()))
                t0 = time.monotonic()
                tell(huge, f"go {args.seconds}")
                huge_calls += json.loads(huge.stdout.readline())
                windows.append(("huge", t0, time.monotonic()))
            tell(huge, "stop")
            calls = []
            for p in small:
                tell(p, "stop")
                calls += json.loads(p.stdout.readline())
            for p in procs:
                if p.wait(60):
                    raise SystemExit(f"a worker exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            stop(daemon)
    for phase in ("alone", "huge"):
        spans = [(a, b) for name, a, b in windows if name == phase]
        mine = [c for c in calls if any(a <= c[0] < b for a, b in spans)]
        out[phase] = {"all": summarize([ms for _, _, ms in mine]),
                      **{kind: summarize([ms for _, k, ms in mine if k == kind])
                         for kind in KINDS}}
    out["ratio"] = {q: out["huge"]["all"][q] / out["alone"]["all"][q]
                    for q in ("p50_ms", "p99_ms")}
    out["huge_calls"] = {kind: summarize([ms for _, k, ms in huge_calls if k == kind])
                         for kind in HUGE_KINDS}
    return out


def print_report(r: dict) -> None:
    print(f"tree {r['tree']}: {r['clients']} small clients (exists {r['small_keys']} keys, "
          f"get / set {r['small_pages']} pages), huge calls of {r['huge_keys']} keys, "
          f"{r['rounds']} x {r['seconds']} s per window")
    print(f"{'small calls':<16}{'alone p50':>11}{'alone p99':>11}{'huge p50':>11}"
          f"{'huge p99':>11}{'p99 ratio':>11}{'calls':>13}")
    for kind in ("all", *KINDS):
        a, h = r["alone"][kind], r["huge"][kind]
        print(f"{kind:<16}{a['p50_ms']:>9.2f}ms{a['p99_ms']:>9.2f}ms{h['p50_ms']:>9.2f}ms"
              f"{h['p99_ms']:>9.2f}ms{h['p99_ms'] / a['p99_ms']:>10.2f}x"
              f"{a['count']:>6} /{h['count']:>6}")
    ok = r["ratio"]["p99_ms"] <= 2
    print(f"p99 with the huge client / alone: {r['ratio']['p99_ms']:.2f}x "
          f"({'within' if ok else 'OVER'} the 2x target); p50 {r['ratio']['p50_ms']:.2f}x")
    print("huge calls: " + ", ".join(
        f"{kind} p50 {m['p50_ms']:.1f} ms max {m['max_ms']:.1f} ms ({m['count']})"
        for kind, m in r["huge_calls"].items()))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        if sys.argv[2] == "small":
            endpoint, n, keys, pages, think = sys.argv[3:8]
            small_worker(endpoint, int(n), int(keys), int(pages), float(think))
        else:
            huge_worker(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4, help="small client processes")
    ap.add_argument("--small-keys", type=int, default=8, help="keys of a small exists")
    ap.add_argument("--small-pages", type=int, default=4, help="pages of a small get / set")
    ap.add_argument("--think-ms", type=float, default=1.0, help="pause between small calls")
    ap.add_argument("--huge-keys", type=int, default=16384, help="keys of a huge call")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each window")
    ap.add_argument("--rounds", type=int, default=4, help="pairs of windows (alone, huge)")
    ap.add_argument("--l2-size", default="512MiB")
    ap.add_argument("--daemon-args", default="", help="more `hicached serve` options")
    ap.add_argument("--small", action="store_true",
                    help="a tiny run: 2 clients, 1024-key huge calls, 2 rounds of 1 s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.small:
        args.clients, args.huge_keys, args.rounds, args.seconds = 2, 1024, 2, 1.0
        args.l2_size = "64MiB"
    for name in ("clients", "small_keys", "small_pages", "huge_keys", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: {getattr(args, name)} (at least 1)")
    if args.seconds <= 0 or args.think_ms < 0:
        ap.error(f"--seconds {args.seconds} must be > 0, --think-ms {args.think_ms} >= 0")
    r = measure(args)
    if args.json:
        print(json.dumps(r))
    else:
        print_report(r)


if __name__ == "__main__":
    main()
