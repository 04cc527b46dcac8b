"""The processes of a PD run: its daemons (one node, or two sharing a ``mooncake_master``), the
engine children (``python -m hicached.engine.pd``) and the flags both roles share. Used by
``runner.py`` (``hicached demo --pd``, ``tools/bench_pd.py``) and the PD process tests."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import hicached
from hicached.extras import install_hint

if TYPE_CHECKING:
    from hicached.engine.pd.runner import Workload

NODES = (1, 2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hicached.__file__)))


class RunError(RuntimeError):
    """A process of the run failed: a request's error, a leak, a process that did not start."""


class Endpoints(NamedTuple):
    """The daemon each role stores into / loads from (one node: the same one), and how the
    prefill makes its pages visible to the decode (``--disaggregation-transfer``)."""

    prefill: str
    decode: str
    transfer: str = "l2"


def check_nodes(nodes: int) -> None:
    """Raise ``ValueError`` unless ``daemons(nodes)`` knows ``nodes``."""
    if nodes not in NODES:
        raise ValueError(f"nodes must be one of {list(NODES)}, got {nodes}")


def mooncake_l3_flags(master_address: str, segment: str = "1GiB") -> list[str]:
    """``hicached serve`` flags for a Mooncake L3 on ``master_address`` over TCP on loopback
    (each daemon mounts ``segment`` of its memory into the store)."""
    opts = {"master_server_address": master_address, "protocol": "tcp",
            "global_segment_size": segment, "local_buffer_size": "64MiB",
            "local_hostname": "127.0.0.1"}
    return ["--l3-backend", "mooncake", "--l3-options", json.dumps(opts)]


@contextlib.contextmanager
def mooncake_master(workdir: str) -> Iterator[str]:
    """A ``mooncake_master`` on 127.0.0.1 (its log in ``workdir``), stopped on exit: yields its
    address. ``RunError`` when the Mooncake client is not installed or the master does not
    listen."""
    try:
        import mooncake
    except ImportError as e:
        raise RunError(f"two nodes need Mooncake ({e}): {install_hint('mooncake')}") \
            from None
    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    port, metrics = _free_port(), _free_port()
    with open(os.path.join(workdir, "mooncake_master.log"), "ab") as log:
        proc = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                                 f"--metrics_port={metrics}", "--metrics_host=127.0.0.1"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > end:
                    raise RunError(f"mooncake_master did not listen on {port} (log: "
                                   f"{workdir}/mooncake_master.log)") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def daemons(nodes: int, l2_size: str = "512MiB", slab_size: str = "8MiB",
            endpoint: str = "", workdir: str | None = None,
            segment: str = "1GiB", decode_l2_size: str = "") -> Iterator[Endpoints]:
    """Start the run's daemons (stopped on exit) and say which one each role uses. One node:
    one daemon for both, pages through its L2 (``endpoint``: a running one instead, left
    running). Two nodes: a ``mooncake_master`` and two daemons sharing it, the prefill's on
    one, the decode's on the other; the prefill's pages reach the decode through the store
    (``--disaggregation-transfer l3``: Ready once they are in L3); each mounts ``segment`` of its
    memory into the store. ``decode_l2_size`` (two nodes): the decode's daemon's L2 instead of
    ``l2_size``; one smaller than the run's prefixes models a decode node that keeps no copy of
    them between requests, so that every page it loads crosses the store."""
    check_nodes(nodes)
    if decode_l2_size and nodes != 2:
        raise ValueError("a decode daemon of its own (decode_l2_size) needs two nodes")
    if endpoint:
        if nodes != 1:
            raise ValueError("a running daemon (endpoint) serves one node only")
        yield Endpoints(endpoint, endpoint)
        return
    from hicached.engine.demo import DaemonLauncher

    if nodes == 1:
        d = DaemonLauncher(l2_size, slab_size, extra=("--l3-backend", "none"))
        try:
            yield Endpoints(d.endpoint, d.endpoint)
        finally:
            d.close()
        return
    with tempfile.TemporaryDirectory(prefix="hicached-pd-nodes-", dir=workdir) as tmp, \
            mooncake_master(tmp) as master, \
            ThreadPoolExecutor(2, thread_name_prefix="pd-daemons") as pool:
        # each daemon takes seconds to mount its segment and again to leave the store: both
        # at once (the two nodes' daemons are independent processes)
        flags = mooncake_l3_flags(master, segment)
        started = [pool.submit(DaemonLauncher, size, slab_size, extra=flags)
                   for size in (l2_size, decode_l2_size or l2_size)]
        made = []
        try:
            for f in started:
                made.append(f.result())  # (a failure raises here: finally closes the others)
            yield Endpoints(made[0].endpoint, made[1].endpoint, "l3")
        finally:
            made += [f.result() for f in started[len(made):] if f.exception() is None]
            for f in [pool.submit(d.close) for d in made]:
                f.result()


class EngineProc:
    """A ``python -m hicached.engine.pd`` child: its output in ``<workdir>/<name>.log``, ready
    once it printed ``READY``; ``stop`` sends SIGTERM (the process's own clean exit)."""

    def __init__(self, workdir: str, name: str, args: list[str]):
        self.name = name
        # the child writes here for its whole life; closed in stop()
        self.log = open(os.path.join(workdir, f"{name}.log"), "ab")  # noqa: SIM115
        # ``python -m hicached.engine.pd`` with this checkout first on its path, so that one
        # that is not installed works too (the environment is the parent's, unchanged)
        boot = (f"import runpy, sys; sys.path.insert(0, {ROOT!r}); "
                "runpy.run_module('hicached.engine.pd', run_name='__main__', alter_sys=True)")
        self.proc = subprocess.Popen([sys.executable, "-c", boot, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        """What the process printed so far."""
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Return once it printed ``READY``; ``RunError`` (with its output) if it exited or
        took longer than ``timeout_s`` (importing transformers alone takes seconds)."""
        end = time.monotonic() + timeout_s
        while "READY" not in self.output():
            if self.proc.poll() is not None:
                raise RunError(f"{self.name} exited with {self.proc.returncode}:\n"
                               f"{self.output()[-3000:]}")
            if time.monotonic() > end:
                raise RunError(f"{self.name} not ready in {timeout_s}s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def send(self, sig: int) -> None:
        """Send ``sig`` unless the process has exited (no wait: stop several at once)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        """Wait for the exit (SIGKILL after ``timeout_s``); its status. Closes the log."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        code = self.proc.wait()
        self.log.close()
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the process and wait for it; its exit status."""
        self.send(sig)
        return self.wait(timeout_s)


@dataclass(frozen=True)
class EngineSpec:
    """The engine flags both roles share (the page keys depend on the checkpoint, the page size
    and the tenant: prefill and decode must agree on them)."""

    model_path: str
    arch: str = "qwen3_next"
    page_size: int = 32
    kv_pages: int = 512
    state_slots: int = 64
    track_interval: int = 64
    prefill_chunk_pages: int = 1
    torch_threads: int = 1
    debug_pools: bool = False
    device: str = "cpu"
    timeout_s: float = 120.0  # --disaggregation-timeout-s (a cold prefix on a busy machine)

    def args(self, mode: str, endpoint: str, tenant: str, boot: str) -> list[str]:
        """The command line of one role (mode ``prefill`` or ``decode``) on daemon
        ``endpoint``; the decode's own flags are added by ``run_mode``."""
        return ["--disaggregation-mode", mode, "--disaggregation-bootstrap-endpoint", boot,
                "--model", self.arch, "--model-path", self.model_path,
                "--page-size", str(self.page_size), "--kv-pages", str(self.kv_pages),
                "--state-slots", str(self.state_slots),
                "--track-interval", str(self.track_interval),
                "--prefill-chunk-pages", str(self.prefill_chunk_pages),
                "--torch-threads", str(self.torch_threads), "--tenant", tenant,
                "--device", self.device,
                "--hicache-storage-backend", "hicached", "--hicached-endpoint", endpoint,
                *(["--debug-pools"] if self.debug_pools else [])]


def pool_sizes(w: Workload, page_size: int, track_interval: int) -> tuple[int, int]:
    """KV pages and state slots for a device that caches the whole workload (with room for
    each request's partial pages and snapshots): the decode's radix cache then never evicts."""
    pages = math.ceil(w.unique_tokens() / page_size) + 2 * w.requests + 16
    slots = 3 * w.requests + w.unique_tokens() // track_interval + 16
    return pages + pages // 4, slots
