"""PD disaggregation with and without the decode-side radix cache, side by side in one run.

The shape of SGLang's decode-radix benchmark (PR #19746: 20 unique 50k-token prefixes, 4.5k-token
suffixes, ~91 % prefix reuse, a fixed number of requests), scaled to a CPU: 20 prefixes of
``--prefix-tokens``, ``--conversations`` multi-turn chats on them (a fresh ``--suffix-tokens``
user message and ``--new-tokens`` answer per turn), sent turn by turn, one request at a time,
each to both modes in alternating order (both modes' processes run side by side).
The reference engine's prefill and decode run as processes (``python -m hicached.engine.pd``)
on one node, pages through the node's daemon (L2 only), or with ``--nodes 2`` against two
daemons sharing a ``mooncake_master`` on loopback (the prefill's pages reach the decode through
the store: Ready once they are in L3), with and without
``--disaggregation-decode-enable-radix-cache``, side by side (``hicached.engine.pd.runner``).

Per mode: bytes moved into the decode per request (the prefill's delta and what the decode's
arrival load-back read from the daemon), TTFT p50 / p99 as the decode measures it (arrival to
first token, its loads included) and where its mean went (waiting for the prefill's Ready, of
that the prefill storing the pages; the decode loading the delta), the decode KV pool's tokens
in use, and whether the outputs
of the two modes are equal request by request (they must be). Then the ratios on / off.
Target (issue 28): bytes moved <= 0.15 x the run without the decode-side cache.

The model is the engine's tiny Qwen3-Next widened until moving pages matters: by default 4 layers
(2 gated delta net, 2 attention) with 8 KV heads of 64 dims, fp32, so a 32-token page is 256 KiB
of KV. The pools hold the whole workload (nothing is evicted).

    python tools/bench_pd.py                      # ~400 requests, a few minutes on 2 cores
    python tools/bench_pd.py --conversations 40 --turns 3 --prefix-tokens 512
    python tools/bench_pd.py --nodes 2            # two daemons sharing a mooncake_master
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile

from hicached.engine.pd.procs import NODES, EngineSpec, check_nodes, daemons, pool_sizes
from hicached.engine.pd.runner import Workload, compare, run_both
from hicached.settings import parse_size

TARGET_BYTES = 0.15


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, choices=NODES, default=1,
                   help="1: prefill and decode share one daemon; 2: two daemons sharing a "
                        "mooncake_master on loopback (pages through L3)")
    w = Workload()
    p.add_argument("--prefixes", type=int, default=w.prefixes, help="unique long prefixes")
    p.add_argument("--prefix-tokens", type=int, default=w.prefix_tokens)
    p.add_argument("--suffix-tokens", type=int, default=w.suffix_tokens,
                   help="tokens of each user message")
    p.add_argument("--conversations", type=int, default=w.conversations)
    p.add_argument("--turns", type=int, default=w.turns)
    p.add_argument("--new-tokens", type=int, default=w.new_tokens)
    p.add_argument("--seed", type=int, default=0, help="weights and tokens")
    p.add_argument("--layers", type=int, default=4, help="half gated delta net, half attention")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--track-interval", type=int, default=64)
    p.add_argument("--prefill-chunk-pages", type=int, default=1)
    p.add_argument("--device", default="cpu", help="the engines' (cpu, cuda, ...)")
    p.add_argument("--kv-pages", type=int, default=0, help="each engine's (0: the workload's)")
    p.add_argument("--state-slots", type=int, default=0, help="each engine's (0: the workload's)")
    p.add_argument("--sequential", action="store_true",
                   help="one mode after the other instead of side by side (half the engines' "
                        "memory at a time; the machine's drift then falls on one mode)")
    p.add_argument("--decode-l2", default="",
                   help="two nodes: the decode daemon's L2 size (e.g. 64MiB; default: as the "
                        "prefill's, which holds the whole run); one smaller than the prefixes "
                        "keeps no copy on the decode's node between requests")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p.parse_args(argv)


def device_bytes(lm, page_size: int) -> tuple[int, int]:
    """Bytes of one KV page (and its indexer page) and of one state, as the engine's pools
    lay them out."""
    from hicached.engine.pools import IndexerPool, KVPool, StatePool

    g = lm.geometry
    kv = KVPool(g.kind, 1, page_size, len(g.attn_layers), g.kv_heads, g.k_dim, g.v_dim,
                g.kv_dtype, lm.device).host.page_bytes
    if g.has_indexer:
        kv += IndexerPool(1, page_size, len(g.attn_layers), g.indexer_dim, g.indexer_dtype,
                          lm.device).host.page_bytes
    state = StatePool(1, len(g.linear_layers), g.conv_shape, g.recurrent_shape, g.state_dtype,
                      lm.device, conv_dtype=g.conv_dtype).host.page_bytes if g.hybrid else 0
    return kv, state


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_nodes(args.nodes)
        if args.decode_l2 and args.nodes != 2:
            raise ValueError("--decode-l2 needs --nodes 2 (one node has one daemon)")
        if args.decode_l2:
            parse_size(args.decode_l2, "--decode-l2")
        w = Workload(args.prefixes, args.prefix_tokens, args.suffix_tokens, args.conversations,
                     args.turns, args.new_tokens, args.seed)
    except ValueError as e:  # (a ConfigError too)
        print(f"bench_pd: {e}", file=sys.stderr)
        return 2
    from hicached.engine.models import load_model

    kv_pages, slots = pool_sizes(w, args.page_size, args.track_interval)
    kv_pages, slots = args.kv_pages or kv_pages, args.state_slots or slots
    with tempfile.TemporaryDirectory(prefix="hicached-bench-pd-") as tmp:
        lm = load_model("qwen3_next", seed=args.seed, path=f"{tmp}/ckpt",
                        num_hidden_layers=args.layers, num_attention_heads=args.kv_heads,
                        num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
        page_bytes, state_bytes = device_bytes(lm, args.page_size)
        # both modes' pages (each its own tenant) and a quarter more: the arena is allocated
        # and mapped pre-faulted, by the daemon and by every engine
        pages = math.ceil(w.unique_tokens() / args.page_size)
        l2 = max(256 << 20, int(2.5 * (pages * page_bytes + slots * state_bytes)))
        spec = EngineSpec(f"{tmp}/ckpt", "qwen3_next", args.page_size, kv_pages, slots,
                          args.track_interval, args.prefill_chunk_pages, device=args.device)
        # two nodes: each daemon mounts as much into the store as its L2 holds, so that the
        # store keeps every page of the run (nothing is evicted there either)
        with daemons(args.nodes, l2_size=f"{l2 >> 20}MiB", segment=f"{l2 >> 20}MiB",
                     decode_l2_size=args.decode_l2) as ends:
            off, on = run_both(w, spec, ends, tmp, lm.vocab_size, progress(w),
                               interleave=not args.sequential)
    c = compare(off, on)
    c.update(nodes=args.nodes, page_size=args.page_size, page_bytes=page_bytes,
             state_bytes=state_bytes, workload=w.__dict__, nominal_reuse=w.nominal_reuse,
             device=args.device, decode_l2=args.decode_l2, model={"layers": args.layers, "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim, "identity": lm.identity},
             target_bytes=TARGET_BYTES)
    if args.json:
        json.dump(c, sys.stdout)
        print()
    else:
        report(c, w)
    return 0 if c["outputs_equal"] else 1


def progress(w: Workload):
    """A one-line progress bar on stderr over both modes' requests."""
    from hicached.engine.demo import Progress

    bar = Progress(2 * w.requests)
    return bar.advance


def report(c: dict, w: Workload) -> None:
    off, on, ratio = c["off"], c["on"], c["on_over_off"]
    m = c["model"]
    print(f"qwen3_next {m['layers']} layers ({m['layers'] // 2} attention, {m['kv_heads']} KV "
          f"heads x {m['head_dim']}), fp32 on {c['device']}; page {c['page_size']} tokens = "
          f"{c['page_bytes'] / 1024:.0f} KiB of KV, state {c['state_bytes'] / 1024:.0f} KiB")
    print(f"{w.prefixes} prefixes x {w.prefix_tokens} tokens, {w.conversations} conversations x "
          f"{w.turns} turns = {w.requests} requests ({w.suffix_tokens}-token messages, "
          f"{w.new_tokens} new tokens); prefix reuse {c['nominal_reuse']:.1%} a first turn, "
          f"{off['reusable_share']:.1%} of all prompt tokens")
    where = ("one daemon (L2)" if c["nodes"] == 1 else
             "two daemons sharing a mooncake_master (TCP on loopback; pages through L3)")
    if c["decode_l2"]:
        where += f", the decode's L2 {c['decode_l2']}"
    print(f"{c['nodes']} node{'s' if c['nodes'] > 1 else ''}: prefill and decode processes on "
          f"{where}, one request at a time, to both modes in turn; decode KV pool "
          f"{off['pool_tokens']} tokens")
    rows = [
        ("decode-side match (tokens / request)", "matched_tokens_mean", 0, None),
        ("KV pages moved into the decode / request", "pages_per_request", 1, None),
        ("bytes moved into the decode / request (MiB)", "bytes_per_request", 3,
         "bytes_per_request"),
        *([("  of them read from the store (pages, states)", "store_loads_per_request", 1,
            None)] if c["nodes"] == 2 else []),
        ("TTFT p50 (ms)", "ttft_p50_ms", 1, "ttft_p50_ms"),
        ("TTFT p99 (ms)", "ttft_p99_ms", 1, "ttft_p99_ms"),
        ("TTFT mean (ms)", "ttft_mean_ms", 1, "ttft_mean_ms"),
        ("  of it: asking the prefill -> its Ready", "prefill_mean_ms", 1, None),
        ("    of that: the prefill storing the pages", "publish_mean_ms", 1, None),
        ("  of it: the decode loading the delta", "load_mean_ms", 1, None),
        ("decode KV pool in use, max (tokens)", "pool_used_tokens_max", 0,
         "pool_used_tokens_max"),
    ]
    print(f"{'metric':<46} {'radix off':>11} {'radix on':>11} {'on/off':>7}")
    for label, key, digits, rkey in rows:
        scale = 1 / (1 << 20) if key == "bytes_per_request" else 1
        r = ratio.get(rkey) if rkey else None
        print(f"{label:<46} {off[key] * scale:>11.{digits}f} {on[key] * scale:>11.{digits}f} "
              f"{f'{r:.3f}' if r is not None else '-':>7}")
    same = "yes" if c["outputs_equal"] else "NO"
    print(f"outputs equal across modes: {same} ({off['requests']} requests, max |logit "
          f"difference| {c['max_logit_diff']:.1e})")
    b = ratio["bytes_per_request"]
    verdict = "met" if b is not None and b <= c["target_bytes"] else "NOT met"
    print(f"target: bytes moved <= {c['target_bytes']} x without the decode radix: "
          f"{b:.3f} ({verdict})")


if __name__ == "__main__":
    code = main()
    gc.freeze()  # (exit: the interpreter's last collections walk transformers' objects for seconds)
    sys.exit(code)
