"""``hicached demo --pd``: the demo's multi-turn chat through a prefill and a decode process, run
without and with the decode-side radix cache side by side, each request to both in turn
(``runner.py``, the runner of ``tools/bench_pd.py``), one node.

Per request it prints the prompt tokens the decode held itself (its radix cache's match: only
the rest is asked of the prefill), the bytes moved into the decode (the prefill's pages and
state through the node's daemon, and what the decode's arrival load-back read there) and the
TTFT, both modes side by side; then each mode's totals and whether their outputs are equal.
"""

from __future__ import annotations

import argparse
import tempfile

from hicached.engine.pd.procs import EngineSpec, daemons
from hicached.engine.pd.runner import ModeRun, Workload, compare, run_both

DEFAULT_MODELS = "qwen3_next"


def run_pd(args: argparse.Namespace) -> int:
    """The PD demo with the demo's flags (``hicached demo --pd --help``)."""
    from hicached.engine.demo import Progress, wait_for_daemon
    from hicached.engine.models import load_model

    if args.storage_backend != "hicached":
        print("hicached demo --pd: pages go from the prefill to the decode through hicached; "
              "drop --hicache-storage-backend none")
        return 2
    archs = [a.strip() for a in (args.models or DEFAULT_MODELS).split(",") if a.strip()]
    w = Workload(args.systems, args.system_tokens, args.user_tokens, args.conversations,
                 args.turns, args.new_tokens, args.seed)
    if args.hicached_endpoint:
        wait_for_daemon(args.hicached_endpoint, timeout_s=5.0)
    progress = Progress(2 * w.requests * len(archs))
    with tempfile.TemporaryDirectory(prefix="hicached-demo-pd-") as tmp, \
            daemons(1, endpoint=args.hicached_endpoint) as ends:
        if not args.hicached_endpoint:
            print(f"started hicached at {ends.decode}", flush=True)
        for arch in archs:
            path = f"{tmp}/{arch}"
            lm = load_model(arch, seed=args.seed, path=path)
            spec = EngineSpec(path, arch, args.page_size, args.kv_pages, args.state_slots,
                              args.track_interval, args.prefill_chunk_pages, args.threads,
                              args.debug_pools, args.device)
            off, on = run_both(w, spec, ends, tmp, lm.vocab_size, progress.advance)
            print(report(arch, off, on), flush=True)
    return 0


def _kib(n: float) -> str:
    return f"{n / 1024:.0f}"


def report(arch: str, off: ModeRun, on: ModeRun) -> str:
    """Per-request table of both modes, then a summary per mode. A request's speed-up is shown
    only where the decode held some of its prompt (matched > 0): otherwise both modes did the
    same work and their ratio is noise ("-")."""
    c = compare(off, on)
    u = on.usage[-1]
    title = (f"\n{arch}: PD on one node (page {u.page_size} tokens = {_kib(u.page_bytes)} "
             f"KiB, state {_kib(u.state_bytes)} KiB): per request, prompt tokens the decode "
             "held (matched), KiB moved into the decode and TTFT (ms), without / with the "
             "decode-side radix cache")
    header = (f"{'conv':>4} {'turn':>4} {'prompt':>6} {'matched':>7} {'KiB off':>8} "
              f"{'KiB on':>7} {'ttft off':>8} {'ttft on':>8} {'speedup':>7}")
    lines = [title, header]
    for a, b in zip(off.records, on.records, strict=True):
        speedup = f"{a.ttft_s / b.ttft_s:>6.1f}x" if b.matched else "-"
        lines.append(f"{b.conv:>4} {b.turn:>4} {b.prompt:>6} {b.matched:>7} "
                     f"{_kib(a.nbytes):>8} {_kib(b.nbytes):>7} {a.ttft_s * 1e3:>8.1f} "
                     f"{b.ttft_s * 1e3:>8.1f} {speedup:>7}")
    lines.append(f"{'mode':<10} {'matched':>8} {'KiB/request':>12} {'ttft p50':>9} "
                 f"{'ttft p99':>9} {'pool in use':>12}")
    for label, s in (("radix off", c["off"]), ("radix on", c["on"])):
        lines.append(f"{label:<10} {s['matched_share']:>8.0%} "
                     f"{_kib(s['bytes_per_request']):>12} {s['ttft_p50_ms']:>9.1f} "
                     f"{s['ttft_p99_ms']:>9.1f} {s['pool_used_tokens_max']:>12}")
    r = c["on_over_off"]
    lines.append(f"on / off: bytes moved {r['bytes_per_request']:.2f}, TTFT p50 "
                 f"{r['ttft_p50_ms']:.2f}, p99 {r['ttft_p99_ms']:.2f}")
    lines.append(f"outputs equal across modes: {'yes' if c['outputs_equal'] else 'NO'} "
                 f"(max |logit difference| {c['max_logit_diff']:.1e})")
    return "\n".join(lines)
