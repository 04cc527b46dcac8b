"""Which L2 pages go next: the one eviction policy every path asks.

Eviction on reserve (``PageIndex._make_room``), slab reclaim (a size class takes a whole slab
from another), namespace quotas (``quotas.py``), the L3 audit (``l3/audit.py``: the pages to be
evicted next are the ones whose L3 copies matter) and stats all ask this object, through:

    inserted(p) / touched(p) / removed(p)   a page record was committed / used / dropped
    order(stride)                           committed pages of a class, next victim first
    victims(ns)                             unpinned pages of every class, next victim first
    make_room(stride)                       the pages to evict so that ``stride`` gets a slot

``LruPolicy`` is least recently used, exactly as before this hook existed: one list per size
class in the order of last use (a call's pages in call order), linked through two arrays indexed
by page record, and ``make_room`` evicts either the class's least recently used unpinned page or
the least recently touched unpinned slab of another class (all its pages), whichever was used
longer ago (a whole slab frees room for any page size). Pinned pages are passed over.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from hicached.daemon.columns import grown

if TYPE_CHECKING:
    from hicached.daemon.index import PageIndex

COMMITTED = 1  # index.COMMITTED (that module imports this one)


class LruPolicy:
    """Least recently used per size class (see the module docstring)."""

    frees_runs = False  # a victim is mostly one page (``reserve_many`` goes key by key)
    # whether ``make_room``'s last victim set was a leaf segment, whose keys may go in part
    # (from the leaf up, the rest a state-less tail no hit can use: ``PageIndex._evict_victims``)
    split_ok = False
    # whether every path evicts a key's pages together, its states aside (``KeyTree``): the
    # reclaimer then keeps a key whole that gained a page since its set was named. Not LRU's
    # (pools go one by one: a key's KV page may stay without its INDEXER page)
    whole_keys = False

    name = "lru"

    def __init__(self):
        self.ix: PageIndex | None = None
        self._prev = memoryview(np.zeros(0, np.int32))
        self._next = memoryview(np.zeros(0, np.int32))
        self._ends: dict[int, list[int]] = {}  # stride -> [oldest, newest] page record (-1)

    def bind(self, ix: PageIndex) -> None:
        self.ix = ix

    def grow(self, n: int) -> None:
        """Page records now number ``n``."""
        for name in ("_prev", "_next"):
            setattr(self, name, memoryview(grown(getattr(self, name), n, np.int32)))

    def grow_keys(self, n: int) -> None:
        """Key records now number ``n``."""

    def linked(self, recs, parent: int) -> None:
        """Key records ``recs`` were linked in a chain (``Records.link``); LRU keeps no tree."""

    def key_freed(self, k: int) -> None:
        """Key record ``k`` is about to be freed."""

    def stale(self, early: int = 0) -> list[int]:
        """Page records to evict now, pressure or not (none under LRU); ``early``: also those
        due within that many ticks."""
        return []

    def abandoned(self, pages: list[int]) -> None:
        """A victim set named by ``make_room`` or ``stale`` was stopped before ``pages`` (still
        committed) went (``reclaim.py``)."""

    def stale_due(self, early: int = 0) -> bool:
        """Whether ``stale`` may name a page now (cheap: asked every turn of an idle loop)."""
        return False

    def doomed(self, p: int) -> list[int]:
        """The page records to evict, in order, for page record ``p`` to go: ``p`` alone."""
        return [p]

    def may_go_ahead(self, p: int) -> bool:
        """Whether page ``p``, named by an earlier ``make_room`` and checked unchanged since,
        may still go on its own now (``reclaim.py`` evicts a victim set page by page): under
        LRU a page depends on none."""
        return True

    # ------------------------------------------------------------ the index's events

    def inserted(self, p: int) -> None:
        stride = self.ix.p_stride[p]
        ends = self._ends.get(stride)
        if ends is None:
            ends = self._ends[stride] = [-1, -1]
        last = ends[1]
        self._prev[p] = last
        self._next[p] = -1
        if last >= 0:
            self._next[last] = p
        else:
            ends[0] = p
        ends[1] = p

    def inserted_many(self, ps: np.ndarray, used_before: np.ndarray,
                      mask_before: np.ndarray) -> None:
        """``inserted`` of each of page records ``ps`` (int64, each once) in turn, called once
        the index shows them all committed: each class's list gets its pages appended, in
        order, in one pass. ``used_before`` / ``mask_before``: per page, its ``p_used`` and its
        key's ``k_mask`` before the call (what a policy that looks at a page's key while its
        call is half committed needs: ``HybridPolicy``)."""
        strides = self.ix.np["p_stride"][ps]
        if strides[0] == strides[-1] and not np.count_nonzero(strides != strides[0]):
            self._append(int(strides[0]), ps)
            return
        for stride in dict.fromkeys(strides.tolist()):
            self._append(stride, ps[strides == stride])

    def _append(self, stride: int, ps: np.ndarray) -> None:
        """Link page records ``ps`` at the newest end of class ``stride``'s list, in order."""
        ends = self._ends.get(stride)
        if ends is None:
            ends = self._ends[stride] = [-1, -1]
        prev, nxt = np.frombuffer(self._prev, np.int32), np.frombuffer(self._next, np.int32)
        last = ends[1]
        prev[ps[1:]] = ps[:-1]
        prev[ps[0]] = last
        nxt[ps[:-1]] = ps[1:]
        nxt[ps[-1]] = -1
        if last >= 0:
            nxt[last] = ps[0]
        else:
            ends[0] = int(ps[0])
        ends[1] = int(ps[-1])

    def removed(self, p: int) -> None:
        ends = self._ends[self.ix.p_stride[p]]
        prev, nxt = self._prev[p], self._next[p]
        if prev >= 0:
            self._next[prev] = nxt
        else:
            ends[0] = nxt
        if nxt >= 0:
            self._prev[nxt] = prev
        else:
            ends[1] = prev

    def touched(self, p: int) -> None:
        ends = self._ends[self.ix.p_stride[p]]
        last = ends[1]
        if last == p:
            return
        prev_, next_ = self._prev, self._next
        prev, nxt = prev_[p], next_[p]  # unlink (``nxt`` is a page: ``p`` is not the last)
        if prev >= 0:
            next_[prev] = nxt
        else:
            ends[0] = nxt
        prev_[nxt] = prev
        prev_[p] = last  # and append
        next_[p] = -1
        next_[last] = p
        ends[1] = p

    def touched_many(self, ps: list[int], ticks: list[int]) -> None:
        """``touched`` of each of committed page records ``ps`` in turn (a page may come more
        than once), ``ticks``: the tick of each use (``p_used`` now holds each page's last)."""
        stride_of, prev_, next_, ends_of = self.ix.p_stride, self._prev, self._next, self._ends
        for p in ps:
            ends = ends_of[stride_of[p]]
            last = ends[1]
            if last == p:
                continue
            prev, nxt = prev_[p], next_[p]  # unlink (``nxt`` is a page: ``p`` is not the last)
            if prev >= 0:
                next_[prev] = nxt
            else:
                ends[0] = nxt
            prev_[nxt] = prev
            prev_[p] = last  # and append
            next_[p] = -1
            next_[last] = p
            ends[1] = p

    # ------------------------------------------------------------ questions

    def order(self, stride: int) -> Iterator[int]:
        """Committed page records of class ``stride``, next victim first (pinned included)."""
        ends = self._ends.get(stride)
        p = ends[0] if ends else -1
        nxt = self._next
        while p >= 0:
            q = nxt[p]  # read first: the caller may evict ``p``
            yield p
            p = q

    def strides(self) -> list[int]:
        return list(self._ends)

    def unpinned(self, stride: int) -> Iterator[int]:
        """``order(stride)`` without the pinned pages."""
        pins = self.ix.p_pins
        return (p for p in self.order(stride) if pins[p] == 0)

    def upcoming(self, stride: int, n: int) -> list[int]:
        """About the ``n`` unpinned page records of class ``stride`` evicted next (the L3
        audit asks the store about their copies)."""
        return list(itertools.islice(self.unpinned(stride), n))

    def victims(self, ns: str | None = None) -> Iterator[int]:
        """Unpinned committed page records of every class (of namespace ``ns``), next victim
        first; the caller may evict each as it is given."""
        ix = self.ix
        used = ix.p_used
        merged = heapq.merge(*(self.unpinned(s) for s in list(self._ends)),
                             key=used.__getitem__)
        if ns is None:
            return merged
        nsid = ix._ns_id.get(ns)
        k_ns, krec = ix.k_ns, ix.p_krec
        return (p for p in merged if k_ns[krec[p]] == nsid)

    def ranked(self, ns: str) -> list[int]:
        """Every committed page record of namespace ``ns`` (pinned ones included), next victim
        first: a snapshot (``quotas.py`` consumes it while pages come and go)."""
        ix = self.ix
        tids = [t for t, (t_ns, _) in enumerate(ix._tables) if t_ns == ns]
        if not tids:
            return []
        sel = np.flatnonzero(((ix.np["p_flags"] & COMMITTED) != 0) & np.isin(ix.np["p_tid"], tids))
        used = ix.np["p_used"][sel]
        return sel[np.argsort(used, kind="stable")].tolist()

    def make_room(self, stride: int) -> list[int]:
        """The committed, unpinned page records to evict so that class ``stride`` may get a
        slot: the class's oldest page, or every page of another class's oldest slab; empty when
        nothing can be evicted."""
        ix = self.ix
        ends, pins, nxt = self._ends.get(stride), ix.p_pins, self._next
        page = ends[0] if ends else -1
        while page >= 0 and pins[page]:  # the class's oldest unpinned page (``unpinned``)
            page = nxt[page]
        slab = ix.alloc.oldest_unpinned(stride)
        if page >= 0 and (slab is None or ix.p_used[page] <= slab.last_used):
            return [page]
        if slab is not None:
            slots = ix._slots.get(slab.index, ())
            return [p for p in slots if p >= 0]
        return []
