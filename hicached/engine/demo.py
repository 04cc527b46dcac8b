"""``hicached demo``: a multi-turn chat workload on both hybrid models, cached through hicached.

Per model, the same workload (conversations sharing system prompts, several turns each, every
turn = the history + a new user message) runs four times:

    no cache      radix cache off, no storage: every prompt computed (the baseline)
    device + L2   one engine with hicached: device (L1) hits, pages written through to L2
    new engine    a fresh engine (empty device) on the same daemon: L2 hits
    L3            the daemon's L2 flushed, a fresh engine: L3 hits

and prints, per turn, TTFT against the no-cache run and how many prompt tokens came from L1, L2,
L3 or were computed. The demo starts its own daemon (stopped at exit) unless ``--hicached-endpoint``
names a running one.

``--pd`` runs the same workload through a prefill and a decode process instead (PD
disaggregation, ``hicached/engine/pd/demo.py``), without and with the decode-side radix cache:
per turn, tokens the decode held, bytes moved into it, TTFT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from hicached.engine.config import add_engine_args, config_from_args
from hicached.extras import install_hint

PHASES = ("no cache", "device + L2", "new engine", "L3")
DEVICE_ONLY = ("no cache", "device only")


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, width: int = 30, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.width, self.done = max(1, total), width, 0
        self.tty = self.stream.isatty()

    def advance(self, label: str) -> None:
        """One step done; redraws the bar (a terminal) or prints every 25% (a log)."""
        self.done += 1
        filled = self.width * self.done // self.total
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{label:<40.40}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if self.done >= self.total else ""))
        elif self.done * 4 // self.total != (self.done - 1) * 4 // self.total:
            self.stream.write(line.rstrip() + "\n")
        self.stream.flush()


class DaemonLauncher:
    """A ``hicached serve`` child process on an ipc socket in a temp dir (demo, bench)."""

    def __init__(self, l2_size: str = "512MiB", slab_size: str = "8MiB",
                 extra: Sequence[str] = ()):
        self.dir = tempfile.mkdtemp(prefix="hicached-demo-")
        self.endpoint = f"ipc://{self.dir}/hicached.sock"
        # the child writes here for its whole life; closed in close()
        self.log = open(os.path.join(self.dir, "daemon.log"), "ab")  # noqa: SIM115
        self.argv = [sys.executable, "-m", "hicached", "serve", "--endpoint", self.endpoint,
                     "--l2-size", l2_size, "--slab-size", slab_size, "--state-dir",
                     os.path.join(self.dir, "state"), *extra]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for_daemon(self.endpoint, self.proc)

    def restart(self, sig: int, extra: Sequence[str] = ()) -> float:
        """Stop the daemon with ``sig`` (SIGTERM: a clean stop; SIGKILL: a crash) and start it
        again on the same state dir, ``extra`` flags added (``--cold``); returns the seconds
        from the new process's start to its first answered ping."""
        self.proc.send_signal(sig)
        self.proc.wait(30)
        t0 = time.monotonic()
        self.proc = subprocess.Popen([*self.argv, *extra], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        wait_for_daemon(self.endpoint, self.proc)
        return time.monotonic() - t0

    def close(self) -> None:
        """Stop the daemon and remove its files: the temp dir, and the arena it kept in /dev/shm
        (``--on-stop keep``, or a kill) — the state dir that records it goes with the temp dir,
        so nothing else could find it afterwards."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        from hicached.ops.arenas import free_arenas, recorded_arena

        state = os.path.join(self.dir, "state")
        try:
            recorded = recorded_arena(state)
            if recorded:
                free_arenas(state, recorded)
        except Exception as e:  # (a demo's cleanup: say it, never hide the run's own error)
            print(f"warning: the demo daemon's arena was not freed: {e}", file=sys.stderr)
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_for_daemon(endpoint: str, proc: subprocess.Popen | None = None,
                    timeout_s: float = 30.0) -> None:
    """Return once a daemon answers at ``endpoint``; raise if it does not (or ``proc`` died)."""
    from hicached.client.api import Client
    from hicached.errors import DaemonUnavailable

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"hicached daemon exited with {proc.returncode}")
        try:
            with Client(endpoint, "probe", timeout_s=1.0) as c:
                c.ping()
            return
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class Turn:
    conv: int
    turn: int
    prompt: int
    ttft_s: float
    hits: dict


def workload(args, vocab: int, seed: int = 0) -> Iterator[tuple[int, int, list[int]]]:
    """(conversation, turn, user tokens): conversations share ``--systems`` system prompts."""
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(0, vocab, (args.system_tokens,), generator=g).tolist()
               for _ in range(args.systems)]
    for turn in range(args.turns):
        for conv in range(args.conversations):
            user = torch.randint(0, vocab, (args.user_tokens,), generator=g).tolist()
            yield conv, turn, (systems[conv % args.systems] if turn == 0 else []) + user


def run_phase(lm, cfg, args, progress: Progress, label: str) -> list[Turn]:
    """Run the workload on a fresh engine; returns one record per turn."""
    from hicached.engine.engine import Engine

    eng = Engine(lm, cfg)
    history: dict[int, list[int]] = {}
    out = []
    try:
        for conv, turn, new in workload(args, lm.vocab_size):
            prompt = history.get(conv, []) + new
            req = eng.generate(prompt, args.new_tokens)
            history[conv] = prompt + req.output_ids
            out.append(Turn(conv, turn, len(prompt), req.ttft_s, req.hit_sources()))
            progress.advance(f"{lm.arch}: {label}")
        eng.check_idle()
    finally:
        eng.close()
    return out


def report(arch: str, results: dict[str, list[Turn]]) -> str:
    """Per-turn table of every phase against "no cache", then a summary per phase. A turn's
    speed-up is shown only where some of its prompt came from a cache (L1, L2 or L3): where
    every token was computed, the two runs did the same work and their ratio is noise ("-")."""
    base = results["no cache"]
    header = (f"{'phase':<12} {'conv':>4} {'turn':>4} {'prompt':>6} {'no-cache':>9} "
              f"{'ttft':>8} {'speedup':>7} {'L1':>5} {'L2':>5} {'L3':>5} {'computed':>8}")
    lines = [f"\n{arch}: TTFT per turn (ms) and prompt tokens by source", header]
    for phase in list(results)[1:]:
        for t, b in zip(results[phase], base):
            h = t.hits
            speedup = f"{b.ttft_s / t.ttft_s:>6.1f}x" if h["computed"] < t.prompt else "-"
            lines.append(f"{phase:<12} {t.conv:>4} {t.turn:>4} {t.prompt:>6} "
                         f"{b.ttft_s * 1e3:>9.1f} {t.ttft_s * 1e3:>8.1f} "
                         f"{speedup:>7} {h['l1']:>5} {h['l2']:>5} {h['l3']:>5} "
                         f"{h['computed']:>8}")
    lines.append(f"{'phase':<12} {'hit rate':>9} {'mean ttft ms':>13} {'vs no cache':>12}")
    for phase, turns in results.items():
        prompt = sum(t.prompt for t in turns)
        hit = sum(t.prompt - t.hits["computed"] for t in turns)
        mean = sum(t.ttft_s for t in turns) / len(turns)
        ref = sum(t.ttft_s for t in base) / len(base)
        lines.append(f"{phase:<12} {hit / prompt:>8.0%} {mean * 1e3:>13.1f} {ref / mean:>11.1f}x")
    return "\n".join(lines)


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None,
                   help="comma-separated: qwen3_next, deepseek_v32 (default: both; with --pd "
                        "qwen3_next)")
    p.add_argument("--pd", action="store_true",
                   help="PD disaggregation: a prefill and a decode process, without and with "
                        "the decode-side radix cache")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--systems", type=int, default=2, help="distinct system prompts")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (tiny models gain nothing from more)")
    p.add_argument("--flush-daemon-l2", action="store_true",
                   help="with --hicached-endpoint: run the L3 phase, which flushes that "
                        "daemon's L2 (skipped otherwise; always run on the demo's own daemon)")
    add_engine_args(p)
    p.set_defaults(storage_backend="hicached")


def settle_l3(admin, timeout_s: float = 20.0) -> None:
    """Wait (bounded) until the daemon's write-through to L3 has caught up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = admin.stats()
        if s["l3_tier"]["jobs_in_flight"] == 0 and s["l3_writes"] >= s["l2_pages"]:
            return
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    """The demo (see the module docstring); prints the report to stdout."""
    from hicached.client.api import Client
    from hicached.engine.models import load_model

    if args.pd:
        from hicached.engine.pd.demo import run_pd
        return run_pd(args)
    models = args.models or "qwen3_next,deepseek_v32"
    archs = [a.strip() for a in models.split(",") if a.strip()]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    daemon = None
    endpoint = args.hicached_endpoint
    if args.storage_backend == "hicached":
        if endpoint:
            wait_for_daemon(endpoint, timeout_s=5.0)
        else:
            daemon = DaemonLauncher()
            endpoint = daemon.endpoint
            print(f"started hicached at {endpoint}")
    if args.storage_backend != "hicached":
        phases = DEVICE_ONLY
    elif daemon is None and not args.flush_daemon_l2:
        phases = PHASES[:3]
        print(f"the L3 phase is skipped: it flushes the L2 of the daemon at {endpoint}, which "
              "is not the demo's own (--flush-daemon-l2 runs it)", flush=True)
    else:
        phases = PHASES
    per_model = args.turns * args.conversations
    progress = Progress(len(archs) * len(phases) * per_model)
    try:
        for arch in archs:
            lm = load_model(arch, seed=args.seed, device=args.device)
            lm.warmup(args.page_size)
            cfg = config_from_args(args, hicached_endpoint=endpoint)
            results = {"no cache": run_phase(
                lm, config_from_args(args, disable_radix_cache=True, storage_backend="none"),
                args, progress, "no cache")}
            for phase in phases[1:]:
                if phase == "L3":
                    with Client(endpoint, "admin") as admin:
                        settle_l3(admin)
                        admin.flush("l2")
                results[phase] = run_phase(lm, cfg, args, progress, phase)
            print(report(arch, results), flush=True)
    finally:
        torch.set_num_threads(threads)
        if daemon is not None:
            daemon.close()
    return 0


def engine_install_hint() -> str | None:
    """What to install when the reference engine's extra (``transformers``) is missing, in the
    form that fits how hicached was installed (None: it is there)."""
    try:
        import transformers  # noqa: F401 - the models come from it (the demo loads it anyway)
    except ImportError:
        pass
    else:
        return None
    return install_hint("engine")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hicached demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_args(p)
    args = p.parse_args(argv)
    hint = engine_install_hint()
    if hint is not None:
        print(f"hicached demo: the reference engine needs its extra (transformers): {hint}",
              file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
