"""How much of L2 no hit can use: the orphan count of ``/stats`` (``tiers.l2.orphan_bytes``).

Whatever the eviction policy (``lru`` makes orphans, ``prefix`` and ``hybrid`` do not: see
``eviction/hybrid.py``), from the chains the set calls named (``Records.link``: each key
record's parent fingerprint) and the namespaces' trailing pools. Vectorised over the key
records. Reads the index through its public columns and read view (``IndexView``).
"""

from __future__ import annotations

import numpy as np

from hicached.daemon.entry import COMMITTED
from hicached.daemon.eviction.hybrid import GRACE_TICKS

ORPHANS_MAX_KEYS = 1 << 18  # ``orphans`` is not counted in an index with more key records


def orphans(ix, l3: bool = False, grace_ticks: int = GRACE_TICKS, leaving=()
            ) -> tuple[int, int] | None:
    """(pages, slot bytes) of L2's orphans, whatever the policy (stats; vectorised, about a
    microsecond a key record; None past ``ORPHANS_MAX_KEYS``). A page is an orphan when its
    key's known chain is broken above it: a parent named by a link that L2 does not hold (with
    ``l3``, an L3 attached, such a parent counts as restorable), or a key holding a state but
    none of its KV pages; in a namespace with trailing pools, also when no key at or below it
    holds a state and none of its pages was used in the last ``grace_ticks``. ``leaving``:
    page records being evicted now (a victim set evicted page by page: ``reclaim.py``), not
    counted."""
    top = ix.key_top
    if top > ORPHANS_MAX_KEYS:
        return None
    if not top:
        return 0, 0
    bad = orphan_keys(ix, l3, grace_ticks)
    col = ix.np
    committed = np.flatnonzero(col["p_flags"][:ix.page_top] & COMMITTED)
    hit = bad[col["p_krec"][committed]]
    if len(leaving):
        hit &= ~np.isin(committed, np.asarray(leaving, np.int64))
    return int(hit.sum()), int(col["p_stride"][committed][hit].sum())


def orphan_keys(ix, l3: bool, grace_ticks: int) -> np.ndarray:
    """Per key record (up to ``_k_top``): whether its pages are orphans (``orphans``)."""
    top = ix.key_top
    col = ix.np
    live = col["k_len"][:top] != 0
    mask = col["k_mask"][:top]
    ns = col["k_ns"][:top].astype(np.int64)
    pfp = col["k_parent"][:top]
    prec = np.full(top, -1, np.int64)
    broken = np.zeros(top, bool)
    for i in range(ix.namespace_count):
        sel = np.flatnonzero(live & (ns == i) & (pfp != 0))
        if len(sel):
            got = ix.key_records(i, pfp[sel])
            got[got >= 0] = np.where(live[got[got >= 0]], got[got >= 0], -1)
            prec[sel] = got
            if not l3:
                broken[sel[got < 0]] = True
    trail = np.asarray(ix.ns_trail + [0], np.int64)[ns]
    has_state = live & ((mask & trail) != 0)
    if not l3:
        broken |= has_state & ((mask & ~trail) == 0)
    anc, depth = prec.copy(), (prec >= 0).astype(np.int64)
    for _ in range(64):  # pointer jumping: broken above, and the depth (a cycle stops at 64)
        up = anc >= 0
        if not up.any():
            break
        a = anc[up]
        broken[up] |= broken[a]
        depth[up] += depth[a]
        anc[up] = anc[a]
    bad = broken & live
    if any(ix.ns_trail):
        below = has_state.copy()  # a state at or below the key
        committed = np.flatnonzero(col["p_flags"][:ix.page_top] & COMMITTED)
        newest = np.zeros(top, np.int64)  # the newest use at or below the key
        np.maximum.at(newest, col["p_krec"][committed], col["p_used"][committed])
        order = np.argsort(-depth, kind="stable")
        order = order[live[order] & (prec[order] >= 0)]
        levels = np.flatnonzero(np.diff(depth[order])) + 1
        for chunk in np.split(order, levels):  # deepest first: a key tells its parent
            np.logical_or.at(below, prec[chunk], below[chunk])
            np.maximum.at(newest, prec[chunk], newest[chunk])
        bad |= live & (trail != 0) & ~below & (newest <= ix.tick - grace_ticks)
    return bad
