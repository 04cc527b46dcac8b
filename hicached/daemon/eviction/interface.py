"""The eviction policy's contract: the hooks the page index calls, and what a policy may read.

One policy object answers every path that frees L2 pages: eviction on reserve
(``Reclaimer.make_room`` for a key, ``Reclaimer.evict_for`` for a call's keys), slab reclaim (a
class takes a whole slab from another), the idle turns' eviction ahead (``reclaim.py``), namespace
quotas (``quotas.py``: ``ranked``), the L3 audit (``l3/audit.py``: ``strides`` / ``upcoming``), a
flush (``doomed``) and stats (``orphans.py`` counts what the policy left). The index tells it every
change of the committed set (``inserted`` / ``touched`` / ``removed``, their batch twins, the
chains' links) and asks it questions (``make_room``, ``doomed``, ``stale``, ...).

Who calls what, and when (all on the daemon's control loop: no hook may block, none may call
back into the index's mutating calls; each is given page records, ints indexing the index's
``p_*`` columns, and key records, indexing its ``k_*`` columns):

    hook                        called by, when                        cost budget
    bind(view)                  Records.__init__, once                 -
    grow(n) / grow_keys(n)      the records grow (rarely, amortised)   O(n)
    inserted(p)                 a page committed (few pages a call)    O(1), ~1 us
    inserted_many(ps, ...)      a call's pages committed at once       O(len) numpy, ~0.2 us/page
    touched(p)                  a committed page used (get, touch)     O(1), ~1 us
    touched_many(ps, ticks)     a call's pages used                    O(len), ~0.5 us/page
    removed(p)                  a committed page leaves L2             O(1), ~1 us
    linked(recs, parent)        a set named its chain (Records.link)   O(len)
    key_freed(k)                a key record is freed                  O(children)
    make_room(stride)           a reservation found class full         O(candidates), < 1 ms
    make_room_many(stride, n)   a call's keys found their class full   O(candidates + victims)
    doomed(p)                   evict / flush of page p                O(dependants)
    may_go_ahead(p)             reclaim.py, before a named page goes   O(1)
    stale(early) / stale_due    after commits / each idle turn         stale_due O(1)
    abandoned(pages)            reclaim.py stopped a victim set        O(len)
    order / strides / unpinned  lru_order (tests), the L3 audit        O(pages walked)
    upcoming(stride, n)         the L3 audit                           O(n)
    victims(ns)                 tests and tools (a lazy walk)          O(pages walked)
    ranked(ns)                  quotas (a snapshot)                    O(pages) numpy
    set_alpha(alpha)            the --eviction-alpha reload (SIGHUP)   O(1)

What a policy may read: ``IndexView`` below, nothing else of the index (no underscore field).
What it must keep true: a page it names for eviction is committed and unpinned when named, and
a victim set lists dependants before what they depend on (the index evicts in that order, and
``reclaim.py`` may stop between two keys). The index evicts only committed, unpinned pages, so
a policy naming a pinned page costs a retry, never a lease's bytes.

A new policy is one module in this package (a subclass of ``EvictionPolicy``) plus one line in
``registry.py``; an out-of-tree one is named ``module:Class`` (``--eviction mypkg.evict:Fifo``).
A policy has its parts (``lru.py``'s ``LruOrder``, ``keytree.py``'s ``KeyTree``, ``reuse.py``),
built in ``bind`` or given to its constructor, and forwards the index's events to them once per
call; it never subclasses another policy (a variant is a factory in its own module that
configures one: ``prefix.py``).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hicached.daemon.entry import COMMITTED

if TYPE_CHECKING:
    from hicached.daemon.slabs import SlabAllocator


class IndexView(Protocol):
    """What a policy may read of the page index (its ``Records``, ``records.py``, is one):
    read-only to it.

    Columns, indexed by page record ``p`` (``p_*``) and key record ``k`` (``k_*``); Python ints
    through memoryviews (``np[name]``: the same columns as numpy arrays, for vectorised reads).
    A column object is replaced when the records grow (``grow``): read it through the view at
    each call, never keep it across calls.

    ========== =================================================================
    p_tid      table id of the page (-1 while unbound)
    p_krec     its key record
    p_off      its slot's byte offset in the arena
    p_stride   its slot's size class (bytes)
    p_used     tick of its last use (``tick`` counts page uses)
    p_pins     pins (leases, reservations, L3 I/O): > 0 means it must stay
    p_flags    COMMITTED / PENDING / IN_L3 / ... (``entry.py``)
    p_knext    the next page record of the same key (-1: the last)
    k_ns       namespace id of the key
    k_len      0: a free key record
    k_mask     the pool bits holding the key committed
    k_head     the key's first page record (-1: none)
    ========== =================================================================

    Per table id: ``t_bit`` (its pool's bit in its namespace's masks), ``t_state`` (1: its
    pages are states, a trailing pool). Per namespace id: ``ns_trail`` (its trailing pools'
    bits). ``alloc``: the slab allocator (its questions only: ``slab_of``, ``oldest_unpinned``,
    ``free_slots``, ``capacity_bytes``).
    """

    p_tid: memoryview
    p_krec: memoryview
    p_off: memoryview
    p_stride: memoryview
    p_used: memoryview
    p_pins: memoryview
    p_flags: memoryview
    p_knext: memoryview
    k_ns: memoryview
    k_len: memoryview
    k_mask: memoryview
    k_head: memoryview
    np: dict[str, np.ndarray]
    t_bit: list[int]
    t_state: bytearray
    ns_trail: list[int]
    alloc: SlabAllocator

    @property
    def tick(self) -> int:
        """Page uses so far (``p_used`` is a tick)."""

    @property
    def page_top(self) -> int:
        """Page records ever used: every live one is below."""

    @property
    def key_top(self) -> int:
        """Key records ever used: every live one is below."""

    def namespace_id(self, ns: str) -> int:
        """The id of namespace digest ``ns`` (``k_ns``), -1 when the index never saw it."""

    def table_ids(self, ns: str) -> list[int]:
        """The table ids (``p_tid``) of namespace ``ns``'s pools."""

    def slab_pages(self, slab_index: int) -> list[int]:
        """The page records in slab ``slab_index``'s slots (any state), slot order."""


class EvictionPolicy(ABC):
    """Which L2 pages go next (module docstring: who calls each hook, when, at what cost).

    A subclass implements the abstract hooks; every other hook has a default here that is
    right for a policy that keeps no chains (LRU-like: a page depends on none). Pages are page
    records of ``self.ix`` (the ``IndexView`` given to ``bind``).
    """

    #: the ``--eviction`` name (the registry's key; stats' ``eviction``)
    name = ""
    #: a victim set is mostly many slots (``reserve_many`` then reserves the freed ones as a run)
    frees_runs = False
    #: whether ``make_room``'s last victim set was a leaf segment whose keys may go in part,
    #: from the leaf up (``Reclaimer.evict_victims`` defers the rest to the idle turns)
    split_ok = False
    #: every path evicts a key's pages together, its states aside (``reclaim.py`` then keeps a
    #: key whole that gained a page since its set was named)
    whole_keys = False
    #: the policy promises never to leave a page no hit can use (an orphan, ``orphans.py``)
    #: once its idle turns ran (``prefix`` / ``hybrid``: yes; ``lru``: no)
    orphan_free = False

    ix: IndexView

    def bind(self, ix: IndexView) -> None:
        """The index this policy serves (its constructor calls this once, before any other
        hook). Read it only through ``IndexView``."""
        self.ix = ix

    def set_alpha(self, alpha: float) -> None:
        """``--eviction-alpha`` (at start and on a reload): the weight of a page's value
        against its recency, for a policy that has one; ignored otherwise."""

    # ------------------------------------------------------------ sizes

    def grow(self, n: int) -> None:
        """Page records now number ``n`` (grow per-page arrays; keep their contents)."""

    def grow_keys(self, n: int) -> None:
        """Key records now number ``n``."""

    # ------------------------------------------------------------ the index's events

    @abstractmethod
    def inserted(self, p: int) -> None:
        """Page record ``p`` was committed (``p_used[p]`` is its tick): it is a candidate
        from now on."""

    def inserted_many(self, ps: np.ndarray, used_before: np.ndarray,
                      mask_before: np.ndarray) -> None:
        """``inserted`` of each of page records ``ps`` (int64, each once) in turn, called once
        the index shows them all committed. ``used_before`` / ``mask_before``: per page, its
        ``p_used`` and its key's ``k_mask`` before the call. Default: ``inserted`` of each."""
        for p in ps.tolist():
            self.inserted(p)

    @abstractmethod
    def touched(self, p: int) -> None:
        """Committed page record ``p`` was used (``p_used[p]`` is the new tick)."""

    def touched_many(self, ps: list[int], ticks: list[int]) -> None:
        """``touched`` of each of committed page records ``ps`` in turn (a page may come more
        than once); ``ticks``: the tick of each use (``p_used`` holds each page's last).
        Default: ``touched`` of each."""
        for p in ps:
            self.touched(p)

    @abstractmethod
    def removed(self, p: int) -> None:
        """Committed page record ``p`` leaves L2 (evicted, dropped): still readable now,
        freed right after."""

    def removed_many(self, ps: list[int], arr: np.ndarray) -> None:
        """``removed`` of each of committed page records ``ps`` (``arr``: the same, int64; each
        once) in turn, all called before the first of them is freed (an eviction's pages, in
        one pass: ``Evictor``). Default: ``removed`` of each."""
        for p in ps:
            self.removed(p)

    def linked(self, recs: Sequence[int] | np.ndarray, parent: int) -> None:
        """Key records ``recs`` (a list or an int64 array; -1: not in L2) were linked in a
        chain, the first under key record ``parent`` (-1: a root or not in L2). Default:
        ignored (a policy that keeps no chains)."""

    def key_freed(self, k: int) -> None:
        """Key record ``k`` is about to be freed (its last page left L2)."""

    # ------------------------------------------------------------ victims

    @abstractmethod
    def make_room(self, stride: int) -> list[int]:
        """The committed, unpinned page records to evict, in order (dependants first), so
        that class ``stride`` may get a slot (one of its pages, or every page of a slab of
        another class); empty when nothing can be evicted. Sets ``split_ok``."""

    def make_room_many(self, stride: int, need: int) -> list[int]:
        """``make_room`` for a reservation that needs ``need`` (> 0) slots of class
        ``stride``: the victim sets it would name one after the other, each once the ones
        before went, as far as the policy can tell them without the evictions; at least the
        first set, and no more than ``need`` slots' worth but for the last set's own pages.
        The caller evicts them and asks again while the class is short. Sets ``split_ok`` as
        ``make_room``. Default: ``make_room`` (one set a call)."""
        return self.make_room(stride)

    def doomed(self, p: int) -> list[int]:
        """The page records to evict, in order, for page record ``p`` to go (its dependants
        first); empty when one that must go with it is pinned or pending. Default: ``p``."""
        return [p]

    def may_go_ahead(self, p: int, going: Collection[int] = ()) -> bool:
        """Whether page ``p``, named by an earlier ``make_room`` and unchanged since, may still
        go on its own now, or once the keys ``going`` (key records) went with all their pages
        (``reclaim.py`` evicts a victim set key by key, or counts the keys that go first).
        Default: yes."""
        return True

    def stale(self, early: int = 0) -> list[int]:
        """Page records to evict now, pressure or not (default: none); ``early``: also those
        due within that many ticks."""
        return []

    def stale_due(self, early: int = 0) -> bool:
        """Whether ``stale`` may name a page now (cheap: asked every turn of an idle loop)."""
        return False

    def abandoned(self, pages: list[int]) -> None:
        """A victim set named by ``make_room`` or ``stale`` was stopped before ``pages``
        (still committed) went (``reclaim.py``)."""

    # ------------------------------------------------------------ questions

    @abstractmethod
    def order(self, stride: int) -> Iterator[int]:
        """Committed page records of class ``stride``, next victim first (pinned included);
        the caller may evict each page as it is given."""

    @abstractmethod
    def strides(self) -> list[int]:
        """The size classes that have held a committed page."""

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
        first (the classes' orders merged by last use); the caller may evict each as it is
        given."""
        ix = self.ix
        merged: Iterable[int] = heapq.merge(*(self.unpinned(s) for s in self.strides()),
                                            key=ix.p_used.__getitem__)
        if ns is None:
            return iter(merged)
        nsid = ix.namespace_id(ns)
        k_ns, krec = ix.k_ns, ix.p_krec
        return (p for p in merged if k_ns[krec[p]] == nsid)

    def ranked(self, ns: str) -> list[int]:
        """Every committed page record of namespace ``ns`` (pinned ones included), next victim
        first: a snapshot (``quotas.py`` consumes it while pages come and go). Default: by
        last use."""
        ix = self.ix
        tids = ix.table_ids(ns)
        if not tids:
            return []
        cols = ix.np
        sel = np.flatnonzero(((cols["p_flags"] & COMMITTED) != 0) & np.isin(cols["p_tid"], tids))
        used = cols["p_used"][sel]
        return sel[np.argsort(used, kind="stable")].tolist()
