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
- ``admit_store``: ``lru`` that stores only what is read again, and keeps it until LRU drops
  it (issue 48's "knows what is read again": what a perfect admission filter is worth);
- ``leaf``: leaf-first LRU (SGLang's radix cache): the least recently used item with no child
  held goes, so a chain loses its tail first;
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
    python tools/hybrid_oracle.py --trace-file conversation_trace.jsonl [--geometry attention]
        [--budgets 2,5,10,25] [--requests N] [--policies lru,leaf,...]

A trace file (``mooncake_trace.py``: Mooncake's format) is replayed in each geometry asked,
budgets a share of its working set in bytes (in the attention-only geometry every page has
the same bytes, so that is a share of its unique full blocks: issue 48's table's setting),
with no warm-up unless ``--warmup`` says.
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
    Trace,
    add_trace_args,
    make_trace,
    parse_budgets,
    replay_unbounded,
    stored_states,
    summary,
)

NEVER = 1 << 40  # the next use of an item no request asks for again
POLICIES = ("lru", "leaf", "belady", "admit", "admit_store", "s3fifo", "visible")
THETAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)  # visible: read-again frequencies tried as the cut
SMALL = 0.1  # s3fifo: the new items' FIFO, share of the budget
GHOSTS = 100_000  # s3fifo: items the ghost list remembers


def _hit(trace: Trace, req, present) -> int:
    """The pages of ``req``'s hit: its longest prompt prefix whose KV pages and (hybrid
    geometry) the state at its end are ``present`` (items as ``simulate``'s)."""
    ids, kv = req.ids, 0
    while kv < req.prompt_pages and present(2 * ids[kv]):
        kv += 1
    while trace.with_states and kv and not present(2 * ids[kv - 1] + 1):
        kv -= 1
    return kv


def _read(trace: Trace, req, hit: int) -> list[int]:
    """The items a hit of ``hit`` pages reads: its KV pages, and the state at its end."""
    ids = req.ids
    return [2 * x for x in ids[:hit]] + ([2 * ids[hit - 1] + 1]
                                         if hit and trace.with_states else [])


def _stored(trace: Trace, req, hit: int) -> list[int]:
    """The items a request with ``hit`` pages restored stores: the KV pages it computed, and
    its states."""
    ids = req.ids
    return [2 * x for x in ids[hit:]] + [2 * ids[b - 1] + 1
                                         for b in stored_states(trace, req, hit)]


def _s3fifo(trace: Trace, budget: int, state_bytes: int, warmup: int) -> dict:
    size = (trace.kv_page_bytes, state_bytes)
    small: OrderedDict[int, int] = OrderedDict()  # item -> reads while in it, the oldest first
    main: OrderedDict[int, None] = OrderedDict()
    ghosts: OrderedDict[int, None] = OrderedDict()
    held = {"small": 0, "main": 0}
    hit_tokens = prompt_tokens = 0

    def present(item: int) -> bool:
        return item in small or item in main

    for i, req in enumerate(trace.requests):
        ids = req.ids
        hit = _hit(trace, req, present)
        if i >= warmup:
            hit_tokens += hit * trace.page_tokens
            prompt_tokens += req.prompt_tokens
        for item in _read(trace, req, hit):
            if item in small:
                small[item] += 1
            else:
                main.move_to_end(item)
        for item in _stored(trace, req, hit):
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


def _leaf(trace: Trace, budget: int, state_bytes: int, warmup: int) -> dict:
    """Leaf-first LRU: the least recently used item with no child held goes (SGLang's radix
    cache: a chain loses its tail first, never its head while a tail stays). An item's children
    are the KV pages under its page and, for a KV page, the state at it."""
    size = (trace.kv_page_bytes, state_bytes)
    parent = trace.parent
    last: dict[int, int] = {}  # held item -> its last use (a tick)
    kids: dict[int, int] = {}  # held item -> its held children
    heap: list[tuple[int, int]] = []  # (last use, item), stale entries skipped
    tick = used = hit_tokens = prompt_tokens = 0

    def up(item: int) -> int:  # the item's parent item, -1 at a root
        if item & 1:
            return item - 1
        x = int(parent[item >> 1])
        return 2 * x if x >= 0 else -1

    for i, req in enumerate(trace.requests):
        hit = _hit(trace, req, last.__contains__)
        if i >= warmup:
            hit_tokens += hit * trace.page_tokens
            prompt_tokens += req.prompt_tokens
        for item in _read(trace, req, hit) + _stored(trace, req, hit):
            tick += 1
            if item not in last:
                used += size[item & 1]
                kids[item] = 0
                u = up(item)
                if u >= 0:
                    kids[u] += 1
            last[item] = tick
            heapq.heappush(heap, (tick, item))
        while used > budget:
            t, item = heapq.heappop(heap)
            if last.get(item) != t or kids[item]:
                continue  # touched since, gone, or not a leaf (pushed again when it is one)
            del last[item], kids[item]
            used -= size[item & 1]
            u = up(item)
            if u >= 0:
                kids[u] -= 1
                if not kids[u]:
                    heapq.heappush(heap, (last[u], u))
    return {"policy": "leaf", "budget_bytes": budget, "hit_tokens": hit_tokens,
            "prompt_tokens": prompt_tokens, "hit_rate": hit_tokens / max(1, prompt_tokens)}


def _bucket(n: int) -> int:
    return 0 if n <= 0 else min(6, 1 + n.bit_length() - 1)


def _lru_seen(trace: Trace, budget: int, state_bytes: int, warmup: int, uses: dict,
              fit: dict | None, demoted: dict | None, theta: float) -> float:
    """``visible``'s LRU pass: features of each stored item as a store sees them; with ``fit``,
    count per class whether the item is read again; with ``demoted`` (class -> read-again
    frequency), store an item of a class below ``theta`` at the LRU end. The hit rate."""
    size = (trace.kv_page_bytes, state_bytes)
    order: OrderedDict[int, None] = OrderedDict()
    used = hit_tokens = prompt_tokens = 0
    kids: dict[int, int] = {}
    reads: dict[int, int] = {}
    ends: set[int] = set()
    for i, req in enumerate(trace.requests):
        ids, n = req.ids, len(req.ids)
        hit = _hit(trace, req, order.__contains__)
        if i >= warmup:
            hit_tokens += hit * trace.page_tokens
            prompt_tokens += req.prompt_tokens
        for item in _read(trace, req, hit):
            order.move_to_end(item)
        at = ids[hit - 1] if hit else -1  # the key the stored pages hang from
        shape = (_bucket(kids.get(at, 0) + 1) if hit else -1, at in ends,
                 _bucket(reads.get(at, 0)) if hit else -1, _bucket(n - hit))
        if hit:
            reads[at] = reads.get(at, 0) + 1
            if n > hit:
                kids[at] = kids.get(at, 0) + 1
        stored = [(2 * ids[j], (0, j == n - 1, *shape)) for j in range(hit, n)]
        stored += [(2 * ids[b - 1] + 1, (1, b == n, *shape))
                   for b in stored_states(trace, req, hit)]
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
        if hit and trace.with_states:
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
    if policy == "leaf":
        return _leaf(trace, budget, state_bytes, warmup)
    if policy == "visible":
        return _visible(trace, budget, state_bytes, warmup)
    # an item is a KV page (2 x id) or the state at that page (2 x id + 1)
    size = (trace.kv_page_bytes, state_bytes)
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

    def use(item: int, now: int, fresh: bool = False) -> None:
        if (policy == "admit" or policy == "admit_store" and fresh) and next_use(
                item, now) == NEVER:
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
        hit = _hit(trace, req, cache.__contains__)
        if i >= warmup:
            hit_tokens += hit * trace.page_tokens
            prompt_tokens += req.prompt_tokens
        touched = _read(trace, req, hit)
        stored = _stored(trace, req, hit)
        for item in touched:
            use(item, i)
        for item in stored:
            fresh = item not in cache
            if fresh:
                cache[item] = -1
                used += size[item & 1]
            use(item, i, fresh)
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


def load_traces(ap, args) -> list[tuple[Trace, int, int]]:
    """(trace, warm-up requests, state bytes) per geometry asked: the mix, or with
    ``--trace-file`` the Mooncake trace in each of ``--geometry``'s geometries (no warm-up and
    states of ``mooncake_trace.STATE_PAGES`` pages unless given)."""
    if args.state_pages is not None and args.state_pages < 1:
        ap.error("--state-pages: must be >= 1")
    if args.trace_file is None:
        trace = make_trace(args.trace, args.seed, args.requests)
        warmup = int(len(trace.requests) * (0.1 if args.warmup is None else args.warmup))
        return [(trace, warmup, (args.state_pages or 32) * trace.kv_page_bytes)]
    import mooncake_trace

    out = []
    for geometry in args.geometry.split(","):
        try:
            trace = mooncake_trace.load(args.trace_file, geometry, args.requests)
        except ValueError as e:  # TraceFileError, or an unknown geometry
            ap.error(f"--trace-file / --geometry: {e}")
        warmup = int(len(trace.requests) * (args.warmup or 0.0))
        pages = mooncake_trace.STATE_PAGES if args.state_pages is None else args.state_pages
        out.append((trace, warmup, pages * trace.kv_page_bytes if trace.with_states else 0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap, "5,10,25,50")
    ap.add_argument("--trace-file", default=None,
                    help="a trace in Mooncake's format (JSON lines) instead of a mix")
    ap.add_argument("--geometry", default="attention,hybrid",
                    help="--trace-file: attention, hybrid or both (comma-separated)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, of {', '.join(POLICIES)}")
    ap.set_defaults(state_pages=None, warmup=None)  # the trace's kind chooses
    args = ap.parse_args(argv)
    if args.trace_file is not None and args.budgets == "5,10,25,50":
        args.budgets = "2,5,10,25"
    budgets = parse_budgets(ap, args.budgets)
    policies = [p for p in args.policies.split(",") if p]
    if not policies or any(p not in POLICIES for p in policies) or "lru" not in policies:
        ap.error(f"--policies: {args.policies!r}: each must be one of {', '.join(POLICIES)}, "
                 f"lru among them (the ratios are to it)")
    results = []
    for trace, warmup, state_bytes in load_traces(ap, args):
        info = summary(trace, warmup, state_bytes)
        rows = []
        for pct in budgets:
            budget = int(info["working_set_bytes"] * pct / 100)
            row = {"budget_pct": pct}
            for policy in policies:
                row[policy] = simulate(trace, budget, policy, state_bytes, warmup)["hit_rate"]
            rows.append(row)
        results.append((trace, info, rows))
    if args.json:
        if args.trace_file is None:
            print(json.dumps({"trace": results[0][1], "budgets": results[0][2]}, indent=1))
        else:
            print(json.dumps({"geometries": [{"trace": info, "budgets": rows}
                                             for _, info, rows in results]}, indent=1))
        return 0
    for trace, info, rows in results:
        ceil = info["ceiling_hit_rate"]
        print(f"hybrid_oracle: trace {trace.name} ({info['geometry']}), "
              f"{len(trace.requests)} requests, working set "
              f"{info['working_set_bytes'] / 2**20:,.1f} MiB ({info['stored_kv_pages']} KV "
              f"pages, {info['stored_states']} states), ceiling {ceil:.4f}")
        print("hit rate (ratio to the simulated LRU's; to the ceiling)")
        print("budget  " + "".join(f"{p:>22s}" for p in policies))
        for row in rows:
            lru = row["lru"]
            cells = [f"{row[p]:.4f} ({row[p] / lru if lru else 0:.2f}; "
                     f"{row[p] / ceil if ceil else 0:.2f})" for p in policies]
            print(f"{row['budget_pct']:5g} %  " + "".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
