"""What a store sees when a page arrives, and what it predicts (issue 48's "visible" analysis on
real traces): features of each stored page with hindsight, and online policies built on them,
simulated as ``hybrid_oracle.py`` simulates (same trace, hit rule, byte budget).

Each KV page a request stores (the attention-only geometry: the issue's 5 % target is there) gets
what a store knows at that moment, with no eviction in the way of knowing it (a store can keep
the keys it has seen as metadata):

    depth     the page's depth in its chain (log2 buckets)
    extends   how the request's new pages hang: 0 a new root chain; 1 at a key with no child
              yet, the last full page of an earlier request (a conversation continued); 2 at a
              key that has children already (a branch from a shared prefix)
    reads     how often the key they hang from was read (a hit ending at or past it) so far
    gap       time since that key was last used (the trace's clock: a conversation's last turn),
              buckets 0 (none), < 1 s, < 10 s, < 1 min, < 5 min, < 20 min, more
    length    the request's full pages (log2 buckets)
    last      the page is the prompt's last full page
    new       the pages the request stores, past what was seen (log2 buckets)
    turns     earlier requests that ended on the chain the new pages extend (a conversation's
              turns so far; 5 and more in one bucket)

and its label with hindsight: read again by a later request (a hit over it, nothing evicted).
Per feature the table gives its values' read-again frequencies and the AUC of ranking pages by
that frequency (0.5: no information); ``all`` is the class of every feature at once (the most
that this feature set can tell, fitted on the trace itself).

Policies (``simulate``; budgets in bytes as the oracle's):

    visible_all   hindsight: LRU, with a page whose class (every feature) was read again less
                  often than theta stored at the LRU end; the best theta of ``THETAS``
    visible_online  ``visible_all``'s rule with each class's frequency learned online (first
                  reads so far over pages stored so far): what the hindsight fit is worth
                  without hindsight; classes of every feature, or of ``SUBSETS``' few; the
                  best theta reported with all of them (theta 1: every new page at the LRU
                  end, LRU's insertion policy "LIP", whatever its class)
    atc           online (ATC '25's "KVCache in the Wild" in spirit): each class's reuse
                  probability learned so far (first reads over pages stored, +1/+2 prior), a
                  page's priority log(p) + its last use / tau (exponential decay with trace
                  time tau); the lowest goes. Best tau of ``TAUS_S`` reported with all of them
    atc_hindsight ``atc`` with each class's probability fitted with hindsight: whether the gap
                  is in learning the classes online or in the classes
    leaf_freq     online: leaf-first (a chain loses its tail first) by last use / tau +
                  log2(1 + reads of the page)

    python tools/trace_features.py --trace-file conversation_trace.jsonl [--budgets 2,5,10]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mooncake_trace
from hybrid_oracle import _hit, _read, _stored, _uses, simulate
from hybrid_trace import Trace, parse_budgets, summary

FEATURES = ("depth", "extends", "reads", "gap", "length", "last", "new", "turns")
GAPS_S = (1, 10, 60, 300, 1200)
THETAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)  # 1.0: every new page demoted (LIP)
SUBSETS = {"all": FEATURES, "new+gap+depth": ("new", "gap", "depth")}  # visible_online's classes
TAUS_S = (10, 30, 60, 300, 1200)


def _log2b(n: int) -> int:
    return 0 if n <= 0 else min(9, n.bit_length())


def _gap(s: float | None) -> int:
    return 0 if s is None else 1 + bisect.bisect_right(GAPS_S, s)


_CLASSES: dict[int, tuple[Trace, tuple]] = {}  # id(trace) -> (trace, classes' answer)


def classes(trace: Trace) -> tuple[list[list[tuple]], list[list[bool]]]:
    """Per request, the feature tuple (``FEATURES``' order) of each KV page it stores with
    nothing evicted (its pages past what was seen), and whether it is read again."""
    memo = _CLASSES.get(id(trace))
    if memo is not None and memo[0] is trace:
        return memo[1]
    answer = _classes(trace)
    _CLASSES.clear()
    _CLASSES[id(trace)] = (trace, answer)
    return answer


def _classes(trace: Trace) -> tuple[list[list[tuple]], list[list[bool]]]:
    uses = _uses(trace)
    seen: set[int] = set()
    kids: dict[int, int] = {}
    ends: set[int] = set()
    turns: dict[int, int] = {}  # key -> requests that ended on its chain above it, when stored
    reads: dict[int, int] = {}
    last_use: dict[int, float] = {}
    times = trace.times_ms
    feats, labels = [], []
    for i, req in enumerate(trace.requests):
        ids, n, now = req.ids, len(req.ids), times[i] / 1e3
        hit = 0
        while hit < n and ids[hit] in seen:
            hit += 1
        at = ids[hit - 1] if hit else -1
        extends = 0 if not hit else (2 if kids.get(at, 0) else 1)
        gap = now - last_use[at] if hit else None
        turn = turns.get(at, 0) + (at in ends) if hit else 0
        shape = (extends, _log2b(reads.get(at, 0)), _gap(gap), _log2b(n))
        mine, lab = [], []
        for j in range(hit, n):
            turns[ids[j]] = turn
            mine.append((_log2b(j), *shape, j == n - 1, _log2b(n - hit), min(turn, 5)))
            seq = uses.get(2 * ids[j], ())
            lab.append(bisect.bisect_right(seq, i) < len(seq))
        feats.append(mine)
        labels.append(lab)
        for x in ids[:hit]:
            reads[x] = reads.get(x, 0) + 1
        for x in ids:
            last_use[x] = now
        for j in range(hit, n):
            seen.add(ids[j])
            if j:
                kids[ids[j - 1]] = kids.get(ids[j - 1], 0) + 1
        if n:
            ends.add(ids[n - 1])
    return feats, labels


def auc(scores: list[float], labels: list[bool]) -> float:
    """The probability that a page read again ranks above one that is not (ties: half)."""
    pos: dict[float, int] = {}
    neg: dict[float, int] = {}
    for s, y in zip(scores, labels, strict=True):
        (pos if y else neg)[s] = (pos if y else neg).get(s, 0) + 1
    p, q = sum(pos.values()), sum(neg.values())
    if not p or not q:
        return float("nan")
    below = win = 0.0
    for s in sorted(set(pos) | set(neg)):
        win += pos.get(s, 0) * (below + 0.5 * neg.get(s, 0))
        below += neg.get(s, 0)
    return win / (p * q)


def hindsight(trace: Trace) -> dict:
    """Per feature (and ``all``): its values' pages and read-again frequency, and the AUC."""
    feats, labels = classes(trace)
    flat = [f for fs in feats for f in fs]
    ys = [y for ls in labels for y in ls]
    out = {"pages": len(ys), "read_again": sum(ys) / max(1, len(ys)), "features": {}}
    for k, name in enumerate((*FEATURES, "all")):
        key = (lambda f: f) if name == "all" else (lambda f, k=k: f[k])
        counts: dict = {}
        for f, y in zip(flat, ys, strict=True):
            c = counts.setdefault(key(f), [0, 0])
            c[0] += y
            c[1] += 1
        freq = {v: a / t for v, (a, t) in counts.items()}
        out["features"][name] = {
            "auc": auc([freq[key(f)] for f in flat], ys), "values": len(counts),
            "table": None if name == "all" else {
                str(v): {"pages": t, "read_again": round(a / t, 4)}
                for v, (a, t) in sorted(counts.items())}}
    return out


def _demoted_lru(trace: Trace, budget: int, feats, freq: dict | None, theta: float) -> float:
    """LRU in bytes, a stored page whose class reads again less often than ``theta`` at the
    LRU end (attention-only: KV pages alone). ``freq``: class -> read-again frequency (with
    hindsight); None: learned online, each class's first reads so far over its pages stored so
    far (+1 / +2: a class not seen yet is not demoted)."""
    order: OrderedDict[int, None] = OrderedDict()
    size, used, hit_pages, pages = trace.kv_page_bytes, 0, 0, 0
    learn = freq is None
    cls_of: dict[int, tuple] = {}
    counts: dict[tuple, list[int]] = {}  # class -> [first reads, pages stored]
    if learn:
        freq = {}
    for i, req in enumerate(trace.requests):
        hit = _hit(trace, req, order.__contains__)
        hit_pages += hit
        pages += req.prompt_pages
        for item in _read(trace, req, hit):
            order.move_to_end(item)
            c = cls_of.pop(item, None) if learn else None
            if c is not None:
                n = counts[c]
                n[0] += 1
                freq[c] = (n[0] + 1) / (n[1] + 2)
        cls = dict(zip((2 * x for x in req.ids[len(req.ids) - len(feats[i]):]), feats[i],
                       strict=True))
        for item in _stored(trace, req, hit):
            if item in order:
                order.move_to_end(item)
                continue
            order[item] = None
            used += size
            c = cls.get(item)
            if learn and c is not None:
                cls_of[item] = c
                n = counts.setdefault(c, [0, 0])
                n[1] += 1
                freq[c] = (n[0] + 1) / (n[1] + 2)
            if c is not None and freq.get(c, 1.0) < theta:
                order.move_to_end(item, last=False)
        while used > budget:
            order.popitem(last=False)
            used -= size
    return hit_pages / max(1, pages)


def visible_all(trace: Trace, budget: int) -> dict:
    """``visible_all``: the hindsight class frequencies as a demotion rule, the best theta."""
    feats, _ = classes(trace)
    freq = _fitted(trace)
    rates = {t: _demoted_lru(trace, budget, feats, freq, t) for t in THETAS}
    best = max(rates, key=lambda t: (rates[t], -t))
    return {"hit_rate": rates[best], "theta": best, "by_theta": rates}


def _scored(trace: Trace, budget: int, tau_s: float, leaf: bool,
            known: dict | None = None) -> float:
    """The online policies: ``atc`` (leaf False) or ``leaf_freq`` (leaf True); see the module
    docstring. ``known``: class -> read-again frequency fitted with hindsight, used instead of
    what ``atc`` learns (``atc_hindsight``). One heap of (priority, stamp, item); stale entries
    are skipped."""
    feats, _ = classes(trace)  # what the store sees (the labels are not used)
    times = trace.times_ms
    parent = trace.parent
    size, used, hit_pages, pages = trace.kv_page_bytes, 0, 0, 0
    stamp: dict[int, int] = {}  # held item -> its heap entry's stamp
    kids: dict[int, int] = {}
    cls_of: dict[int, tuple] = {}
    first_read: set[int] = set()
    stored_n: dict[tuple, int] = {}
    reused_n: dict[tuple, int] = {}
    reads: dict[int, int] = {}
    heap: list[tuple[float, int, int]] = []
    tick = 0

    def prio(item: int, now: float) -> float:
        if leaf:
            return now / tau_s + math.log2(1 + reads.get(item, 0))
        c = cls_of.get(item)
        if known is not None:
            p = max(known.get(c, 1.0), 1e-3)
        else:
            p = (reused_n.get(c, 0) + 1) / (stored_n.get(c, 0) + 2)
        return math.log(p) + now / tau_s

    def push(item: int, now: float) -> None:
        nonlocal tick
        tick += 1
        stamp[item] = tick
        heapq.heappush(heap, (prio(item, now), tick, item))

    for i, req in enumerate(trace.requests):
        now = times[i] / 1e3
        hit = _hit(trace, req, stamp.__contains__)
        hit_pages += hit
        pages += req.prompt_pages
        for item in _read(trace, req, hit):
            reads[item] = reads.get(item, 0) + 1
            c = cls_of.get(item)
            if c is not None and item not in first_read:
                first_read.add(item)
                reused_n[c] = reused_n.get(c, 0) + 1
            push(item, now)
        n_new = len(feats[i])
        cls = dict(zip((2 * x for x in req.ids[len(req.ids) - n_new:]), feats[i], strict=True))
        for item in _stored(trace, req, hit):
            if item not in stamp:
                used += size
                kids[item] = 0
                x = int(parent[item >> 1])
                if x >= 0 and 2 * x in kids:
                    kids[2 * x] += 1
                c = cls.get(item, cls_of.get(item, ("seen",)))
                cls_of[item] = c
                stored_n[c] = stored_n.get(c, 0) + 1
            push(item, now)
        while used > budget:
            _, t, item = heapq.heappop(heap)
            if stamp.get(item) != t:
                continue
            if leaf and kids[item]:
                continue  # pushed again when it becomes a leaf
            del stamp[item], kids[item]
            used -= size
            x = int(parent[item >> 1])
            if x >= 0 and 2 * x in kids:
                kids[2 * x] -= 1
                if leaf and not kids[2 * x]:
                    push(2 * x, now)
    return hit_pages / max(1, pages)


def _fitted(trace: Trace) -> dict:
    """Class -> the share of its pages read again (hindsight, the whole trace)."""
    feats, labels = classes(trace)
    counts: dict = {}
    for fs, ls in zip(feats, labels, strict=True):
        for f, y in zip(fs, ls, strict=True):
            c = counts.setdefault(f, [0, 0])
            c[0] += y
            c[1] += 1
    return {v: a / t for v, (a, t) in counts.items()}


def visible_online(trace: Trace, budget: int) -> dict:
    """``visible_online``: ``visible_all``'s rule with the frequencies learned as it goes, per
    class of ``SUBSETS`` (every feature; a few coarse ones, learned sooner)."""
    feats, _ = classes(trace)
    out = {}
    for name, subset in SUBSETS.items():
        k = [FEATURES.index(f) for f in subset]
        proj = [[tuple(f[j] for j in k) for f in fs] for fs in feats]
        rates = {t: _demoted_lru(trace, budget, proj, None, t) for t in THETAS}
        best = max(rates, key=lambda t: (rates[t], -t))
        out[name] = {"hit_rate": rates[best], "theta": best, "by_theta": rates}
    return out


def online(trace: Trace, budget: int) -> dict:
    """``atc``, ``leaf_freq`` and ``atc_hindsight`` at every tau of ``TAUS_S``."""
    out = {name: {tau: _scored(trace, budget, tau, name == "leaf_freq") for tau in TAUS_S}
           for name in ("atc", "leaf_freq")}
    known = _fitted(trace)
    out["atc_hindsight"] = {tau: _scored(trace, budget, tau, False, known) for tau in TAUS_S}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-file", required=True, help="a trace in Mooncake's format")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--budgets", default="2,5,10", help="%% of the working set")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    budgets = parse_budgets(ap, args.budgets)
    try:
        trace = mooncake_trace.load(args.trace_file, "attention", args.requests)
    except ValueError as e:
        ap.error(f"--trace-file: {e}")
    info = summary(trace, 0, 0)
    seen = hindsight(trace)
    rows = []
    for pct in budgets:
        budget = int(info["working_set_bytes"] * pct / 100)
        row = {"budget_pct": pct, **{p: simulate(trace, budget, p, 0, 0)["hit_rate"]
                                     for p in ("lru", "leaf", "admit_store", "belady")}}
        row["visible_all"] = visible_all(trace, budget)
        row["visible_online"] = visible_online(trace, budget)
        row["online"] = online(trace, budget)
        rows.append(row)
    if args.json:
        print(json.dumps({"trace": info, "hindsight": seen, "budgets": rows}, indent=1,
                         default=str))
        return 0
    print(f"trace_features: {trace.name}, {len(trace.requests)} requests, {seen['pages']} KV "
          f"pages stored, {seen['read_again']:.3f} of them read again")
    print("feature   AUC    values: pages (read again)")
    for name, f in seen["features"].items():
        vals = "" if f["table"] is None else "  ".join(
            f"{v}: {t['pages']} ({t['read_again']:.2f})" for v, t in f["table"].items())
        print(f"{name:<8s} {f['auc']:.3f}  {vals[:200]}")
    print("ratios to LRU; (the best theta or tau, seconds)")
    for row in rows:
        lru = row["lru"]
        cells = [f"lru {lru:.4f}"] + [f"{p} {row[p] / lru:.3f}x"
                                      for p in ("leaf", "admit_store", "belady")]
        va = row["visible_all"]
        cells.append(f"visible_all {va['hit_rate'] / lru:.3f}x ({va['theta']})")
        for sub, vo in row["visible_online"].items():
            cells.append(f"visible_online[{sub}] {vo['hit_rate'] / lru:.3f}x ({vo['theta']})")
        for name in ("atc", "atc_hindsight", "leaf_freq"):
            tau, v = max(row["online"][name].items(), key=lambda kv: kv[1])
            cells.append(f"{name} {v / lru:.3f}x ({tau})")
        print(f"{row['budget_pct']:4g} %: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
