"""What the L3 benchmarks share (``bench_l3.py`` and its checksum section,
``bench_l3_checksum.py``): the page geometry, the child processes (a ``mooncake_master``, a
segment provider, daemons) and their clean stop, GB/s and the machine's CPU ticks."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

from hicached import Client
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
