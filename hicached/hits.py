"""Hit semantics: which prefix lengths every pool can restore (ARCHITECTURE.md, "the contract").

Keys form a chain; key i stands for the prefix of pages 0..i. An endpoint L (pages) is restorable:
  anchor (KV)            iff pages 0..L-1 all exist                      (L <= kv_pages)
  ALL_PAGES pool         iff pages 0..L-1 all exist
  TRAILING_PAGES (N)     iff pages max(0, L-N)..L-1 all exist            (Mamba N=1, SWA N=window)
The answer is the largest L every pool can restore: the intersection of the pools' endpoint sets,
not the minimum of per-pool prefixes, which may name an endpoint a trailing pool has a hole at.

    pages     0   1   2   3   4          kv_pages = 5
    kv        x   x   x   x   x          endpoints {1,2,3,4,5}
    mamba     .   x   .   x   .          N=1: endpoints {2,4}
    indexer   x   x   x   x   .          endpoints {1,2,3,4}
    restorable = {2, 4}  ->  kv_hit_pages = 4

The list functions are the reference; the daemon answers with their numpy twins (``*_array``),
which take per-page presence as numpy bool arrays and return the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

import numpy as np

from hicached.types import PoolHitPolicy

ALL = PoolHitPolicy.ALL_PAGES.value
TRAILING = PoolHitPolicy.TRAILING_PAGES.value


def leading_run(exists: Sequence[bool]) -> int:
    """Number of leading True values."""
    exists = list(exists)
    try:
        return exists.index(False)
    except ValueError:
        return len(exists)


def restorable_endpoints(exists: Sequence[bool], policy: str, window: int, limit: int) -> list[int]:
    """Ascending endpoints L in 1..limit that one pool can restore.

    ``exists[i]`` says whether page i of this pool is present (len >= limit).
    """
    if policy == ALL:
        return list(range(1, leading_run(exists[:limit]) + 1))
    if policy != TRAILING:
        raise ValueError(f"unknown hit policy {policy!r}; valid: {[ALL, TRAILING]}")
    if window <= 1:  # the common Mamba case, at C speed
        return list(compress(range(1, limit + 1), exists[:limit]))
    out: list[int] = []
    run = 0  # consecutive present pages ending at L-1
    for length in range(1, limit + 1):
        run = run + 1 if exists[length - 1] else 0
        if run >= min(window, length):
            out.append(length)
    return out


def intersect_endpoints(
    kv_pages: int, pools: Sequence[tuple[str, str, int, Sequence[bool]]]
) -> tuple[int, dict[str, int], list[int]]:
    """Combine the anchor's prefix with every extra pool.

    ``pools``: (name, policy, window, exists-per-page over at least ``kv_pages`` pages).
    Returns (kv_hit_pages, per-pool hit pages, restorable endpoints ascending). Per-pool hits follow
    SGLang: the pool's own largest restorable endpoint, reported only when > 0 (the caller adds
    the anchor's own entry).

    ALL_PAGES sets are prefixes {1..b}, so they intersect as a bound; only TRAILING_PAGES sets,
    which have holes, are intersected as sets, and only below that bound.
    """
    hits: dict[str, int] = {}
    bound = kv_pages
    trailing = []
    for name, policy, window, exists in pools:
        if policy == ALL:
            b = leading_run(exists[:kv_pages])
            if b:
                hits[name] = b
            bound = min(bound, b)
        elif policy == TRAILING:
            trailing.append((name, window, exists))
        else:
            raise ValueError(f"unknown hit policy {policy!r}; valid: {[ALL, TRAILING]}")
    common: list[int] | None = None
    for name, window, exists in trailing:
        ends = restorable_endpoints(exists, TRAILING, window, kv_pages)
        if ends:
            hits[name] = ends[-1]
        below = [e for e in ends if e <= bound] if ends and ends[-1] > bound else ends
        common = below if common is None else sorted(set(common).intersection(below))
    restorable = list(range(1, bound + 1)) if common is None else common
    return (restorable[-1] if restorable else 0), hits, restorable


# ---------------------------------------------------------------- numpy twins (daemon path)


def leading_run_array(exists: np.ndarray) -> int:
    """``leading_run`` of a bool array."""
    if not exists.size:
        return 0
    first = int(exists.argmin())  # the first False, or 0 when there is none
    return first if not exists[first] else exists.size


def trailing_mask(exists: np.ndarray, window: int) -> np.ndarray:
    """Bool array ``m``: ``m[L-1]`` says a TRAILING_PAGES pool of ``window`` can restore L, for L in
    1..len(exists) (``restorable_endpoints(exists, TRAILING, window, len(exists))`` as a mask)."""
    if window <= 1:
        return exists
    pages = np.arange(exists.size)
    last_hole = np.maximum.accumulate(np.where(exists, -1, pages))  # -1: no hole up to here
    return pages - last_hole >= np.minimum(window, pages + 1)  # run ending at L-1 >= min(N, L)


def intersect_endpoints_array(
    kv_pages: int, pools: Sequence[tuple[str, str, int, np.ndarray]]
) -> tuple[int, dict[str, int], list[int]]:
    """``intersect_endpoints`` over bool arrays: same arguments, same answer."""
    hits: dict[str, int] = {}
    bound = kv_pages
    trailing = []
    for name, policy, window, exists in pools:
        if policy == ALL:
            b = leading_run_array(exists[:kv_pages])
            if b:
                hits[name] = b
            bound = min(bound, b)
        elif policy == TRAILING:
            trailing.append((name, window, exists))
        else:
            raise ValueError(f"unknown hit policy {policy!r}; valid: {[ALL, TRAILING]}")
    if not trailing:
        return bound, hits, list(range(1, bound + 1))
    common = None  # common[L-1]: every trailing pool can restore L
    for name, window, exists in trailing:
        ends = trailing_mask(exists[:kv_pages], window)
        last = ends.size - int(ends[::-1].argmax()) if ends.size else 0  # ends[last-1]: True?
        if last and ends[last - 1]:
            hits[name] = last
        common = ends if common is None else common & ends
    restorable = (common[:bound].nonzero()[0] + 1).tolist()
    return (restorable[-1] if restorable else 0), hits, restorable
