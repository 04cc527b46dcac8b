"""What an eviction policy could reach on a hybrid trace: offline policies, simulated (issue 25).

``bench_hybrid_cache.py`` measures the daemon's policies through real daemons. This replays the
same trace (``hybrid_trace.py``: its requests, hit rule and stored states) against an L2 of a given
budget simulated here, in bytes, with:

- ``lru``: the least recently used item goes (a page read by a hit or stored is used; a check of
  the simulation against the daemon's ``lru`` in the bench);
- ``belady``: the item whose next use lies farthest in the future goes (an offline oracle: it
  knows every request to come). An item is next used by the next request whose hit, were
  nothing ever evicted, would read it: a KV page within that hit, a state at its end (a state
  mid-way is not read); never again goes first, the bigger first; on a tie the deeper page goes
  first (a descendant is never used before its ancestor, so no chain loses its head while a tail
  stays). A page stored with the farthest next use goes at once: the oracle may decline to keep
  what it stores, which the daemon may not.

- ``admit``: ``lru`` that keeps no item the oracle knows is never used again (it stores it and
  drops it at once, or drops it at its last use): what knowing only *whether* an item comes
  back is worth, without knowing *when*;
- ``s3fifo``: an online policy that keeps what is read twice (S3-FIFO: new items enter a FIFO
  of a tenth of the budget, leave it for the main LRU only if read meanwhile, and come back
  straight to the main LRU if stored again while a ghost list remembers them): a check that
  one-hit wonders are not what LRU loses to;
- ``visible``: the best that a store can predict from what it sees, fitted with hindsight.
  Each item a request stores gets the features a daemon could know then: KV page or state, a
  state at the request's end or at a branching point, the children and the reads the key it
  hangs from has had so far, whether that key held the end state of an earlier request (a
  conversation continued), how many pages the request stored. An LRU run records, per feature
  class, how often the items stored in that class were read again (knowing the future); then
  LRU runs again with every item whose class was read again less often than ``theta`` put at
  the LRU end as it is stored (the next to go). The best of ``THETAS`` (0: LRU itself) is
  reported. An online learner of these features can do no better than their hindsight
  frequencies, so this bounds what such a predictor is worth on the trace.

Belady's rule is optimal for pages of one size and one use each; with multi-MB states and hits
that need a state at their end it is not an upper bound in theory, but it is what a policy
knowing the future does. If the oracle stays below a target, no online policy can be expected to
reach it on this trace.

    python tools/hybrid_oracle.py [--trace mix1|mix2] [--budgets 5,10,25,50] [--state-pages 32]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_trace import (
    KV_PAGE_BYTES,
    PAGE_TOKENS,
    Trace,
    add_trace_args,
    make_trace,
    parse_budgets,
    replay_unbounded,
    states_to_set,
    summary,
)

NEVER = 1 << 40  # the next use of an item no request asks for again
POLICIES = ("lru", "belady", "admit", "s3fifo", "visible")
THETAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)  # visible: read-again frequencies tried as the cut
SMALL = 0.1  # s3fifo: the new items' FIFO, share of the budget
GHOSTS = 100_000  # s3fifo: items the ghost list remembers


def _hit(req, present) -> int:
    """The pages of ``req``'s hit: its longest prompt prefix whose KV pages and the state at
    its end are ``present`` (items as ``simulate``'s)."""
    ids, kv = req.ids, 0
    while kv < req.prompt_pages and present(2 * ids[kv]):
        kv += 1
    while kv and not present(2 * ids[kv - 1] + 1):
        kv -= 1
    return kv


def _s3fifo(trace: Trace, budget: int, state_bytes: int, warmup: int) -> dict:
    size = (KV_PAGE_BYTES, state_bytes)
    small: OrderedDict[int, int] = OrderedDict()  # item -> reads while in it, the oldest first
    main: OrderedDict[int, None] = OrderedDict()
    ghosts: OrderedDict[int, None] = OrderedDict()
    held = {"small": 0, "main": 0}
    hit_tokens = prompt_tokens = 0

    def present(item: int) -> bool:
        return item in small or item in main

    for i, req in enumerate(trace.requests):
        ids = req.ids
        hit = _hit(req, present)
        if i >= warmup:
            hit_tokens += hit * PAGE_TOKENS
            prompt_tokens += req.prompt_tokens
        for item in [2 * x for x in ids[:hit]] + ([2 * ids[hit - 1] + 1] if hit else []):
            if item in small:
                small[item] += 1
            else:
                main.move_to_end(item)
        for item in [2 * x for x in ids[hit:]] + [2 * ids[b - 1] + 1
                                                   for b in states_to_set(req, hit)]:
            if present(item):
                continue
            if item in ghosts:  # stored again soon after it left unread: the main LRU
                del ghosts[item]
                main[item] = None
                held["main"] += size[item & 1]
            else:
                small[item] = 0
                held["small"] += size[item & 1]
        while held["small"] + held["main"] > budget:
            if held["small"] > SMALL * budget or not main:
                item, reads = small.popitem(last=False)
                held["small"] -= size[item & 1]
                if reads:
                    main[item] = None
                    held["main"] += size[item & 1]
                else:
                    ghosts[item] = None
                    if len(ghosts) > GHOSTS:
                        ghosts.popitem(last=False)
            else:
                item, _ = main.popitem(last=False)
                held["main"] -= size[item & 1]
    return {"policy": "s3fifo", "budget_bytes": budget, "hit_tokens": hit_tokens,
            "prompt_tokens": prompt_tokens, "hit_rate": hit_tokens / max(1, prompt_tokens)}


def _bucket(n: int) -> int:
    return 0 if n <= 0 else min(6, 1 + n.bit_length() - 1)


def _lru_seen(trace: Trace, budget: int, state_bytes: int, warmup: int, uses: dict,
              fit: dict | None, demoted: dict | None, theta: float) -> float:
    """``visible``'s LRU pass: features of each stored item as a store sees them; with ``fit``,
    count per class whether the item is read again; with ``demoted`` (class -> read-again
    frequency), store an item of a class below ``theta`` at the LRU end. The hit rate."""
    size = (KV_PAGE_BYTES, state_bytes)
    order: OrderedDict[int, None] = OrderedDict()
    used = hit_tokens = prompt_tokens = 0
    kids: dict[int, int] = {}
    reads: dict[int, int] = {}
    ends: set[int] = set()
    for i, req in enumerate(trace.requests):
        ids, n = req.ids, len(req.ids)
        hit = _hit(req, order.__contains__)
        if i >= warmup:
            hit_tokens += hit * PAGE_TOKENS
            prompt_tokens += req.prompt_tokens
        for item in [2 * x for x in ids[:hit]] + ([2 * ids[hit - 1] + 1] if hit else []):
            order.move_to_end(item)
        at = ids[hit - 1] if hit else -1  # the key the stored pages hang from
        shape = (_bucket(kids.get(at, 0) + 1) if hit else -1, at in ends,
                 _bucket(reads.get(at, 0)) if hit else -1, _bucket(n - hit))
        if hit:
            reads[at] = reads.get(at, 0) + 1
            if n > hit:
                kids[at] = kids.get(at, 0) + 1
        stored = [(2 * ids[j], (0, j == n - 1, *shape)) for j in range(hit, n)]
        stored += [(2 * ids[b - 1] + 1, (1, b == n, *shape)) for b in states_to_set(req, hit)]
        if n:
            ends.add(ids[n - 1])
        for item, cls in stored:
            if fit is not None:
                seq = uses.get(item, ())
                again = bisect.bisect_right(seq, i) < len(seq)
                counts = fit.setdefault(cls, [0, 0])
                counts[0] += again
                counts[1] += 1
            if item in order:
                order.move_to_end(item)
                continue
            order[item] = None
            used += size[item & 1]
            if demoted is not None and demoted.get(cls, 1.0) < theta:
                order.move_to_end(item, last=False)
        while used > budget:
            item, _ = order.popitem(last=False)
            used -= size[item & 1]
    return hit_tokens / max(1, prompt_tokens)


def _uses(trace: Trace) -> dict[int, list[int]]:
    """Item -> the requests that use it, in order (with nothing ever evicted)."""
    uses: dict[int, list[int]] = {}
    for i, hit in enumerate(replay_unbounded(trace)[0]):
        ids = trace.requests[i].ids
        for x in ids[:hit]:
            uses.setdefault(2 * x, []).append(i)
        if hit:
            uses.setdefault(2 * ids[hit - 1] + 1, []).append(i)
    return uses


def _visible(trace: Trace, budget: int, state_bytes: int, warmup: int) -> dict:
    uses, fit = _uses(trace), {}
    _lru_seen(trace, budget, state_bytes, warmup, uses, fit, None, 0.0)
    freq = {cls: again / total for cls, (again, total) in fit.items()}
    rates = {theta: _lru_seen(trace, budget, state_bytes, warmup, uses, None, freq, theta)
             for theta in THETAS}
    theta = max(rates, key=lambda t: (rates[t], -t))
    prompt = sum(r.prompt_tokens for r in trace.requests[warmup:])
    return {"policy": "visible", "budget_bytes": budget, "hit_rate": rates[theta],
            "hit_tokens": round(rates[theta] * prompt), "prompt_tokens": prompt,
            "theta": theta, "classes": len(fit)}


def simulate(trace: Trace, budget: int, policy: str, state_bytes: int, warmup: int) -> dict:
    """Replay ``trace`` against an L2 of ``budget`` bytes under ``policy`` (``lru`` or
    ``belady``); the hit rate of the requests from ``warmup`` on."""
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    if policy == "s3fifo":
        return _s3fifo(trace, budget, state_bytes, warmup)
    if policy == "visible":
        return _visible(trace, budget, state_bytes, warmup)
    # an item is a KV page (2 x id) or the state at that page (2 x id + 1)
    size = (KV_PAGE_BYTES, state_bytes)
    uses = _uses(trace)  # item -> the requests that use it, in order
    depth = trace.depth

    def next_use(item: int, now: int) -> int:
        seq = uses.get(item)
        if not seq:
            return NEVER
        j = bisect.bisect_right(seq, now)
        return seq[j] if j < len(seq) else NEVER

    cache: dict[int, int] = {}  # item -> the next use its heap entry has (belady) / 0 (lru)
    order: OrderedDict[int, None] = OrderedDict()  # lru: the oldest first
    heap: list[tuple[int, int, int, int]] = []  # belady: (-next use, -bytes, -depth, item)
    used = hit_tokens = prompt_tokens = 0

    def use(item: int, now: int) -> None:
        if policy == "admit" and next_use(item, now) == NEVER:
            order.pop(item, None)  # its last use: it goes now
            cache.pop(item)
            nonlocal used
            used -= size[item & 1]
            return
        if policy != "belady":
            order[item] = None
            order.move_to_end(item)
            return
        nu = next_use(item, now)
        if cache.get(item) != nu:
            cache[item] = nu
            heapq.heappush(heap, (-nu, -size[item & 1], -int(depth[item >> 1]), item))

    for i, req in enumerate(trace.requests):
        ids, p = req.ids, req.prompt_pages
        hit = _hit(req, cache.__contains__)
        if i >= warmup:
            hit_tokens += hit * PAGE_TOKENS
            prompt_tokens += req.prompt_tokens
        touched = [2 * x for x in ids[:hit]] + ([2 * ids[hit - 1] + 1] if hit else [])
        stored = [2 * x for x in ids[hit:]] + [2 * ids[b - 1] + 1 for b in states_to_set(req, hit)]
        for item in touched:
            use(item, i)
        for item in stored:
            if item not in cache:
                cache[item] = -1
                used += size[item & 1]
            use(item, i)
        if policy == "belady":  # the prompt's other pages held: their next use moved on
            for x in ids[hit:p]:
                for item in (2 * x, 2 * x + 1):
                    if item in cache:
                        use(item, i)
        while used > budget:
            if policy != "belady":
                item, _ = order.popitem(last=False)
            else:
                nu, _, _, item = heapq.heappop(heap)
                if cache.get(item) != -nu:
                    continue  # an entry of an earlier next use
            del cache[item]
            used -= size[item & 1]
    return {"policy": policy, "budget_bytes": budget, "hit_tokens": hit_tokens,
            "prompt_tokens": prompt_tokens, "hit_rate": hit_tokens / max(1, prompt_tokens)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap, "5,10,25,50")
    args = ap.parse_args(argv)
    budgets = parse_budgets(ap, args.budgets)
    if args.state_pages < 1:
        ap.error("--state-pages: must be >= 1")
    trace = make_trace(args.trace, args.seed, args.requests)
    warmup = int(len(trace.requests) * args.warmup)
    state_bytes = args.state_pages * KV_PAGE_BYTES
    info = summary(trace, warmup, state_bytes)
    rows = []
    for pct in budgets:
        budget = int(info["working_set_bytes"] * pct / 100)
        row = {"budget_pct": pct}
        for policy in POLICIES:
            row[policy] = simulate(trace, budget, policy, state_bytes, warmup)["hit_rate"]
        rows.append(row)
    if args.json:
        print(json.dumps({"trace": info, "budgets": rows}, indent=1))
        return 0
    ceil = info["ceiling_hit_rate"]
    print(f"hybrid_oracle: trace {trace.name} (seed {trace.seed}), {len(trace.requests)} requests, "
          f"working set {info['working_set_bytes'] / 2**20:,.1f} MiB, ceiling {ceil:.4f}")
    print("hit rate (ratio to the simulated LRU's; to the ceiling)")
    print("budget  lru (sim)     belady (offline)        admit (offline)      s3fifo (online)"
          "  visible (hindsight)")
    for row in rows:
        lru = row["lru"]
        cells = [f"{row[pol]:.4f} ({row[pol] / lru if lru else 0:.2f}; "
                 f"{row[pol] / ceil if ceil else 0:.2f})" for pol in POLICIES[1:]]
        print(f"{row['budget_pct']:5g} %  {lru:9.4f}  " + "  ".join(f"{c:>20s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
