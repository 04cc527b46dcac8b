"""The hybrid trace replayed on the page index alone, in process (issue 25): the index's own work
per set call, per eviction policy, without sockets, clients, copies or the VM's noise on them.

``bench_hybrid_cache.py`` measures the daemon end to end, where a set's latency is mostly the
client, the socket and the copy; this drives ``PageIndex`` as the daemon's control loop does for
the same trace (``hybrid_trace.py``): per request, the hit (the longest prompt prefix whose KV
pages and the state at its end are held), a get's reads of those pages (``count_hits`` and
``touch_many``), then the set calls of up to 128 KV pages with their states (``reserve_many``,
``link``, ``commit_many``, the call's parent pinned meanwhile), and between requests the idle
turns' work (``Reclaimer.step``: the tails, and the rest of the leaf segments the sets split).
It prints per budget and policy the token hit rate, the evictions, the orphan bytes left at the
end, the index's CPU time per set call (``time.thread_time``: p50, p99, mean) and the pages a
set call evicted on its own path (p99, max: what its latency's tail is made of, which the VM
does not move).

Run it under ``valgrind --tool=callgrind`` (``--requests 400 --budgets 5``) for instruction
counts, which a shared VM does not move:

    python tools/hybrid_index_replay.py [--trace mix1] [--policies lru,hybrid] [--budgets 5,10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_trace import (
    KV_PAGE_BYTES,
    PAGE_TOKENS,
    Trace,
    add_trace_args,
    make_trace,
    parse_budgets,
    states_to_set,
    summary,
)

from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import PageIndex
from hicached.daemon.orphans import orphans
from hicached.daemon.slabs import SlabAllocator

SET_BATCH = 128  # KV pages a set call holds (as bench_hybrid_cache)
SLAB = 4 << 20
KV, MAMBA = ("ns", "kv"), ("ns", "mamba")


def replay(trace: Trace, policy: str, arena: int, state_pages: int, warmup: int) -> dict:
    """Every request of ``trace`` on a fresh index of ``arena`` bytes under ``policy``."""
    state = state_pages * KV_PAGE_BYTES
    name, _, alpha = policy.partition(":")
    ix = PageIndex(SlabAllocator(max(SLAB, arena // SLAB * SLAB), SLAB),
                   policy=make_policy(name, float(alpha) if alpha else 1.0),
                   busy=lambda: False)  # the tails go in idle turns, as in a daemon
    idle = ix.reclaimer
    ix.mark_trailing(MAMBA)
    times: list[float] = []
    evicted: list[int] = []  # pages each counted set call evicted on its own path
    hit_tokens = prompt_tokens = 0
    for i, req in enumerate(trace.requests):
        keys, n = req.keys, len(req.keys)
        hit = 0
        while hit < req.prompt_pages and ix.get(KV, keys[hit]) is not None:
            hit += 1
        while hit and ix.get(MAMBA, keys[hit - 1]) is None:
            hit -= 1
        if hit:
            read = [ix.get(KV, k) for k in keys[:hit]] + [ix.get(MAMBA, keys[hit - 1])]
            ix.count_hits(read)  # (a get counts its reads before the policy hears of them)
            ix.touch_many(read)
        if i >= warmup:
            hit_tokens += hit * PAGE_TOKENS
            prompt_tokens += req.prompt_tokens
        states = states_to_set(req, hit)
        for lo in range(hit, n, SET_BATCH):
            hi = min(n, lo + SET_BATCH)
            t, e0 = time.thread_time(), ix.evictions
            guard = ix.get(KV, keys[lo - 1]) if lo else None
            if guard is not None:
                ix.pin(guard)
            entries = ix.reserve_many(KV, [k for k in keys[lo:hi] if ix.get(KV, k) is None],
                                      KV_PAGE_BYTES, KV_PAGE_BYTES)
            mine = [keys[b - 1] for b in states if lo < b <= hi]
            mine = [k for k in mine if ix.get(MAMBA, k) is None]
            if mine:
                entries += ix.reserve_many(MAMBA, mine, state, state)
            ix.link("ns", keys[lo:hi], keys[lo - 1] if lo else None, lo)
            ix.commit_many([e for e in entries if e is not None])
            if guard is not None:
                ix.unpin(guard)
            if i >= warmup:
                times.append(time.thread_time() - t)
                evicted.append(ix.evictions - e0)
        while idle.wanted() and idle.step():
            pass
    ms = np.array(times) * 1e3
    idle.settle()
    return {"policy": policy, "arena_bytes": ix.alloc.capacity_bytes,
            "hit_rate": hit_tokens / max(1, prompt_tokens), "evictions": ix.evictions,
            "orphan_bytes_at_end": orphans(ix.records, leaving=idle.leaving())[1],
            "sets": len(ms), "set_p50_ms": float(np.percentile(ms, 50)) if len(ms) else 0.0,
            "set_p99_ms": float(np.percentile(ms, 99)) if len(ms) else 0.0,
            "set_mean_ms": float(ms.mean()) if len(ms) else 0.0,
            "set_evicted_p99": float(np.percentile(evicted, 99)) if evicted else 0.0,
            "set_evicted_max": max(evicted, default=0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap, "5,10")
    ap.add_argument("--policies", default="lru,hybrid")
    args = ap.parse_args(argv)
    budgets = parse_budgets(ap, args.budgets)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        name, _, alpha = p.partition(":")
        if name not in ("lru", "prefix", "hybrid") or (alpha and name != "hybrid"):
            ap.error(f"--policies: {p!r} is not lru, prefix, hybrid or hybrid:ALPHA")
    trace = make_trace(args.trace, args.seed, args.requests)
    warmup = int(len(trace.requests) * args.warmup)
    info = summary(trace, warmup, args.state_pages * KV_PAGE_BYTES)
    rows = [dict(replay(trace, p, int(info["working_set_bytes"] * pct / 100), args.state_pages,
                        warmup), budget_pct=pct)
            for pct in budgets for p in policies]
    if args.json:
        print(json.dumps({"trace": info, "runs": rows}, indent=1))
        return 0
    print(f"hybrid_index_replay: trace {trace.name} (seed {trace.seed}), {len(trace.requests)} "
          f"requests, working set {info['working_set_bytes'] / 2**20:,.1f} MiB")
    print("budget  policy      hit rate  evictions  index CPU per set call: p50 / p99 / mean ms"
          "  pages a set evicts: p99 / max")
    for r in rows:
        print(f"{r['budget_pct']:5g} %  {r['policy']:10s}  {r['hit_rate']:8.4f}  "
              f"{r['evictions']:9d}  {r['set_p50_ms']:.3f} / {r['set_p99_ms']:.3f} / "
              f"{r['set_mean_ms']:.3f}{'':>23s}{r['set_evicted_p99']:.0f} / {r['set_evicted_max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
