"""The status page under a workload: starts a daemon with its admin API (and the status page)
on a free port, runs engines against it, and prints the page's address.

Three engines, each a client of its own namespace, serve conversations: a turn asks which of
its conversation's pages are stored (exists, Mamba state trailing), gets them (KV pages and the
last page's Mamba state), and stores the conversation's pages and state with a few new pages.
Conversations are chains of page keys (key i stands for pages 0..i). The mix changes over the
run: mostly returning conversations (L2 hits), then mostly new ones (the 64 MiB arena fills:
evictions; pages come back from the file L3), then returning ones again; ``tenant-b`` has a
quota smaller than what it writes (quota evictions).

    python tools/status_demo.py [--seconds 60] [--sample-s 0.25] [--keep]
                                [--screenshot docs/images/status-page.png] [--json]

``--keep`` leaves the daemon (and the page) up until Ctrl-C; ``--screenshot`` takes one with
headless chromium at the end (docs/operating.md shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import torch

from hicached import Client, HostPool, PoolHitPolicy, PoolTransfer
from hicached.errors import DaemonUnavailable

PAGE_TOKENS, HOST_PAGES, MAX_PAGES = 16, 64, 48
TRAILING = PoolHitPolicy.TRAILING_PAGES
ENGINES = (("llama-70b|tp0of1", 1), ("qwen3-next|tp0of1", 2), ("tenant-b", 3))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(tmp: str, port: int, sample_s: float) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{tmp}/demo.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--endpoint", endpoint, "--l2-size", "64MiB",
         "--slab-size", "4MiB", "--state-dir", f"{tmp}/state", "--admin-port", str(port),
         "--status-sample-s", str(sample_s), "--log-level", "warning",
         "--namespace-quotas", '{"tenant-b": "12MiB"}'], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with Client(endpoint, "probe", timeout_s=1.0) as c:
                c.ping()
            return proc, endpoint
        except DaemonUnavailable:
            time.sleep(0.1)
    proc.terminate()
    raise SystemExit("daemon did not start")


def share_new(progress: float) -> float:
    """How many turns start a new conversation, over the run (0..1)."""
    return 0.15 if progress < 0.35 else 0.75 if progress < 0.65 else 0.1


def engine(endpoint: str, ns: str, seed: int, start: float, seconds: float,
           errors: list) -> None:
    """Turns of conversations until ``start + seconds`` (see the module docstring)."""
    rng = random.Random(seed)
    kv = HostPool.allocate_mha(HOST_PAGES, PAGE_TOKENS, layers=4, heads=8, head_dim=64)
    mamba = HostPool.allocate_mamba(2, 4, (8, 64), [(3, 64)])
    kv.kv_buffer.normal_()
    try:
        with Client(endpoint, ns) as c:
            c.register_mem_host_pool_v2(kv, "kv")
            c.register_mem_host_pool_v2(mamba, "mamba")
            lengths: dict[int, int] = {}  # conversation -> pages stored
            while (now := time.monotonic()) < start + seconds:
                if not lengths or rng.random() < share_new((now - start) / seconds):
                    conv, had = len(lengths), 0
                else:
                    conv = rng.choice(list(lengths))
                    had = lengths[conv]
                n = min(MAX_PAGES, had + rng.randint(2, 6))
                keys = [f"{ns}/{conv}/{i}" for i in range(n)]
                if had:
                    known = keys[:had]
                    state = [PoolTransfer("mamba", keys=known[-1:], hit_policy=TRAILING)]
                    c.batch_exists_v2(known, state)
                    c.batch_get_v2([PoolTransfer("kv", torch.arange(had * PAGE_TOKENS),
                                                 keys=known),
                                    PoolTransfer("mamba", torch.tensor([0]), keys=known[-1:],
                                                 hit_policy=TRAILING)])
                c.batch_set_v2([PoolTransfer("kv", torch.arange(n * PAGE_TOKENS), keys=keys),
                                PoolTransfer("mamba", torch.tensor([1]), keys=keys[-1:],
                                             hit_policy=TRAILING)])
                lengths[conv] = n if n < MAX_PAGES else 0
                if not lengths[conv]:
                    del lengths[conv]  # a finished conversation
                time.sleep(rng.uniform(0.005, 0.03))
    except Exception as e:  # noqa: BLE001 - reported by main
        errors.append(e)


def screenshot(url: str, path: str) -> None:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                                  "google-chrome")) if p), None)
    if browser is None:
        raise SystemExit("--screenshot needs chromium (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, "--headless", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--window-size=1280,2250",
               "--virtual-time-budget=4000", f"--screenshot={os.path.abspath(path)}", url]
        if os.geteuid() == 0:
            cmd.insert(1, "--no-sandbox")
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=0.25, help="status_sample_s")
    ap.add_argument("--keep", action="store_true", help="keep the daemon up until Ctrl-C")
    ap.add_argument("--screenshot", metavar="PNG")
    ap.add_argument("--json", action="store_true", help="print the final /stats as JSON")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory(prefix="hicached-demo-") as tmp:
        proc, endpoint = start_daemon(tmp, port, args.sample_s)
        try:
            if not args.json:
                print(f"status page: {url}", flush=True)
            errors: list = []
            start = time.monotonic()
            threads = [threading.Thread(target=engine, args=(endpoint, ns, seed, start,
                                                             args.seconds, errors))
                       for ns, seed in ENGINES]
            for t in threads:
                t.start()
            if args.screenshot:  # while the engines still work
                time.sleep(max(0.0, start + args.seconds - 3 - time.monotonic()))
                screenshot(url, args.screenshot)
            for t in threads:
                t.join()
            if errors:
                raise SystemExit(f"an engine failed: {errors[0]!r}")
            with urllib.request.urlopen(url + "stats", timeout=30) as r:
                stats = json.loads(r.read())
            if args.json:
                print(json.dumps(stats))
            if args.keep:
                print("the daemon stays up: Ctrl-C stops it", flush=True)
                proc.wait()
        except KeyboardInterrupt:
            pass
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
