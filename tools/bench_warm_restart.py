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


def serve(tmp: str, l2_size: str, state: str, *extra: str) -> tuple[subprocess.Popen, float]:
    """A daemon started and answering: (process, seconds from its start to ready)."""
    endpoint = f"ipc://{tmp}/bench.sock"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--endpoint", endpoint, "--l2-size",
         l2_size, "--slab-size", "64MiB", "--state-dir", f"{tmp}/{state}", "--l3-backend",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--l2-size", default="4GiB")
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fill", type=float, default=0.75, help="share of the arena set")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
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
