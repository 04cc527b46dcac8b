"""``lru``: least recently used per size class, the policy every path had before the interface.

``LruOrder`` keeps one list per size class in the order of last use (a call's pages in call
order), linked through two arrays indexed by page record; every policy here has one (``order``,
``strides`` and the fallbacks read it). ``LruPolicy`` is that order alone: ``make_room`` evicts
either the class's least recently used unpinned page or the least recently touched unpinned slab
of another class (all its pages), whichever was used longer ago (a whole slab frees room for any
page size). Pinned pages are passed over. A page depends on no other (its key's other pools'
pages may stay without it): LRU makes orphans (``orphans.py`` counts them). The hooks:
``interface.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from hicached.daemon.columns import grown
from hicached.daemon.eviction.interface import EvictionPolicy, IndexView


class LruOrder:
    """The recency lists: per size class, the committed page records from least to most
    recently used.

    Owns two per-page link arrays (``grow``) and each class's list ends; mutates nothing of the
    index and calls nothing but ``IndexView``'s reads (``p_stride``, ``np["p_stride"]``, and
    in ``oldest`` ``p_pins``). Its owner (a policy) forwards the index's events to it, once per
    call: each method is O(1) per page, and the batch twins bind what they need to locals.
    """

    def __init__(self, ix: IndexView):
        self.ix = ix
        self._prev = memoryview(np.zeros(0, np.int32))
        self._next = memoryview(np.zeros(0, np.int32))
        self._ends: dict[int, list[int]] = {}  # stride -> [oldest, newest] page record (-1)

    def grow(self, n: int) -> None:
        """Page records now number ``n``."""
        self._prev = memoryview(grown(self._prev, n, np.int32))
        self._next = memoryview(grown(self._next, n, np.int32))

    def __len__(self) -> int:
        """The page records the link arrays hold (grown with the records)."""
        return len(self._prev)

    def inserted(self, p: int) -> None:
        """Committed page record ``p`` goes at the newest end of its class's list."""
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

    def inserted_many(self, ps: np.ndarray) -> None:
        """``inserted`` of each of page records ``ps`` (int64, each once) in turn: each class's
        list gets its pages appended, in order, in one pass."""
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
        """Page record ``p`` leaves its class's list."""
        self.removed_many((p,))

    def removed_many(self, ps: Sequence[int]) -> None:
        """``removed`` of each of ``ps`` in turn (a page gone keeps its links: the order of
        the calls shows in them)."""
        stride_of, prev_, next_, ends_of = self.ix.p_stride, self._prev, self._next, self._ends
        for p in ps:
            prev, nxt = prev_[p], next_[p]
            if prev >= 0:
                next_[prev] = nxt
            else:
                ends_of[stride_of[p]][0] = nxt
            if nxt >= 0:
                prev_[nxt] = prev
            else:
                ends_of[stride_of[p]][1] = prev

    def touched(self, p: int) -> None:
        """Committed page record ``p`` moves to the newest end of its class's list."""
        self.touched_many((p,))

    def touched_many(self, ps: Iterable[int]) -> None:
        """``touched`` of each of committed page records ``ps`` in turn (a page may come more
        than once)."""
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

    def order(self, stride: int) -> Iterator[int]:
        """Committed page records of class ``stride``, least recently used first (pinned
        included); the caller may remove each page as it is given."""
        ends = self._ends.get(stride)
        p = ends[0] if ends else -1
        nxt = self._next
        while p >= 0:
            q = nxt[p]  # read first: the caller may evict ``p``
            yield p
            p = q

    def oldest_unpinned(self, stride: int) -> int:
        """Class ``stride``'s least recently used unpinned page record, -1 for none."""
        ends, pins, nxt = self._ends.get(stride), self.ix.p_pins, self._next
        page = ends[0] if ends else -1
        while page >= 0 and pins[page]:
            page = nxt[page]
        return page

    def strides(self) -> list[int]:
        """The classes that have held a committed page (each has a list)."""
        return list(self._ends)


class LruPolicy(EvictionPolicy):
    """Least recently used per size class (see the module docstring). Has an ``LruOrder``
    (``lru``, built at ``bind``), which it tells every event; mutates nothing of the index;
    reads the slab allocator's ``oldest_unpinned`` and ``slab_pages`` for ``make_room``."""

    frees_runs = False  # a victim is mostly one page (``reserve_many`` goes key by key)
    whole_keys = False  # pools go one by one: a key's KV page may stay without its INDEXER page

    name = "lru"

    lru: LruOrder

    def bind(self, ix: IndexView) -> None:
        """The index this policy serves, and its recency lists over it. The one-page events
        are the lists' own methods (bound here: no forwarding frame on a set's path, a call
        per page)."""
        self.ix = ix
        self.lru = lru = LruOrder(ix)
        self.inserted, self.removed, self.touched = lru.inserted, lru.removed, lru.touched

    def grow(self, n: int) -> None:
        """Page records now number ``n``."""
        self.lru.grow(n)

    # ------------------------------------------------------------ the index's events

    def inserted(self, p: int) -> None:
        self.lru.inserted(p)

    def inserted_many(self, ps: np.ndarray, used_before: np.ndarray,
                      mask_before: np.ndarray) -> None:
        """``LruOrder.inserted_many`` (``used_before`` / ``mask_before`` are not needed)."""
        self.lru.inserted_many(ps)

    def removed(self, p: int) -> None:
        self.lru.removed(p)

    def removed_many(self, ps: list[int], arr: np.ndarray) -> None:
        self.lru.removed_many(ps)

    def touched(self, p: int) -> None:
        self.lru.touched(p)

    def touched_many(self, ps: list[int], ticks: list[int]) -> None:
        """``LruOrder.touched_many`` (the ticks are not needed)."""
        self.lru.touched_many(ps)

    # ------------------------------------------------------------ questions

    def order(self, stride: int) -> Iterator[int]:
        """Committed page records of class ``stride``, next victim first (pinned included)."""
        return self.lru.order(stride)

    def strides(self) -> list[int]:
        """The classes that have held a committed page (each has a list)."""
        return self.lru.strides()

    def make_room(self, stride: int) -> list[int]:
        """The committed, unpinned page records to evict so that class ``stride`` may get a
        slot: the class's oldest page, or every page of another class's oldest slab; empty when
        nothing can be evicted."""
        ix = self.ix
        page = self.lru.oldest_unpinned(stride)
        slab = ix.alloc.oldest_unpinned(stride)
        if page >= 0 and (slab is None or ix.p_used[page] <= slab.last_used):
            return [page]
        if slab is not None:
            return [p for p in ix.slab_pages(slab.index) if p >= 0]
        return []
