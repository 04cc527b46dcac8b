"""A multi-turn chat workload through PD processes, with and without the decode-side radix cache:
the runner of ``tools/bench_pd.py`` and ``hicached demo --pd``.

One run (``run_both``):

    daemons(nodes)         the daemons, and the endpoint each role talks to (``Endpoints``)
    Mode(radix=False)      a prefill and a decode process (``python -m hicached.engine.pd``)
    Mode(radix=True)       the same with --disaggregation-decode-enable-radix-cache, beside it
    each request           sent to both decodes' front sockets, one at a time, the order
                           alternating; the decode's pools read after each
    finish                 each decode idle (nothing leaked), its processes stopped
    compare(off, on)       outputs equal request by request, and the on / off ratios

(``interleave=False``: one mode, then the other.)

The two modes share the daemons but no page: each runs under its own ``--tenant`` (another page
namespace, fresh per run), so neither finds the other's pages, nor an earlier run's, in L2.
Bytes moved into the decode are counted from what it says it read (``Generated``): the
prefill's delta and what its arrival load-back found in the daemon, pages and states, times
their sizes (``Usage``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Self

import hicached
from hicached.engine.pd import protocol as M
from hicached.engine.pd.server import PDClient

NODES = (1, 2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hicached.__file__)))


class RunError(RuntimeError):
    """A process of the run failed: a request's error, a leak, a process that did not start."""


# ------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Workload:
    """``conversations`` chats; conversation c opens with shared prefix ``c % prefixes`` (a long
    system prompt, ``prefix_tokens``), and each of its ``turns`` turns appends a fresh
    ``suffix_tokens`` user message to the history (prefix, earlier messages and answers) and
    asks for ``new_tokens``. Requests go turn by turn (every conversation's turn 0, then turn 1,
    ...), as users come back. The tokens are seeded: every run and mode sends the same prompts,
    given the same answers."""

    prefixes: int = 20
    prefix_tokens: int = 1024
    suffix_tokens: int = 96
    conversations: int = 80
    turns: int = 5
    new_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefixes", "prefix_tokens", "suffix_tokens", "conversations", "turns",
                     "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    @property
    def nominal_reuse(self) -> float:
        """A first turn's share of tokens in a prefix another request sent (SGLang's figure)."""
        return self.prefix_tokens / (self.prefix_tokens + self.suffix_tokens)

    def unique_tokens(self) -> int:
        """Tokens of every prefix and every conversation's own history (a cache of them all)."""
        per_turn = self.suffix_tokens + self.new_tokens
        return self.prefixes * self.prefix_tokens + self.requests * per_turn

    def messages(self, vocab: int) -> Iterator[tuple[int, int, list[int]]]:
        """(conversation, turn, new tokens): turn 0's are its prefix and first message."""
        g = random.Random(self.seed)
        prefixes = [[g.randrange(vocab) for _ in range(self.prefix_tokens)]
                    for _ in range(self.prefixes)]
        for turn in range(self.turns):
            for conv in range(self.conversations):
                user = [g.randrange(vocab) for _ in range(self.suffix_tokens)]
                yield conv, turn, (prefixes[conv % self.prefixes] if turn == 0 else []) + user


# ------------------------------------------------------------------ the processes


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
        raise RunError(f"two nodes need Mooncake ({e}): pip install 'hicached[mooncake]'") \
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
            mooncake_master(tmp) as master, contextlib.ExitStack() as stack:
        made = []
        for size in (l2_size, decode_l2_size or l2_size):
            d = DaemonLauncher(size, slab_size, extra=mooncake_l3_flags(master, segment))
            stack.callback(d.close)
            made.append(d)
        yield Endpoints(made[0].endpoint, made[1].endpoint, "l3")


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


# ------------------------------------------------------------------ one mode


@dataclass
class Record:
    """One request as the decode answered it."""

    conv: int
    turn: int
    prompt: int  # tokens
    reusable: int  # prompt tokens an earlier request sent or got (its prefix, or its history)
    matched: int  # prompt tokens the decode held itself (decode_prefix_len)
    pages: int  # KV pages moved into the decode: the prefill's delta and the arrival load-back
    states: int
    nbytes: int
    ttft_s: float
    output_ids: list[int]
    logits: bytes = field(repr=False)
    prefill_s: float = 0.0  # of ttft_s: asking the prefill -> its Ready
    publish_s: float = 0.0  # of prefill_s: the prefill storing the pages until visible
    load_s: float = 0.0  # of ttft_s: the decode loading the delta


@dataclass
class ModeRun:
    """A mode's records and the decode's pools after each request."""

    radix: bool
    records: list[Record]
    usage: list[M.Usage]
    store_loads: int = 0  # pages and states the decode's daemon read from L3 (two nodes)

    @property
    def label(self) -> str:
        return "radix on" if self.radix else "radix off"


class Mode:
    """One mode's prefill and decode processes and the user's client of its decode: started by
    ``with``, sent requests one at a time (``send``), checked and stopped by ``finish``. Their
    logs are left in a new directory under ``workdir``."""

    def __init__(self, spec: EngineSpec, ends: Endpoints, radix: bool, workdir: str):
        self.ends, self.timeout_s = ends, spec.timeout_s
        self.run = ModeRun(radix, [], [])
        self.history: dict[int, list[int]] = {}
        tag = self.tag = f"radix-{'on' if radix else 'off'}"
        tenant = f"pd-{os.getpid()}-{tag}"
        workdir = tempfile.mkdtemp(prefix=f"{tag}-", dir=workdir)  # its sockets and logs
        boot = f"ipc://{workdir}/boot.sock"
        self.front = f"ipc://{workdir}/front.sock"
        decode_args = spec.args("decode", ends.decode, tenant, boot) + [
            "--serve-endpoint", self.front, "--disaggregation-timeout-s", str(spec.timeout_s)]
        if radix:
            decode_args.append("--disaggregation-decode-enable-radix-cache")
        prefill_args = spec.args("prefill", ends.prefill, tenant, boot) + [
            "--disaggregation-transfer", ends.transfer]
        self.procs = [EngineProc(workdir, f"prefill-{tag}", prefill_args),
                      EngineProc(workdir, f"decode-{tag}", decode_args)]
        self.user: PDClient | None = None

    def __enter__(self) -> Self:
        try:
            for p in self.procs:
                p.wait_ready()
            self.user = PDClient(self.front, timeout_s=self.timeout_s + 60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def send(self, conv: int, turn: int, new: list[int], w: Workload, vocab: int) -> None:
        """One request: this conversation's history plus ``new``; its record (and the pages
        and states the decode's daemon read from the store meanwhile) joins ``run``. A failed
        request raises with the processes' output."""
        run, user = self.run, self.user
        prompt = self.history.get(conv, []) + new
        reusable = len(self.history[conv]) if turn else (
            w.prefix_tokens if conv >= w.prefixes else 0)
        loads = _store_loads(self.ends)
        got = user.generate(f"c{conv}t{turn}", prompt, w.new_tokens)
        if got.error:
            logs = "\n".join(f"--- {p.name}\n{p.output()[-2000:]}" for p in self.procs)
            raise RunError(f"{run.label}, conversation {conv} turn {turn}: {got.error}\n{logs}")
        run.store_loads += _store_loads(self.ends) - loads
        self.history[conv] = prompt + got.output_ids
        u = user.usage()
        pages = got.moved_pages + got.loaded_pages
        states = got.moved_states + got.loaded_states
        run.records.append(Record(conv, turn, len(prompt), reusable, got.decode_prefix_len,
                                  pages, states, pages * u.page_bytes + states * u.state_bytes,
                                  got.ttft_s, list(got.output_ids), got.logits,
                                  got.prefill_s, got.publish_s, got.load_s))
        run.usage.append(u)

    def finish(self) -> ModeRun:
        """The decode must be idle (nothing leaked); both processes exit cleanly."""
        checked = self.user.check_idle()
        if not checked.ok:
            raise RunError(f"the {self.tag} decode is not idle after the run: {checked.message}")
        self.user.close()
        self.user = None
        for p in self.procs:  # (their interpreters take a second to exit: together)
            p.send(signal.SIGTERM)
        for p in self.procs:
            if p.wait() != 0:
                raise RunError(f"{p.name} exited with {p.proc.returncode}:\n"
                               f"{p.output()[-3000:]}")
        return self.run

    def __exit__(self, *exc) -> None:
        if self.user is not None:
            self.user.close()
            self.user = None
        for p in self.procs:
            if p.proc.poll() is None:
                p.stop(signal.SIGKILL)


def run_mode(w: Workload, spec: EngineSpec, ends: Endpoints, radix: bool, workdir: str,
             vocab: int, on_request: Callable[[str], None] | None = None) -> ModeRun:
    """Start a prefill and a decode for ``radix``, send the workload, stop them."""
    with Mode(spec, ends, radix, workdir) as mode:
        for conv, turn, new in w.messages(vocab):
            mode.send(conv, turn, new, w, vocab)
            if on_request is not None:
                on_request(mode.run.label)
        return mode.finish()


def _store_loads(ends: Endpoints) -> int:
    """Pages and states the decode's daemon has read from L3 so far (0 when it has none)."""
    if ends.transfer != "l3":
        return 0
    from hicached.client.api import Client

    with Client(ends.decode, "bench-pd-stats", timeout_s=30.0) as c:
        return int(c.stats().get("l3_loads", 0))


# ------------------------------------------------------------------ both modes, compared


def run_both(w: Workload, spec: EngineSpec, ends: Endpoints, workdir: str, vocab: int,
             on_request: Callable[[str], None] | None = None, interleave: bool = True
             ) -> tuple[ModeRun, ModeRun]:
    """The workload without and with the decode-side radix cache: (off, on). ``interleave``:
    both modes' processes run side by side and each request goes to both, in turn first
    (off then on, then on then off, ...), so that the machine's drift and any warm-up fall on
    both alike; else one mode after the other."""
    if not interleave:
        return (run_mode(w, spec, ends, False, workdir, vocab, on_request),
                run_mode(w, spec, ends, True, workdir, vocab, on_request))
    with Mode(spec, ends, False, workdir) as off, Mode(spec, ends, True, workdir) as on:
        for i, (conv, turn, new) in enumerate(w.messages(vocab)):
            for mode in (off, on) if i % 2 == 0 else (on, off):
                mode.send(conv, turn, new, w, vocab)
                if on_request is not None:
                    on_request(mode.run.label)
        return off.finish(), on.finish()


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(run: ModeRun) -> dict:
    """A mode's figures: bytes moved per request, TTFT (and where its mean went), the
    decode's match and pool use."""
    r, u = run.records, run.usage
    ttft = [x.ttft_s for x in r]
    prompt = sum(x.prompt for x in r)
    return {
        "requests": len(r),
        "prompt_tokens_mean": prompt / len(r),
        "matched_tokens_mean": sum(x.matched for x in r) / len(r),
        "matched_share": sum(x.matched for x in r) / prompt,
        "reusable_share": sum(x.reusable for x in r) / prompt,
        "pages_per_request": sum(x.pages for x in r) / len(r),
        # of them (and of the states), what the decode's daemon read from the store (two nodes)
        "store_loads_per_request": run.store_loads / len(r),
        "bytes_per_request": sum(x.nbytes for x in r) / len(r),
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3,
        "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
        "ttft_mean_ms": sum(ttft) / len(ttft) * 1e3,
        # where the mean TTFT went (the rest: queueing, matching, inserting on the decode)
        "prefill_mean_ms": sum(x.prefill_s for x in r) / len(r) * 1e3,
        "publish_mean_ms": sum(x.publish_s for x in r) / len(r) * 1e3,
        "load_mean_ms": sum(x.load_s for x in r) / len(r) * 1e3,
        "pool_tokens": u[-1].kv_pages * u[-1].page_size,
        "pool_used_tokens_max": max(x.used_tokens for x in u),
        "pool_used_tokens_end": u[-1].used_tokens,
        "page_bytes": u[-1].page_bytes,
        "state_bytes": u[-1].state_bytes,
    }


def compare(off: ModeRun, on: ModeRun) -> dict:
    """Outputs equal request by request (token ids; the largest logit difference), and the
    on / off ratio of each figure ``summary`` gives."""
    import numpy as np

    same, diff = True, 0.0
    for a, b in zip(off.records, on.records, strict=True):
        same &= a.output_ids == b.output_ids
        if a.logits and b.logits and len(a.logits) == len(b.logits):
            la = np.frombuffer(a.logits, dtype=np.float32)
            lb = np.frombuffer(b.logits, dtype=np.float32)
            diff = max(diff, float(np.abs(la - lb).max()))
        else:
            same = False
    s_off, s_on = summary(off), summary(on)
    ratios = {k: (s_on[k] / s_off[k] if s_off[k] else None)
              for k in ("bytes_per_request", "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms",
                        "pool_used_tokens_max")}
    return {"outputs_equal": same, "max_logit_diff": diff, "off": s_off, "on": s_on,
            "on_over_off": ratios}
