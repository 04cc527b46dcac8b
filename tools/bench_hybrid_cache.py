"""Hybrid cache controller benchmark (issue 25): token hit rate per L2 budget and eviction policy.

A seeded trace of hybrid-model (Qwen3-Next-like: KV pages plus one Mamba state per endpoint)
requests is replayed through a real daemon (``python -m hicached serve``, L3 off, one daemon per
budget and policy) by one client, the way SGLang's hybrid cache controller drives a storage
backend. For each request, whose finished sequence (prompt + reply) has pages 0..n-1 of 64
tokens, keys chained like SGLang's page hashes (sha256 of the parent's digest + the page's
token ids, 64 hex):

    exists   batch_exists_v2(the prompt's pages, [KV ALL_PAGES, MAMBA TRAILING_PAGES window 1])
             -> L, the longest prefix every pool can restore (the state at page L-1 included)
    get      batch_get_v2([KV pages 0..L-1, MAMBA state of page L-1]) (L > 0)
    set      the pages the request computed, L..n-1, in calls of --set-batch (128) KV pages,
             each with parent = the key before its first page (None at depth 0), depth, anchor
             pool KV; the MAMBA transfer (TRAILING_PAGES) rides on the call holding its page:
             the state at the last full page (n-1) and at every branching point passed
             (the end of a shared system prompt, few-shot prefix, document instruction or
             document), as SGLang's Mamba radix cache keeps states where its tree branches

A hit is L whole pages restored: the prompt's tokens counted are all but its last (SGLang matches
at most len - 1), hit tokens are 64 L. Only the daemon caches: the engine is modelled with no
radix cache of its own (each request asks storage).

Geometry, stated in bytes (bench scale; the ratio is what matters):

    KV page      64 tokens x 4 full-attention layers x 2 KV heads x head_dim 8 x K,V x bf16
                 = 256 B a token, 16 KiB a page (MHA, page_first)
    Mamba state  --state-pages (32) KV pages of bytes: 4 linear-attention layers x (SSM state
                 [p, 32, 31] fp32 + conv state [4, 16 p] bf16) = 512 KiB at 32. Qwen3-Next-80B
                 (12 full-attention layers of 2 KV heads x 256; 36 Gated DeltaNet layers of
                 32 x 128 x 128 states): a state holds ~49 KV pages of bytes at TP 1-2 with an
                 fp32 SSM state, ~25 at TP 4 (KV heads replicated) or in bf16: --state-pages 16..48

The trace (``--trace``; ``--seed``, default the mix's) mixes, with Zipf popularity (weight of
rank r ~ 1 / r^s) over each kind's items:

    chat       multi-turn conversations in the mix's slots: a turn's prompt is its system
               prompt (one of a few long ones) + every earlier turn (user message + reply) + a
               new user message, so it extends its own prefix; a conversation ends after its
               turns and a new one takes its slot. Branch: the system prompt's end
    fewshot    one of a few long few-shot prefixes + a fresh question. Branch: the prefix's end
    document   a shared instruction + one of the mix's live documents + a fresh question; a
               document is asked a few times, then a new one takes its slot. Branches: the
               instruction's end, the document's end

    mix1   chat-heavy: 55 % chat (4 system prompts of 1k-3k tokens, 300 conversation slots of
           3-20 turns, user messages 50-1500 tokens, replies 100-1200), 20 % few-shot (6
           prefixes of 1.5k-5k, questions 40-300, answers 10-120), 25 % documents (64 live,
           4k-16k tokens, 2-8 queries each); Zipf s = 0.9; 1600 requests, seed 1
    mix2   documents and few-shot: 25 % chat (3 system prompts of 0.8k-3k, 100 slots of 3-16
           turns), 35 % few-shot (10 prefixes of 1k-6k, questions 30-200, answers 5-80), 40 %
           documents (48 live, 5k-20k tokens, 2-6 queries); Zipf s = 1.0; 1000 requests,
           seed 2: the trace to check defaults chosen on mix1 against

The working set is every page and state the trace stores (what an unbounded L2 holds at the
end). L2 budgets (--budgets, % of it: 5, 10, 25, 50) and an unbounded L2 (working set x 1.1: the
ceiling) each run once per policy (--policies lru,prefix,hybrid; ``hybrid:A`` passes
``--eviction-alpha A``; each passes ``--eviction NAME``). The first --warmup (10 %) of the requests are replayed but not counted. Printed per
budget and policy:

    hit rate      hit tokens / prompt tokens; / LRU's; / the ceiling's
    orphans       bytes no hit can use, max and mean over samples every --sample-every (50)
                  requests, also as % of the arena: the daemon's (stats "l2_orphan_bytes"; n/a
                  when it has none) and the client's own count from the shared presence table
                  (a KV page whose chain lost an ancestor, a state whose KV prefix is not all
                  there); "dead KV": KV pages with a whole chain but no state at or below them
                  (no hit can end in their subtree, so a hybrid client cannot use them)
    B/hit tok     bytes read (KV pages + states) per hit token
    latency       exists / get / set p50 and p99 (ms)

Targets (issue 25): at 5 % >= 1.5 x LRU's hit rate; at 10 % >= 0.85 x the ceiling; at no budget
below LRU; orphan bytes <= 1 % of the arena at every sample; exists / get / set p99 no worse
than LRU's by more than 10 %. The unbounded run's hit rate must equal the trace's own ceiling
(computed offline with no eviction): the summary says when it does not.

    python tools/bench_hybrid_cache.py [--trace mix1|mix2] [--seed N] [--policies lru,prefix,hybrid]
        [--budgets 5,10,25,50] [--requests N] [--state-pages 32] [--daemon-args "..."] [--json]
    python tools/bench_hybrid_cache.py --small   # a tiny trace, 2 budgets: a check that it runs

A real trace instead of a mix (issue 48; ``trace_bench.py`` says how it is replayed, every policy
interleaved, with the oracles of ``hybrid_oracle.py`` beside each budget):

    python tools/bench_hybrid_cache.py --trace-file conversation_trace.jsonl
        [--geometry attention,hybrid] [--budgets 2,5,10,25] [--requests N] [--speedup 60]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling modules)
from hybrid_report import add_ratios, print_report, targets
from hybrid_trace import (
    KV_HEAD_DIM,
    KV_HEADS,
    KV_LAYERS,
    KV_PAGE_BYTES,
    MIXES,
    PAGE_TOKENS,
    Trace,
    make_trace,
    states_to_set,
    summary,
)

MAMBA_LAYERS = 4
NS = "bench-hybrid|qwen3-next-like|bf16|tp0of1"
HEADROOM = 1.1  # the unbounded arena over the working set


def progress(msg: str) -> None:
    print(f"[bench_hybrid_cache {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank below (as bench_index's)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(len(s) * q + 0.5) - 1))] if s else float("nan")


# ----------------------------------------------------------------- the daemon


def start_daemon(tmp: str, l2_bytes: int, slab_bytes: int, extra: list[str]):
    """``python -m hicached serve`` on an ipc socket in ``tmp``, L3 off; (process, endpoint)
    once it answers a ping."""
    from hicached import Client
    from hicached.errors import DaemonUnavailable

    endpoint = f"ipc://{tmp}/bench.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--endpoint", endpoint,
         "--l2-size", str(l2_bytes), "--slab-size", str(slab_bytes), "--state-dir",
         f"{tmp}/state", "--l3-backend", "none", "--log-level", "warning", *extra],
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
    raise SystemExit(f"daemon did not start (exit {proc.returncode}; does it know the options "
                     f"{extra}? is /dev/shm full of arenas of killed daemons?)")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (not SIGKILL: the daemon removes its arena file on the way out), then wait."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def policy_args(policy: str) -> list[str]:
    """``NAME`` -> --eviction NAME; ``NAME:A`` -> --eviction NAME --eviction-alpha A."""
    name, _, alpha = policy.partition(":")
    return ["--eviction", name] + (["--eviction-alpha", alpha] if alpha else [])


# ----------------------------------------------------------------- orphans


def presence_masks(client, keys: list[str]) -> tuple[np.ndarray, int, int] | None:
    """(pool bits of each of ``keys``, the ``kv`` pool's bit, the ``mamba`` pool's bit; 0: no
    such pool) from the daemon's shared presence table (``Client._conn.shared``), or None: no
    usable table, or no read agreed. The daemon may be evicting in its idle turns while this
    reads: a slot changing under the read gives None, and pages read before and after a page
    went can look like a chain without its head; so it reads until two reads a moment apart
    agree (at most 100)."""
    shared = client._conn.shared
    if shared is None or shared.view.usable() is None:
        return None
    masks = None
    for _ in range(100):
        again = shared.view.lookup(keys)
        if again is not None and masks is not None and np.array_equal(again, masks):
            break
        masks = again
        time.sleep(0.002)
    if masks is None:
        return None
    return masks, shared.bits.get("kv", 0), shared.bits.get("mamba", 0)


class Orphans:
    """Orphans counted by the client from the daemon's shared presence table (which says, per
    key, which pools L2 holds it in: ``presence_masks``). Reads client internals
    (``Client._conn.shared``), as bench_index does: a cross-check of the daemon's own figure.
    A KV page is an orphan when an earlier page of its chain is absent; a state when its KV
    prefix is not all present (no grace). ``trace_bench.py`` counts with it too."""

    def __init__(self, trace: Trace, state_bytes: int = 0):
        self.keys, self.parent, self.state_bytes = trace.keys, trace.parent, state_bytes
        order = np.argsort(trace.depth, kind="stable")
        bounds = np.searchsorted(trace.depth[order], np.arange(trace.depth.max() + 2))
        self.levels = [order[bounds[d]:bounds[d + 1]] for d in range(len(bounds) - 1)]

    def _read(self, client, upto: int, states: bool):
        """(kv, st, whole, levels) of the first ``upto`` keys (bool per key: KV present, state
        present, KV pages 0..i all present; the levels cut at ``upto``), or None (no usable
        table, no KV pool, or ``states`` and no state pool)."""
        got = presence_masks(client, self.keys[:upto])
        if got is None:
            return None
        masks, kv_bit, st_bit = got
        if not kv_bit or (states and not st_bit):
            return None
        kv = (masks & kv_bit) != 0
        st = (masks & st_bit) != 0 if st_bit else np.zeros_like(kv)
        whole = kv.copy()  # KV pages 0..i all in L2
        parent = self.parent[:upto]
        cut = [lv[lv < upto] for lv in self.levels]
        for lv in cut[1:]:
            whole[lv] &= whole[parent[lv]]
        return kv, st, whole, cut

    def sample(self, client, upto: int) -> dict | None:
        """Bytes of the first ``upto`` keys' pages no hit can use, or None (no usable table).
        ``orphan``: KV pages whose chain lost an ancestor, and states whose KV prefix is not
        whole; ``dead_kv``: KV pages of whole chains with no state at or below them."""
        got = self._read(client, upto, states=True)
        if got is None:
            return None
        kv, st, whole, cut = got
        parent = self.parent[:upto]
        useful = st & whole  # a hit can end at this page, or below it
        for lv in reversed(cut[1:]):
            np.logical_or.at(useful, parent[lv], useful[lv])
        return {"orphan": int((kv & ~whole).sum()) * KV_PAGE_BYTES
                + int((st & ~whole).sum()) * self.state_bytes,
                "dead_kv": int((whole & ~useful).sum()) * KV_PAGE_BYTES}

    def count(self, client, upto: int) -> tuple[int, int] | None:
        """(orphan pages, resident pages) among the first ``upto`` keys, or None (no usable
        table, or no KV pool)."""
        got = self._read(client, upto, states=False)
        if got is None:
            return None
        kv, st, whole, _ = got
        orphan = int((kv & ~whole).sum()) + int((st & ~whole).sum())
        return orphan, int(kv.sum()) + int(st.sum())


# ----------------------------------------------------------------- the replay


def pools(trace: Trace, state_pages: int):
    """The engine's host pools: KV pages for the longest sequence, Mamba slots for one get and
    the most states one set call stores; noise in both."""
    import torch

    from hicached import HostPool

    max_pages = max(len(r.keys) for r in trace.requests)
    kv = HostPool.allocate_mha(max_pages, PAGE_TOKENS, KV_LAYERS, KV_HEADS, KV_HEAD_DIM,
                               layout="page_first", dtype=torch.bfloat16)
    kv.kv_buffer.normal_()
    slots = 1 + max(len(r.branches) + 1 for r in trace.requests)
    mamba = HostPool.allocate_mamba(slots, MAMBA_LAYERS, (state_pages, 32, 31),
                                    [(4, 16 * state_pages)])
    for b in mamba.buffers:
        b.copy_(torch.randn(b.shape).to(b.dtype))
    assert kv.page_bytes == KV_PAGE_BYTES, kv.page_bytes
    assert mamba.page_bytes == state_pages * KV_PAGE_BYTES, mamba.page_bytes
    return kv, mamba


def replay(endpoint: str, trace: Trace, state_pages: int, warmup: int, sample_every: int,
           set_batch: int, orphans: Orphans) -> dict:
    """Every request of ``trace`` through one client, in order (see the module docstring)."""
    import torch

    from hicached import Client, PoolHitPolicy, PoolName, PoolTransfer

    KV, MAMBA = PoolName.KV, PoolName.MAMBA
    ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
    state_bytes = state_pages * KV_PAGE_BYTES
    kv_pool, mamba_pool = pools(trace, state_pages)
    lat: dict[str, list[float]] = {"exists": [], "get": [], "set": []}
    hit_tokens = prompt_tokens = bytes_read = 0
    get_misses = set_refused = 0
    daemon_orphans: list[int] = []
    client_orphans: list[int] = []
    dead_kv: list[int] = []
    seen = 0  # distinct keys the requests so far named (ids are first-seen order)
    with Client(endpoint, NS, timeout_s=30.0) as c:
        c.register_mem_host_pool_v2(kv_pool, KV)
        c.register_mem_host_pool_v2(mamba_pool, MAMBA)
        for i, req in enumerate(trace.requests):
            keys, n, p = req.keys, len(req.keys), req.prompt_pages
            seen = max(seen, max(req.ids) + 1)
            hit = 0
            if p:
                t = time.perf_counter()
                r = c.batch_exists_v2(keys[:p], [
                    PoolTransfer(KV, keys=keys[:p], hit_policy=ALL),
                    PoolTransfer(MAMBA, keys=keys[p - 1:p], hit_policy=TRAILING)])
                lat["exists"].append((time.perf_counter() - t) * 1e3)
                hit = r.kv_hit_pages
            if hit:
                t = time.perf_counter()
                got = c.batch_get_v2([
                    PoolTransfer(KV, torch.arange(hit * PAGE_TOKENS), keys=keys[:hit]),
                    PoolTransfer(MAMBA, torch.tensor([0]), keys=keys[hit - 1:hit],
                                 hit_policy=TRAILING)])
                lat["get"].append((time.perf_counter() - t) * 1e3)
                if not (all(got["kv"]) and all(got["mamba"])):
                    get_misses += 1  # (one client, in order: nothing evicts in between)
                    hit = 0
            states = states_to_set(req, hit)
            slot = {b: 1 + j for j, b in enumerate(states)}
            for lo in range(hit, n, set_batch):
                hi = min(n, lo + set_batch)
                mine = [b for b in states if lo < b <= hi]  # the states of this call's pages
                transfers = [PoolTransfer(KV, torch.arange(lo * PAGE_TOKENS, hi * PAGE_TOKENS),
                                          keys=keys[lo:hi], hit_policy=ALL)]
                if mine:
                    transfers.append(PoolTransfer(
                        MAMBA, torch.tensor([slot[b] for b in mine]),
                        keys=[keys[b - 1] for b in mine], hit_policy=TRAILING))
                t = time.perf_counter()
                res = c.batch_set_v2(transfers, parent=keys[lo - 1] if lo else None, depth=lo,
                                     anchor_pool=KV)
                lat["set"].append((time.perf_counter() - t) * 1e3)
                set_refused += sum(row.count(False) for row in res.values())
            if i >= warmup:
                hit_tokens += hit * PAGE_TOKENS
                prompt_tokens += req.prompt_tokens
                bytes_read += hit * KV_PAGE_BYTES + (state_bytes if hit else 0)
            if (i + 1) % sample_every == 0 or i + 1 == len(trace.requests):
                st = c.stats()
                if st.get("l2_orphan_bytes") is not None:
                    daemon_orphans.append(int(st["l2_orphan_bytes"]))
                o = orphans.sample(c, seen)
                if o is not None:
                    client_orphans.append(o["orphan"])
                    dead_kv.append(o["dead_kv"])
        st = c.stats()
    return {
        "hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
        "hit_rate": hit_tokens / max(1, prompt_tokens),
        "bytes_read_per_hit_token": bytes_read / hit_tokens if hit_tokens else None,
        "get_misses": get_misses, "set_refused": set_refused,
        "eviction": st.get("eviction"), "evictions": st.get("evictions"),
        "l2_used_bytes": st.get("l2_used_bytes"),
        "orphans_daemon": _spread(daemon_orphans), "orphans_client": _spread(client_orphans),
        "dead_kv": _spread(dead_kv),
        **{k: {"count": len(v), "p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99)}
           for k, v in lat.items()},
    }


def _spread(samples: list[int]) -> dict | None:
    return {"max": max(samples), "mean": sum(samples) / len(samples),
            "samples": len(samples)} if samples else None


# ----------------------------------------------------------------- the runs and the table


def arena_bytes(budget: float | None, working_set: int, slab_bytes: int) -> int:
    """The L2 size of a budget (a fraction of the working set; None: unbounded, the working
    set x HEADROOM), a whole number of slabs, at least 4."""
    want = working_set * (HEADROOM if budget is None else budget)
    return max(4, math.ceil(want / slab_bytes)) * slab_bytes


def run_all(args, trace: Trace, info: dict) -> list[dict]:
    """One daemon per (budget, policy), budgets in order (the ceiling last), every policy at
    each budget before the next budget."""
    orphans = Orphans(trace, info["state_bytes"])
    warmup = info["warmup_requests"]
    runs = []
    budgets: list[float | None] = [b / 100 for b in args.budgets] + [None]
    for budget in budgets:
        l2 = arena_bytes(budget, info["working_set_bytes"], args.slab_size)
        for policy in args.policies:
            extra = policy_args(policy) + shlex.split(args.daemon_args)
            label = "unbounded" if budget is None else f"{budget:.0%}"
            progress(f"{label} ({l2 / 2**20:.0f} MiB arena), {policy}")
            started = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as tmp:
                proc, endpoint = start_daemon(tmp, l2, args.slab_size, extra)
                try:
                    r = replay(endpoint, trace, args.state_pages, warmup, args.sample_every,
                               args.set_batch, orphans)
                finally:
                    stop(proc)
            if r["eviction"] is not None and r["eviction"] != policy.partition(":")[0]:
                raise SystemExit(f"asked for eviction {policy!r}, the daemon runs "
                                 f"{r['eviction']!r}")
            runs.append({"budget": budget, "policy": policy, "l2_bytes": l2,
                         "seconds": time.monotonic() - started, **r})
    add_ratios(runs)
    return runs


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def trace_file_main(args) -> None:
    """``--trace-file``: the Mooncake-format replay of ``trace_bench.py``."""
    import mooncake_trace

    bad = [g for g in args.geometry if g not in mooncake_trace.GEOMETRIES]
    if bad or not args.geometry:
        raise SystemExit(f"--geometry: {','.join(args.geometry)!r}: each must be one of "
                         f"{', '.join(mooncake_trace.GEOMETRIES)}")
    if "lru" not in args.policies:
        raise SystemExit(f"--policies: {','.join(args.policies)!r} lacks lru (the ratios are "
                         f"to it)")
    state_bytes = args.state_pages * mooncake_trace.KV_PAGE_BYTES
    if not 1 <= args.state_pages <= 256 or args.slab_size % 64 or args.slab_size < state_bytes:
        raise SystemExit(f"--state-pages must be in 1..256 (got {args.state_pages}) and "
                         f"--slab-size a multiple of 64 holding a state ({state_bytes} bytes), "
                         f"got {args.slab_size}")
    if args.speedup < 0 or args.sample_every < 0:
        raise SystemExit(f"--speedup ({args.speedup}) and --sample-every ({args.sample_every}) "
                         f"must be >= 0")
    try:
        mooncake_trace.read_rows(args.trace_file, 1)
    except mooncake_trace.TraceFileError as e:
        raise SystemExit(f"--trace-file: {e}") from e
    import torch  # (here: a bad flag fails before seconds of imports)
    import trace_bench

    torch.set_num_threads(1)
    result = trace_bench.run(args)
    if args.json:
        print(json.dumps({"config": {
            "policies": args.policies, "budgets_pct": args.budgets,
            "state_pages": args.state_pages, "slab_bytes": args.slab_size,
            "speedup": args.speedup, "set_batch": args.set_batch,
            "daemon_args": args.daemon_args}, **result}, indent=2))
    else:
        trace_bench.print_report(result, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", choices=sorted(MIXES), default="mix1")
    ap.add_argument("--seed", type=int, default=None, help="the trace's seed (default: the mix's)")
    ap.add_argument("--requests", type=int, default=None, help="requests (default: the mix's)")
    ap.add_argument("--policies", type=_csv(str), default=["lru", "prefix", "hybrid"],
                    help="comma-separated: lru, prefix, hybrid, hybrid:ALPHA (default all three)")
    ap.add_argument("--budgets", type=_csv(float), default=[5, 10, 25, 50],
                    help="L2 budgets, %% of the working set (an unbounded run is always added)")
    ap.add_argument("--state-pages", type=int, default=32,
                    help="a Mamba state's bytes in KV pages (16..48: Qwen3-Next-80B, TP 1-4)")
    ap.add_argument("--slab-size", type=int, default=4 << 20, help="daemon slab bytes")
    ap.add_argument("--warmup", type=float, default=0.1,
                    help="fraction of the requests replayed but not counted")
    ap.add_argument("--sample-every", type=int, default=50,
                    help="requests between orphan samples")
    ap.add_argument("--set-batch", type=int, default=128, help="KV pages a set call holds")
    ap.add_argument("--daemon-args", default="", help="more `hicached serve` options")
    ap.add_argument("--small", action="store_true",
                    help="a tiny run: 120 requests, budgets 10 and 25 %%, 1 MiB slabs")
    ap.add_argument("--trace-file", default=None,
                    help="replay a trace in Mooncake's format instead of a mix (trace_bench.py)")
    ap.add_argument("--geometry", type=_csv(str), default=["attention", "hybrid"],
                    help="--trace-file: attention, hybrid or both (comma-separated)")
    ap.add_argument("--speedup", type=float, default=60.0,
                    help="--trace-file: replay at this x the trace's clock (0: unpaced)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.small:  # its own defaults; flags given still win
        ap.set_defaults(requests=120, budgets=[10, 25], slab_size=1 << 20, sample_every=20)
        args = ap.parse_args()
    if args.trace_file is not None:  # a trace file's own defaults; flags given still win
        from mooncake_trace import STATE_PAGES

        ap.set_defaults(budgets=[2, 5, 10, 25], state_pages=STATE_PAGES, slab_size=256 << 10,
                        sample_every=0, warmup=0.0)
        args = ap.parse_args()
        return trace_file_main(args)
    if not 1 <= args.state_pages <= 256:
        raise SystemExit(f"--state-pages must be in 1..256, got {args.state_pages}")
    if args.slab_size % 64 or args.slab_size < args.state_pages * KV_PAGE_BYTES:
        raise SystemExit(f"--slab-size must be a multiple of 64 holding a state "
                         f"({args.state_pages * KV_PAGE_BYTES} bytes), got {args.slab_size}")
    import torch

    torch.set_num_threads(1)  # the copies are small; idle threads would spin
    progress(f"building trace {args.trace}")
    trace = make_trace(args.trace, args.seed, args.requests)
    info = summary(trace, int(len(trace.requests) * args.warmup),
                   args.state_pages * KV_PAGE_BYTES)
    progress(f"{info['requests']} requests, working set {info['working_set_bytes'] / 2**20:.0f} "
             f"MiB, ceiling hit rate {info['ceiling_hit_rate']:.4f}")
    gc.collect()
    gc.freeze()  # the trace's objects: out of every later collection (steadier p99)
    runs = run_all(args, trace, info)
    if args.json:
        print(json.dumps({"trace": info, "config": {
            "policies": args.policies, "budgets_pct": args.budgets,
            "state_pages": args.state_pages, "slab_bytes": args.slab_size,
            "warmup": args.warmup, "sample_every": args.sample_every,
            "set_batch": args.set_batch, "daemon_args": args.daemon_args},
            "runs": runs, "targets": [{"policy": p, "target": w, "met": m}
                                      for p, w, m in targets(runs)]}, indent=2))
    else:
        print_report(info, runs, args)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks stop the daemon
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
