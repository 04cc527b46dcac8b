"""A multi-turn chat workload through PD processes, with and without the decode-side radix cache:
the runner of ``tools/bench_pd.py`` and ``hicached demo --pd``.

One run (``run_both``; the processes come from ``procs.py``):

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

import math
import os
import random
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from hicached.engine.pd.procs import Endpoints, EngineProc, EngineSpec, RunError

if TYPE_CHECKING:  # (torch: imported where a run starts, so that a bad flag fails in a blink)
    from hicached.engine.pd import protocol as M
    from hicached.engine.pd.server import PDClient

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
        from hicached.engine.pd.server import PDClient

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
