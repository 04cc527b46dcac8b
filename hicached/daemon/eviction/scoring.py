"""How the hybrid policy ranks its eviction candidates (``HybridPolicy.make_room``): by
``recency + alpha x value``, Marconi-style, both normalised over the candidates, the states one
call stored on a chain going from its deep end, and pages demoted by ``reuse.py`` first."""

from __future__ import annotations

from hicached.daemon.eviction.interface import IndexView
from hicached.daemon.eviction.reuse import ReuseClasses


def rank_candidates(cands: list[tuple[int, int, float, int]], ix: IndexView, reuse: ReuseClasses,
                    vals: dict[int, tuple[int, int, int]], kcall, alpha: float
                    ) -> list[tuple[int, int, float, int]]:
    """``cands`` (tick, key, value, state page or -1) sorted best to keep first (the next
    victim last) by ``recency + alpha x value``, both normalised over the candidates.

    The states one call stored on a chain go from its deep end, as its KV pages do: a
    candidate's recency is raised to that of the candidates below it on its chain named by
    the same call (the state whose nearest state above is this one, and so on down), and
    among equals the one with fewer such candidates below goes first. A call's pages are
    used at once, their ticks in chain order only because they are counted one by one: so
    a chain set in one call loses its leaf segment and deep states before its shallow ones,
    and what is left of it is still a prefix a hit can restore. A state stored by an
    earlier call (a conversation's earlier turn, mid-chain now) is not raised: it goes
    first, as its own last use says.

    ``vals``: the policy's value cache (key k -> (keys, bytes, the key of the state above), ~k
    the same of its state alone); ``kcall``: per key record, the ``linked`` call that last named
    it (0: none); ``reuse``: which pages are demoted; ``alpha``: the weight of value."""
    n = len(cands)
    if not reuse.learns and not any(ix.ns_trail):
        # no trailing pool anywhere: no candidate has a state above it (nothing to raise)
        # and none is demoted: one group, by recency and value alone (the same order)
        lo = min(c[0] for c in cands)
        span = (max(c[0] for c in cands) - lo) or 1
        top = max(c[2] for c in cands) or 1.0
        return sorted(cands, key=lambda c: (c[0] - lo) / span + alpha * c[2] / top,
                      reverse=True)
    eff, below = [c[0] for c in cands], [0] * n
    at = {}
    for i, c in enumerate(cands):
        at[c[1]] = i
    for i, c in enumerate(cands):
        got = vals.get(c[1] if c[3] < 0 else ~c[1])
        j, t, d = at.get(got[2], -1) if got is not None else -1, eff[i], 0
        call = kcall[c[1]]
        while j >= 0 and d < n and call and kcall[cands[j][1]] == call:
            d += 1  # up the chain of candidates of the same call, one state at a time
            if eff[j] < t:
                eff[j] = t
            t = eff[j]
            if below[j] < d:
                below[j] = d
            got = vals.get(cands[j][1] if cands[j][3] < 0 else ~cands[j][1])
            j = at.get(got[2], -1) if got is not None else -1
    # demoted candidates (``reuse.py``) go before the others; each group scored on its own
    demoted = reuse.demoted
    up = ([not demoted(c[3] if c[3] >= 0 else ix.k_head[c[1]]) for c in cands]
          if reuse.learns else [True] * n)
    top = max(c[2] for c in cands) or 1.0
    span = {}
    for g in (False, True):
        ts = [eff[i] for i in range(n) if up[i] == g]
        if ts:
            span[g] = (min(ts), (max(ts) - min(ts)) or 1)
    keys = [(up[i], (eff[i] - span[up[i]][0]) / span[up[i]][1]
             + alpha * cands[i][2] / top, below[i]) for i in range(n)]
    return [cands[i] for i in sorted(range(n), key=keys.__getitem__, reverse=True)]
