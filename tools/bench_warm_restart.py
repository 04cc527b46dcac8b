"""Warm restart benchmark (issue 49): a daemon SIGKILLed while clients set and get, then
started again on the arena it left, against a cold start of the same size in the same run.

    1. a daemon (``--on-stop keep``, L3 off) with an arena of ``--l2-size`` in slabs of 64 MiB
    2. ``--clients`` processes (two namespaces) set pages of ``--page-kib`` in calls of 64 and
       read back earlier ones, until ``--fill`` of the arena is committed; each logs its keys
       with the time its set returned
    3. SIGKILL of the daemon while they run; the clients stop
    4. the daemon started again: time to ready (first answered ping) and its adoption figures
    5. every page set at least 1 s before the kill read back by a new client: the share that
       is an L2 hit, and the bytes compared (0 wrong bytes expected)
    6. that daemon stopped (its arena freed), and a cold start of the same size timed

Prints one table (``--json``: one JSON object). ``--l2-size 256MiB`` is a smoke test.

    python tools/bench_warm_restart.py [--l2-size 4GiB] [--page-kib 64] [--clients 4]

``--kills N`` (the issue's "20 kills at random instants under load"): instead, a daemon with an
arena small enough that eviction runs all the time (``--l2-size 256MiB``) is SIGKILLed N times
at a random instant while ``--clients`` processes set new pages, read back earlier ones into
another pool (every hit compared with its source: wrong bytes) and now and then flush their
namespace, living through every kill (they retry until the daemon is back). After each restart
(reservation and lease TTLs of 2 s, so fences and the adopted pages' hold end within a second):
the clients pause, the fences are awaited, the slots counted (arena bytes in slots = pages x
stride + fenced + set-ahead: 0 leaked), every key of the last arena's worth of each client
read back by a new client (hits compared), and /dev/shm listed (only the arena, its journal
and its presence table). Prints a line per kill and the totals.

    python tools/bench_warm_restart.py --kills 20 --l2-size 256MiB [--slab-size 16MiB]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from hicached import Client, HostPool, PoolTransfer
from hicached.errors import DaemonUnavailable, HicachedError
from hicached.settings import parse_size

CALL = 64  # pages a set call


def pool_for(page_kib: int, num_pages: int, seed: int) -> HostPool:
    """A KV pool of ``page_kib`` KiB pages (4 tokens, 8 layers, fp32), filled from ``seed``."""
    head_dim = page_kib * 1024 // (4 * 8 * 8 * 2 * 4)
    pool = HostPool.allocate_mha(num_pages, 4, layers=8, heads=8, head_dim=head_dim,
                                 layout="page_first", dtype=torch.float32)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape,
                                     generator=torch.Generator().manual_seed(seed)))
    return pool


def client_loop(endpoint: str, w: int, page_kib: int, quota_pages: int, log_path: str,
                go, stop) -> None:
    """Set ``quota_pages`` pages (then keep reading) until ``stop``; log "key time" lines."""
    ns = f"model-{w % 2}"
    src = pool_for(page_kib, CALL, seed=w)
    dst = pool_for(page_kib, CALL, seed=100 + w)
    tokens = torch.arange(CALL * 4)
    done = 0
    go.wait()
    with open(log_path, "w") as log, Client(endpoint, ns, timeout_s=2.0) as c:
        c.register_mem_host_pool_v2(src, "kv")
        while not stop.is_set():
            try:
                if done < quota_pages:
                    keys = [f"w{w}-{done + i}" for i in range(CALL)]
                    ok = c.batch_set_v2([PoolTransfer("kv", tokens, keys=keys)])["kv"]
                    now = time.time()
                    for k, good in zip(keys, ok):
                        if good:
                            log.write(f"{k} {now:.6f}\n")
                    log.flush()
                    done += CALL
                elif done:
                    c.batch_get_v2([PoolTransfer("kv", tokens, keys=[
                        f"w{w}-{i}" for i in range(CALL)])])
            except (HicachedError, OSError):
                return
    del dst


def serve(tmp: str, l2_size: str, state: str, *extra: str,
          slab_size: str = "64MiB") -> tuple[subprocess.Popen, float]:
    """A daemon started and answering: (process, seconds from its start to ready)."""
    endpoint = f"ipc://{tmp}/bench.sock"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--endpoint", endpoint, "--l2-size",
         l2_size, "--slab-size", slab_size, "--state-dir", f"{tmp}/{state}", "--l3-backend",
         "none", *extra], stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/{state}.log", "ab"))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited: see {tmp}/{state}.log")
        try:
            with Client(endpoint, "probe", timeout_s=1.0) as c:
                c.ping()
            return proc, time.monotonic() - t0
        except DaemonUnavailable:
            time.sleep(0.01)


def read_back(endpoint: str, page_kib: int, keys: list[str]) -> tuple[int, int]:
    """(hits, wrong pages) of ``keys`` read by a new client, bytes compared with their
    source pages (key ``w<w>-<i>``: page ``i % CALL`` of worker ``w``'s pool)."""
    hits = wrong = 0
    by_worker: dict[int, list[str]] = {}
    for k in keys:
        by_worker.setdefault(int(k[1:k.index("-")]), []).append(k)
    for w, ks in by_worker.items():
        src = pool_for(page_kib, CALL, seed=w)
        dst = pool_for(page_kib, CALL, seed=1000)
        with Client(endpoint, f"model-{w % 2}") as c:
            c.register_mem_host_pool_v2(dst, "kv")
            for lo in range(0, len(ks), CALL):
                part = ks[lo:lo + CALL]
                idx = [int(k.rsplit("-", 1)[1]) % CALL for k in part]
                toks = torch.cat([torch.arange(i * 4, i * 4 + 4) for i in idx])
                got = c.batch_get_v2([PoolTransfer("kv", toks, keys=part)])["kv"]
                for i, good in zip(idx, got):
                    if good:
                        hits += 1
                        a = src.kv_buffer[:, i * 4:i * 4 + 4]
                        b = dst.kv_buffer[:, i * 4:i * 4 + 4]
                        wrong += not torch.equal(a, b)
    return hits, wrong


KILL_TTL = ("--reservation-ttl-s", "2", "--lease-ttl-s", "2")  # fences and holds end in 1 s


def churn_loop(endpoint: str, w: int, page_kib: int, window: int, counts, pause, paused,
               stop) -> None:
    """Set new pages, read back a random call's worth of the last ``window`` keys and compare
    every hit with its source page, flush this namespace every 40th call (worker 0), until
    ``stop``; through kills (calls fail while the daemon is down: retried). ``counts``: this
    worker's [keys set so far, pages read and compared, wrong pages]. Stops issuing calls
    while ``pause`` is set (``paused`` set meanwhile)."""
    import random

    rng = random.Random(w)
    ns = f"model-{w % 2}"
    src = pool_for(page_kib, CALL, seed=w)
    dst = pool_for(page_kib, CALL, seed=100 + w)
    tokens = torch.arange(CALL * 4)
    n = calls = 0
    with Client(endpoint, ns, timeout_s=2.0) as setter, \
            Client(endpoint, ns, timeout_s=2.0) as getter:
        setter.register_mem_host_pool_v2(src, "kv")
        getter.register_mem_host_pool_v2(dst, "kv")
        while not stop.is_set():
            if pause.is_set():
                paused.set()
                time.sleep(0.01)
                continue
            paused.clear()
            try:
                if n:  # a whole earlier call: key m + i is page i of ``src``
                    m = rng.randrange(max(0, n - window), n, CALL)
                    keys = [f"w{w}-{m + i}" for i in range(CALL)]
                    got = getter.batch_get_v2([PoolTransfer("kv", tokens, keys=keys)])["kv"]
                    for i, good in enumerate(got):
                        if good:
                            counts[1] += 1
                            t = slice(i * 4, i * 4 + 4)
                            counts[2] += not torch.equal(src.kv_buffer[:, t],
                                                         dst.kv_buffer[:, t])
                keys = [f"w{w}-{n + i}" for i in range(CALL)]
                setter.batch_set_v2([PoolTransfer("kv", tokens, keys=keys)])
                n += CALL  # answered (stored or not): the next names; a call that raised is
                counts[0] = n  # tried again with the same names and bytes
                calls += 1
                if w == 0 and calls % 40 == 0:
                    setter.flush("l2", timeout_s=5.0, namespace=ns)
            except (HicachedError, OSError):
                time.sleep(0.02)  # the daemon is down (killed): try again


def shm_of(state_dir: str) -> list[str]:
    """The files in /dev/shm of the arena of ``state_dir`` (hicached-<digest>*)."""
    from hicached.daemon.config import load_config

    base = os.path.basename(load_config(None, {}, {"state_dir": state_dir}).arena_path)
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(base))


def kills(args, size: int) -> dict:
    """``--kills``: the module docstring's second part; per-kill rows and the totals."""
    import random

    from hicached.daemon.slabs import stride_for

    rng = random.Random(0)
    page = args.page_kib * 1024
    stride = stride_for(page)
    arena_pages = size // stride
    window = max(CALL, 2 * arena_pages // args.clients // CALL * CALL)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/bench.sock"
        state = f"{tmp}/s"
        d, _ = serve(tmp, args.l2_size, "s", *KILL_TTL, slab_size=args.slab_size)
        ctx = mp.get_context("fork")
        pause, stop = ctx.Event(), ctx.Event()
        paused = [ctx.Event() for _ in range(args.clients)]
        counts = [ctx.Array("q", 3) for _ in range(args.clients)]
        procs = [ctx.Process(target=churn_loop, args=(endpoint, w, args.page_kib, window,
                                                      counts[w], pause, paused[w], stop))
                 for w in range(args.clients)]
        for p in procs:
            p.start()
        try:
            for k in range(args.kills):
                pause.clear()
                before = sum(c[0] for c in counts)
                at = rng.uniform(0.3, 1.5)  # the random instant, under load
                time.sleep(at)
                evictions = stats_of(endpoint)["evictions"]
                at_kill = [c[0] for c in counts]
                d.send_signal(signal.SIGKILL)
                d.wait()
                d, ready_s = serve(tmp, args.l2_size, "s", *KILL_TTL, slab_size=args.slab_size)
                adoption = stats_of(endpoint)["adoption"]
                time.sleep(0.5)  # the clients that lived through the kill work on the new one
                pause.set()
                deadline = time.monotonic() + 30
                while not all(e.is_set() for e in paused):
                    assert time.monotonic() < deadline, "clients did not pause"
                    time.sleep(0.01)
                st = wait_quiet(endpoint)
                leaked = st["l2_used_bytes"] - (st["l2_pages"] * stride + st["fenced_bytes"]
                                                + st["set_ahead_bytes"])
                keys = [f"w{w}-{i}" for w in range(args.clients)  # (those set since: too)
                        for i in range(max(0, at_kill[w] - window), counts[w][0] + CALL)]
                hits, wrong = read_back(endpoint, args.page_kib, keys)
                files = shm_of(state)
                base = files[0] if files else "?"
                rows.append({"kill": k + 1, "at_s": round(at, 2),
                             "evictions_before": evictions,
                             "keys_set": sum(c[0] for c in counts) - before,
                             "ready_s": round(ready_s, 2), "adopted": adoption["pages"],
                             "dropped": sum(adoption["dropped"].values()),
                             "cold": adoption["cold_reason"], "read_back": hits,
                             "wrong": wrong, "leaked_bytes": leaked,
                             "shm_ok": files == [base, base + ".meta", base + ".presence"]})
                if not args.json:
                    print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
            d.send_signal(signal.SIGTERM)
            d.wait()
        left = shm_of(state)
    return {"kills": args.kills, "l2_bytes": size, "page_bytes": page, "clients": args.clients,
            "per_kill": rows,
            "wrong_pages": sum(r["wrong"] for r in rows) + sum(c[2] for c in counts),
            "pages_compared_by_old_clients": sum(c[1] for c in counts),
            "pages_read_back_by_new_clients": sum(r["read_back"] for r in rows),
            "leaked_bytes": sum(abs(r["leaked_bytes"]) for r in rows),
            "cold_starts": sum(r["cold"] is not None for r in rows),
            "shm_ok": all(r["shm_ok"] for r in rows) and left == [],
            "ready_s_max": max((r["ready_s"] for r in rows), default=None),
            "adopted_pages_mean": round(sum(r["adopted"] for r in rows) / len(rows), 1)
            if rows else None}


def stats_of(endpoint: str) -> dict:
    with Client(endpoint, "probe", timeout_s=5.0) as c:
        return c.stats()


def wait_quiet(endpoint: str, timeout_s: float = 30.0) -> dict:
    """The stats once no slot is fenced, reserved or held under a lease (the clients paused;
    the adopted pages' hold and the fences end with the short TTLs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = stats_of(endpoint)
        if not (st["fenced_bytes"] or st["reservations"] or st["leases"]):
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(f"fences or leases still held after {timeout_s} s: {st}")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--l2-size", default="4GiB")
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fill", type=float, default=0.75, help="share of the arena set")
    ap.add_argument("--kills", type=int, default=0,
                    help="SIGKILL the daemon this many times under load (see above)")
    ap.add_argument("--slab-size", default="16MiB", help="--kills only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.kills:
        out = kills(args, parse_size(args.l2_size, "--l2-size"))
        if args.json:
            print(json.dumps(out))
            return
        for k, v in out.items():
            if k != "per_kill":
                print(f"{k:32s} {v}")
        return
    size = parse_size(args.l2_size, "--l2-size")
    pages = int(size * args.fill) // (args.page_kib * 1024)
    quota = -(-pages // args.clients // CALL) * CALL
    out: dict = {"l2_bytes": size, "page_bytes": args.page_kib * 1024, "clients": args.clients}
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/bench.sock"
        d, _ = serve(tmp, args.l2_size, "s", "--on-stop", "keep")
        ctx = mp.get_context("fork")
        go, stop = ctx.Event(), ctx.Event()
        logs = [f"{tmp}/client{w}.log" for w in range(args.clients)]
        procs = [ctx.Process(target=client_loop, args=(endpoint, w, args.page_kib, quota,
                                                       logs[w], go, stop))
                 for w in range(args.clients)]
        for p in procs:
            p.start()
        t0 = time.time()
        go.set()

        def set_pages() -> int:
            n = 0
            for path in logs:
                try:
                    with open(path) as f:
                        n += sum(1 for _ in f)
                except FileNotFoundError:
                    pass
            return n

        while set_pages() < pages * 0.98 and time.time() - t0 < 300:
            time.sleep(0.2)
        time.sleep(1.0)  # reads go on; sets of the last calls land
        d.send_signal(signal.SIGKILL)
        killed = time.time()
        d.wait()
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        out["fill_s"] = round(killed - t0, 2)
        d, warm_s = serve(tmp, args.l2_size, "s")
        with Client(endpoint, "probe") as c:
            adoption = c.stats()["adoption"]
        old = []
        for path in logs:
            with open(path) as f:
                old += [line.split()[0] for line in f if float(line.split()[1]) <= killed - 1]
        hits, wrong = read_back(endpoint, args.page_kib, old)
        d.send_signal(signal.SIGTERM)
        d.wait()
        d, cold_s = serve(tmp, args.l2_size, "cold")
        d.send_signal(signal.SIGTERM)
        d.wait()
        out.update(warm_ready_s=round(warm_s, 2), cold_ready_s=round(cold_s, 2),
                   adopted_pages=adoption["pages"], adopted_gib=round(adoption["bytes"] / 2**30, 2),
                   adoption_s=adoption["seconds"], dropped=adoption["dropped"],
                   committed_1s_before=len(old), l2_hits=hits,
                   hit_share=round(hits / len(old), 4) if old else None, wrong_pages=wrong)
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:22s} {v}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
