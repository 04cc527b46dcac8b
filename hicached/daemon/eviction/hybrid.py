"""The hybrid cache controller's eviction: keep the pages that can still give a hit.

A hit is a prefix (key i stands for pages 0..i), so a page is worth something only while every
page before it on its chain is kept, and a trailing-pool state (Mamba, sliding window) only while
its KV prefix is restorable; in a namespace whose hits need a trailing state, KV pages past the
last state of their branch restore nothing either. ``LruPolicy`` evicts pages one by one from the
old end and keeps the wrong ones; this policy knows the chains (``Records.link``: by (namespace,
key), parent and depth, whoever sent them) as a tree of key records, in arrays indexed by key
record: ``up`` / ``kid`` / ``sib`` / ``psib`` (parent, first child, next and previous sibling,
+1, 0 for none), ``kflags`` (STATE_L3).

Rules, on every path that frees pages (``PageIndex.evict`` / ``drop_one`` ask ``doomed``):

- a **leaf segment** goes whole: a leaf key (no child in L2) with all its pages and, in a
  namespace with trailing pools, the single-child, state-less keys above it (what a hit at the
  leaf alone needed);
- a page whose key others depend on (an ALL_PAGES pool: KV, DSA indexer) takes its dependants
  first: the keys below it, deepest first, and its key's other pages, then the state-less keys
  above it that it leaves as a leaf; if a dependant is pinned or pending, the page stays. A
  page with a copy in L3 takes nothing (still restorable);
- a state takes the state-less leaf segment it ended, if it ended one; a **mid-chain state**
  (of a key with children) goes alone, nothing depends on it;
- a state-less leaf of a trailing namespace goes once ``GRACE_TICKS`` page uses passed since its
  newest use (the state of its call, or of the next, would have made it a real leaf): ``stale``,
  asked after every commit, pressure or not (a daemon asks in its loop's next idle turn:
  ``reclaim.py``).

Victims for a slot of one class (``make_room``): the ``CANDIDATES`` least recently used leaves
with a page of that class (a lazily invalidated heap per class of (tick, key): live while the
key is a leaf and one of its pages still has that tick) and as many mid-chain states (a heap of
(tick, page)), scored Marconi-style as ``recency + alpha x value``, both normalised over the
candidates to [0, 1]: value = the KV keys a hit at it saves over the state above it / the bytes
it frees (cached per key: a hint). The lowest score goes (``alpha`` 0, the ``prefix`` policy:
the least recently used; the states one call stored on a chain go from its deep end:
``scoring.py``).
A victim set that empties a slab of another class goes whole, never split (the freed slab serves
the class that asked: a state's slot takes the KV slab of a leaf segment, not the chain's head).
A call that needs many slots (``make_room_many``) gets the sets the ranked path would name one
after the other, in one walk up the chains, as far as it can tell them without the evictions
(in namespaces with no trailing pool: a segment is then a key's pages). A class with no
candidate, or whose oldest candidate is younger than
the oldest leaf of a class holding other namespaces only (another model, idle), takes the slab
of that leaf (the deep end of a chain) with every page's dependants.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterator

import numpy as np

from hicached.daemon.columns import grown
from hicached.daemon.entry import COMMITTED, IN_L3
from hicached.daemon.eviction.interface import EvictionPolicy, IndexView
from hicached.daemon.eviction.keytree import MAX_WALK, KeyTree
from hicached.daemon.eviction.lru import LruOrder
from hicached.daemon.eviction.reuse import DEMOTE_TICKS, NoReuse, ReuseClasses
from hicached.daemon.eviction.scoring import rank_candidates

CANDIDATES = 16  # leaves scored per eviction
_LEAF, _MID = 1, 2  # ``_queued`` bits: the page record has an entry in its leaf / mid heap
_LOW = (1 << 32) - 1
GRACE_TICKS = 1024  # page uses a state-less leaf waits for its state before it is worth 0
FALLBACK_PAGES = 256  # pages of a class tried, oldest first, when no leaf of it may go


class HybridPolicy(EvictionPolicy):
    """Prefix- and state-aware eviction (module docstring).

    Has, built at ``bind``: an ``LruOrder`` (``lru``: the recency lists, ``order`` and the last
    fallback read them) and a ``KeyTree`` (``tree``: the chains, ``doomed`` and the segments),
    whose ``TreeListener`` it is (``key_moved`` ... ``state_gone_alone``: the tree calls them,
    nothing else does); and, given to its constructor, a ``ReuseClasses`` (``reuse``: which new
    pages are demoted; ``NoReuse`` by default). It forwards each of the index's events to its
    parts once per call. Owns the candidate heaps, the value cache and the tails queue; mutates
    nothing of the index, nor of its parts but through their methods.

    ``alpha``: the weight of a candidate's value against its recency; ``alpha_fixed``: keep it
    whatever ``set_alpha`` says (``prefix``: recency alone); ``name``: the ``--eviction`` name
    this configuration answers to (``prefix.py``, ``demote.py`` build theirs).
    """

    frees_runs = True  # a victim is a leaf segment: tens of slots (``reserve_many``)
    whole_keys = True  # ``doomed``, segments and tails take a key's pages together
    orphan_free = True  # a page goes with its dependants, a tail once its grace is over

    name = "hybrid"

    lru: LruOrder
    tree: KeyTree

    def __init__(self, alpha: float = 1.0, reuse: ReuseClasses | None = None, *,
                 name: str = "hybrid", alpha_fixed: bool = False):
        self.name = name
        self.alpha = float(alpha)
        self.alpha_fixed = alpha_fixed
        # new pages of classes seldom read again go first (``reuse.py``; ``demote.py``): not
        # by default (``NoReuse``)
        self.reuse = NoReuse() if reuse is None else reuse
        # Candidates, per class (stride): heaps of ints (tick << 32 | page record), at most one
        # entry per page record and heap (``_queued``'s bits say which); an entry whose page
        # was used since is pushed again with its new tick when it comes up, one whose page is
        # gone (or changed class, or is no candidate any more) is dropped then. So a heap holds
        # no more entries than pages, and no pass ever cleans it.
        self._heaps: dict[int, list[int]] = {}  # pages of leaf keys
        self._mids: dict[int, list[int]] = {}  # states of keys with children: they go alone
        self._queued = memoryview(np.zeros(0, np.uint8))
        self._class_ns: dict[int, set[int]] = {}  # stride -> namespace ids that had a leaf in it
        # (stride, tick, candidates left (best last), the key above the segment that went):
        # what ``make_room`` scored for a slot, reused while the same reservation needs more
        # slots of the class (the tick unchanged: no page was used since)
        self._ranked: tuple[int, int, list, int] | None = None
        # leaf key k -> (keys, bytes, the key of the state above) of its segment; ~k -> the
        # same of its state alone (the state above: the nearest key above with a state, -1)
        self._vals: dict[int, tuple[int, int, int]] = {}
        # (tick, key): leaves of trailing namespaces committed without a state; ``stale`` takes
        # the ones still state-less after ``GRACE_TICKS`` (no hit can end on them)
        self._tails: list[tuple[int, int]] = []  # a heap
        self._held: list[int] = []  # such leaves found pinned: looked at on every call
        self._new_leaves: list[int] = []  # keys that became leaves: ``_flush_leaves``
        # key record -> the ``linked`` call that last named it (1, 2, ...; 0: none): a call's
        # keys are used at once, whatever order their ticks say (``scoring.rank_candidates``)
        self._kcall = memoryview(np.zeros(0, np.int32))
        self._calls = 0

    def bind(self, ix: IndexView) -> None:
        """The index this policy serves, and its parts over it: the recency lists and the key
        tree (which tells this policy of its changes)."""
        self.ix = ix
        self.lru = LruOrder(ix)
        self.tree = KeyTree(ix, self)

    def set_alpha(self, alpha: float) -> None:
        """The weight of a candidate's value against its recency (``make_room``'s score);
        ignored when ``alpha_fixed``."""
        if not self.alpha_fixed:
            self.alpha = float(alpha)

    # ------------------------------------------------------------ the tree's events

    def grow_keys(self, n: int) -> None:
        self.tree.grow_keys(n)
        self._kcall = memoryview(grown(self._kcall, n, np.int32))
        self.reuse.grow_keys(n)

    def linked(self, recs, parent: int) -> None:
        """``KeyTree.linked``, and the keys remember the call that named them."""
        self.tree.linked(recs, parent)
        self._calls += 1
        if isinstance(recs, np.ndarray):
            np.asarray(self._kcall)[recs[recs >= 0]] = self._calls
        else:
            kcall, n = self._kcall, self._calls
            for k in recs:
                if k >= 0:
                    kcall[k] = n

    # ------------------------------------------------------------ the tree's listener

    def key_moved(self, k: int) -> None:
        """(``TreeListener``) ``k``'s cached values are stale."""
        vals = self._vals
        if vals:
            vals.pop(k, None)
            vals.pop(~k, None)

    def keys_moved(self, ks: list[int]) -> None:
        """(``TreeListener``) ``key_moved`` of each."""
        vals = self._vals
        if vals:
            pop = vals.pop
            for k in ks:
                pop(k, None)
                pop(~k, None)

    def parent_now(self, q: int) -> None:
        """(``TreeListener``) ``q``'s committed states are mid-chain candidates now."""
        ix = self.ix
        if not ix.ns_trail[ix.k_ns[q]]:
            return  # no trailing pool: no state (``_push_mid`` would queue none)
        p = ix.k_head[q]
        while p >= 0:  # q is no leaf now: its states may go alone
            if ix.p_flags[p] & COMMITTED:
                self._push_mid(p)
            p = ix.p_knext[p]

    def state_gone_alone(self, k: int) -> None:
        """(``TreeListener``) ``stale`` looks at ``k`` again on its next call."""
        self._held.append(k)  # its KV pages are read now: they go once their grace is over

    def leaf_now(self, q: int) -> None:
        """(``TreeListener``) ``q`` is queued as a leaf before any heap is read."""
        self._vals.pop(q, None)
        self._new_leaves.append(q)  # queued by ``_flush_leaves``, before any heap is read

    def _flush_leaves(self) -> None:
        """Queue the keys that became leaves since the last call, if they still are (an
        eviction frees a segment from its leaf up: each key above becomes a leaf and goes a
        moment later; queueing each as it came cost a push now and a dead entry to pop later)."""
        if self._new_leaves:
            ix, kid, new = self.ix, self.tree.kid, self._new_leaves
            self._new_leaves = []
            for q in dict.fromkeys(new):
                if ix.k_len[q] and not kid[q]:
                    self._push(q)
                    self._maybe_tail(q)

    # ------------------------------------------------------------ the index's events

    def inserted(self, p: int) -> None:
        self.lru.inserted(p)
        ix = self.ix
        k = ix.p_krec[p]
        if self.reuse.learns and not ix.ns_trail[ix.k_ns[k]]:  # (``_classify`` of one page)
            self.reuse.stored_one(p, k, not ix.k_mask[k] & ~ix.t_bit[ix.p_tid[p]],
                                  bool(ix.t_state[ix.p_tid[p]]), int(ix.np["k_depth"][k]),
                                  self.tree.up[k] - 1, ix.tick)
        self._vals.pop(k, None)
        if not self.tree.kid[k]:
            self._push_page(p)
            self._maybe_tail(k)
        else:
            self._push_mid(p)

    def inserted_many(self, ps: np.ndarray, used_before: np.ndarray,
                      mask_before: np.ndarray) -> None:
        """``inserted`` of each of ``ps`` in turn, called once the index shows them all
        committed: the lists at once, then each page queued as ``inserted`` queues it (a page's
        tick is final once it is committed). A leaf's tail is judged once, on the call's final
        state: page by page, its KV page may have queued one before the call's state of the
        key came, an entry ``stale`` skips when it comes up (the key has a state)."""
        self.lru.inserted_many(ps)
        self._classify(ps, mask_before)
        ix, vals = self.ix, self._vals
        krecs = ix.np["p_krec"][ps]
        if vals:
            for k in krecs.tolist():
                vals.pop(k, None)
        leaf = np.asarray(self.tree.kid)[krecs] == 0
        # (the order of the pushes matters not: a heap's entries are distinct ints)
        leaves = {}
        for p, k in zip(ps[leaf].tolist(), krecs[leaf].tolist()):
            self._push_page(p)
            leaves[k] = None
        if not leaf.all() and any(ix.ns_trail):  # states of keys with children: mid heaps
            mid = ~leaf
            states = np.array(ix.t_state, np.uint8)[ix.np["p_tid"][ps[mid]]] != 0
            for p in ps[mid][states].tolist():
                self._queue(self._mids, _MID, p)
        for k in leaves:
            self._maybe_tail(k)

    def _classify(self, ps: np.ndarray, mask_before: np.ndarray) -> None:
        """Tell ``reuse`` a call committed pages ``ps`` (``mask_before``: per page, its key's
        pools before the call; 0: a new key), before they are queued. Only in a namespace with
        no trailing pool: the rule was judged on attention-only traces; with states, a demoted
        leaf segment takes its state, and a chain's prefix is worth more than its pages say
        (issue 48's pressure pattern keeps the head of the chain it cuts, as ``prefix`` does)."""
        if not self.reuse.learns:
            return
        ix, cols = self.ix, self.ix.np
        krecs = cols["p_krec"][ps]
        if not len(ps) or ix.ns_trail[ix.k_ns[int(krecs[0])]]:
            return
        new = np.asarray(mask_before) == 0
        states = np.array(ix.t_state, np.uint8)[cols["p_tid"][ps]] != 0
        first = int(krecs[np.argmax(new)]) if new.any() else -1
        parent = self.tree.up[first] - 1 if first >= 0 else -1
        self.reuse.stored(ps, krecs, new, states, cols["k_depth"][krecs], parent, ix.tick)

    def _maybe_tail(self, k: int) -> None:
        ix = self.ix
        trail = ix.ns_trail[ix.k_ns[k]]
        if trail and not self.tree.has_state(k, trail):
            p, t = ix.k_head[k], 0
            while p >= 0:  # its grace runs from its newest use (as ``orphans`` counts it)
                t = max(t, ix.p_used[p])
                p = ix.p_knext[p]
            heapq.heappush(self._tails, (t, k))

    def stale(self, early: int = 0) -> list[int]:
        """Page records to evict now: the state-less leaves (and the state-less keys above
        them) of trailing namespaces whose grace is over (or ends within ``early`` ticks)."""
        self._flush_leaves()
        ix, tails, out = self.ix, self._tails, []
        limit = ix.tick - GRACE_TICKS + early
        due, self._held = self._held, []
        while tails and tails[0][0] <= limit:
            due.append(heapq.heappop(tails)[1])
        for k in due:
            trail = ix.ns_trail[ix.k_ns[k]]
            if not ix.k_len[k] or self.tree.kid[k] or self.tree.has_state(k, trail):
                continue
            pages = self.tree.pages(k)
            if pages is None:  # read or written now: at the next call once it is not
                self._held.append(k)
                continue
            newest = max(ix.p_used[p] for p in pages)
            if newest > limit:  # used since (or a new key in the record): a new grace
                heapq.heappush(tails, (newest, k))
                continue
            self.tree.trim(self.tree.up[k] - 1, k, trail, pages)
            out.extend(pages)
        return out

    def abandoned(self, pages: list[int]) -> None:
        """The leaves among ``pages``' keys wait for their grace again (``stale`` took them off
        its heap; a leaf from ``make_room`` is no entry there: ``_maybe_tail`` skips those with
        a state)."""
        ix = self.ix
        for k in dict.fromkeys(ix.p_krec[p] for p in pages):
            if ix.k_len[k] and not self.tree.kid[k]:
                self._maybe_tail(k)

    def stale_due(self, early: int = 0) -> bool:
        tails = self._tails
        return bool(self._held or self._new_leaves) or bool(
            tails and tails[0][0] <= self.ix.tick - GRACE_TICKS + early)

    def touched(self, p: int) -> None:
        self.lru.touched(p)  # (an entry already queued for ``p`` moves when it comes up)
        self.reuse.read_one(p, self.ix.p_krec[p], self.ix.tick)
        if not self.tree.kid[self.ix.p_krec[p]]:
            self._push_page(p)
        else:
            self._push_mid(p)

    def touched_many(self, ps: list[int], ticks: list[int]) -> None:
        """``touched`` of each in turn (a page may come twice: queued once, with the tick of
        its first use in the call, as ``touched`` queues it)."""
        self.lru.touched_many(ps)
        ix = self.ix
        if ps and self.reuse.learns:
            arr = np.asarray(ps, np.int64)
            self.reuse.read(arr, ix.np["p_krec"][arr], ix.tick)
        kid, krec, tid, state = self.tree.kid, ix.p_krec, ix.p_tid, ix.t_state
        for p, t in zip(ps, ticks):
            if not kid[krec[p]]:
                self._push_page(p, t)
            elif state[tid[p]]:  # a mid-chain state (``_push_mid``; a get's KV pages are not)
                self._queue(self._mids, _MID, p, t)

    def grow(self, n: int) -> None:
        self.lru.grow(n)
        self.reuse.grow(n)
        self._queued = memoryview(grown(self._queued, n, np.uint8))

    def _push_mid(self, p: int, t: int = -1) -> None:
        ix = self.ix
        if ix.t_state[ix.p_tid[p]]:  # a state
            self._queue(self._mids, _MID, p, t)

    def _push_page(self, p: int, t: int = -1) -> None:
        ix = self.ix
        self._class_ns.setdefault(ix.p_stride[p], set()).add(ix.k_ns[ix.p_krec[p]])
        self._queue(self._heaps, _LEAF, p, t)

    def _queue(self, heaps: dict[int, list[int]], bit: int, p: int, t: int = -1) -> None:
        """Queue page record ``p`` in its class's heap unless it has an entry there, as of
        its last use (``t``: as of that use, -1: ``p_used``)."""
        if not self._queued[p] & bit:
            self._queued[p] |= bit
            ix = self.ix
            if t < 0:
                t = self._at(p)
            heapq.heappush(heaps.setdefault(ix.p_stride[p], []), t << 32 | p)

    def _at(self, p: int) -> int:
        """The tick page record ``p`` is queued at: its last use, ``DEMOTE_TICKS`` earlier
        while it is demoted (``reuse.py``: older than any page that is not, in their order of
        use; negative, which a heap entry ``t << 32 | p`` holds as well)."""
        t = self.ix.p_used[p]
        reuse = self.reuse
        return t - DEMOTE_TICKS if reuse.learns and reuse.demoted(p) else t

    def _pop(self, heaps: dict[int, list[int]], bit: int, stride: int) -> tuple[int, int]:
        """The (tick, page record) of class ``stride``'s least recently used candidate, taken
        off its heap (the caller pushes it back with ``_back``), or (0, -1)."""
        ix, heap, kid = self.ix, heaps.get(stride), self.tree.kid
        krec, flags, strides, used = ix.p_krec, ix.p_flags, ix.p_stride, ix.p_used
        mid, learns = bit == _MID, self.reuse.learns
        while heap:
            e = heapq.heappop(heap)
            t, p = e >> 32, e & _LOW
            if not flags[p] & COMMITTED or strides[p] != stride or (
                    bool(kid[krec[p]]) != mid) or (mid and not ix.t_state[ix.p_tid[p]]):
                self._queued[p] &= ~bit  # gone, moved, or no candidate of this kind now
                if flags[p] & COMMITTED:
                    self._requeue(p)
                continue
            now = self._at(p) if learns else used[p]  # (``_at``)
            if now != t:  # used since: back in its place
                heapq.heappush(heap, now << 32 | p)
                continue
            return t, p
        return 0, -1

    def _requeue(self, p: int) -> None:
        """Queue committed page ``p`` where it belongs now (its entry was dropped)."""
        if not self.tree.kid[self.ix.p_krec[p]]:
            self._push_page(p)
        else:
            self._push_mid(p)

    def _back(self, heaps: dict[int, list[int]], stride: int, entries: list[tuple[int, int]]
              ) -> None:
        heap = heaps[stride]
        for t, p in entries:
            heapq.heappush(heap, t << 32 | p)

    def removed(self, p: int) -> None:
        self.lru.removed(p)
        if self.reuse.learns:
            self.reuse.removed(p)
        ix = self.ix
        k = ix.p_krec[p]
        if ix.p_flags[p] & IN_L3 and ix.t_state[ix.p_tid[p]]:
            self.tree.state_in_l3(k)

    def removed_many(self, ps: list[int], arr: np.ndarray) -> None:
        """``removed`` of each in turn: the lists in one loop; the states with an L3 copy
        (their keys still restorable) found at once."""
        self.lru.removed_many(ps)
        reuse, ix = self.reuse, self.ix
        if reuse.learns:
            for p in ps:
                reuse.removed(p)
        l3 = arr[(ix.np["p_flags"][arr] & IN_L3) != 0]
        for p in l3.tolist():
            if ix.t_state[ix.p_tid[p]]:
                self.tree.state_in_l3(ix.p_krec[p])

    def key_freed(self, k: int) -> None:
        """``KeyTree.key_freed``: off its parent, its children roots."""
        self.tree.key_freed(k)

    def _push(self, k: int) -> None:
        """Key ``k`` became a leaf: each of its committed pages is a candidate in its class."""
        ix = self.ix
        p = ix.k_head[k]
        while p >= 0:
            if ix.p_flags[p] & COMMITTED:
                self._push_page(p)
            p = ix.p_knext[p]

    # ------------------------------------------------------------ victims

    def make_room(self, stride: int) -> list[int]:
        ix = self.ix
        tick = ix.tick
        ranked = self._ranked
        self.split_ok = True  # (a leaf segment, or a state alone; not once a slab is taken)
        if ranked is not None and ranked[0] == stride and ranked[1] == tick:
            # the same reservation needs more room (no page was used since: the candidates
            # scored for its last slot keep their order): the key above the segment that went,
            # if it is a leaf now and no younger than the next candidate, else that candidate
            rest, up = ranked[2], ranked[3]
            tree, still = self.tree, self._still
            while rest and not still(rest[-1], False):  # (its key's pages: enough to tell
                rest.pop()  # whether it may go; its segment once it is taken)
            if up >= 0 and ix.k_len[up] and not tree.kid[up]:
                if ix.ns_trail[ix.k_ns[up]]:
                    t = tree.newest(up, stride)
                    pages = tree.segment(up) if t and (not rest or t <= rest[-1][0]) else None
                else:  # its segment is its pages (None: one is pinned or pending, ``newest``
                    pages = tree.pages(up)  # 0), whose newest use of the class one walk tells
                    if pages:
                        used, p_stride = ix.p_used, ix.p_stride
                        t = max([used[p] for p in pages if p_stride[p] == stride], default=0)
                        if not t or (rest and t > rest[-1][0]):
                            pages = None
                if pages:
                    self._ranked = (stride, tick, rest, tree.above(pages))
                    return self._whole_if_slab(pages, stride)
            if rest:
                pages = still(rest.pop())
                self._ranked = (stride, tick, rest, tree.above(pages))
                return self._whole_if_slab(pages, stride)
        self._ranked = None
        self._flush_leaves()  # (the path above reads no heap: the key it takes is no entry)
        cands, leaves, mids = [], [], []  # [tick, key, value, state page or -1]; popped
        seen: set[int] = set()
        while len(leaves) < 2 * CANDIDATES:
            t, p = self._pop(self._heaps, _LEAF, stride)
            if p < 0:
                break
            leaves.append((t, p))
            k = ix.p_krec[p]
            if k not in seen:
                seen.add(k)
                v = self._value(k, ix.p_used[p], tick)
                if v is not None:
                    cands.append((t, k, v, -1))
                    if len(cands) == CANDIDATES:
                        break
        while len(mids) < CANDIDATES:
            t, p = self._pop(self._mids, _MID, stride)
            if p < 0:
                break
            mids.append((t, p))
            if not ix.p_pins[p]:  # a state alone (nothing depends on it)
                cands.append((t, ix.p_krec[p], self._state_value(ix.p_krec[p], p), p))
        best = None
        if cands:
            lo = min(c[0] for c in cands)
            order = rank_candidates(cands, ix, self.reuse, self._vals, self._kcall, self.alpha)
            while order:
                c = order.pop()
                pages = [c[3]] if c[3] >= 0 else self.tree.segment(c[1])
                if pages:
                    best = (c, self._whole_if_slab(pages, stride))
                    self._ranked = (stride, tick, order, self.tree.above(pages))
                    break
        if leaves:
            self._back(self._heaps, stride, leaves)
        if mids:
            self._back(self._mids, stride, mids)
        other = self._oldest_leaf_slab(stride)
        # an older leaf in a class of other namespaces only (another model, idle): its slab is
        # reclaimed (a KV class and the state class of the same namespaces never reclaim each
        # other's slabs by age: a chain's stem is always older than its leaf)
        if best is not None and (other is None or other[0] >= lo or self._class_ns.get(
                other[1].stride, set()) & self._class_ns.get(stride, set())):
            return best[1]
        self._ranked = None
        self.split_ok = False  # a slab's pages: all of them must go
        if other is not None:  # a slab of another class: the one of its oldest leaf (the
            # deep end of a chain: what it takes with it is mostly in that slab)
            pages = self.tree.expand([p for p in ix.slab_pages(other[1].index) if p >= 0])
            if pages:
                return pages
        if best is not None:
            self._whole_if_slab(best[1], stride)
            return best[1]
        slab = ix.alloc.oldest_unpinned(stride)  # no leaf anywhere may go: LRU's slab
        if slab is not None:
            pages = self.tree.expand([p for p in ix.slab_pages(slab.index) if p >= 0])
            if pages:
                return pages
        for p in itertools.islice(self.unpinned(stride), FALLBACK_PAGES):
            pages = self.doomed(p)  # the class's least recently used page that may go
            if pages:
                return pages
        return []

    def make_room_many(self, stride: int, need: int) -> list[int]:
        """``make_room``'s victim sets for ``need`` slots of class ``stride``: after the
        first set, each next one its ranked path would take once the sets before went (the
        candidates scored for this tick; the key above a set once all its children go), in one
        walk, while that can be told without evicting: in a namespace with no trailing pool (a
        segment is a key's pages), every page of the class asked. It stops (the caller evicts
        and asks again) where the next set needs a fresh scoring (the evictions feed the
        heaps), a state, another class's slot, or a page of a set already named."""
        victims = self.make_room(stride)
        ranked = self._ranked
        if need <= 1 or not victims or not self.split_ok or ranked is None:
            return victims
        ix, tree = self.ix, self.tree
        trail, k_ns, krec, p_stride, used = (ix.ns_trail, ix.k_ns, ix.p_krec, ix.p_stride,
                                             ix.p_used)
        if any(p_stride[p] != stride for p in victims) or trail[k_ns[krec[victims[-1]]]]:
            return victims
        going = {krec[p] for p in victims}
        got = len(victims)
        rest, up = ranked[2], ranked[3]
        kid, sib, k_len, t_up, pages_of = tree.kid, tree.sib, ix.k_len, tree.up, tree.pages
        top, nxt = None, None  # the next candidate and its pages (``make_room`` drops those
        while got < need:  # gone; its pages are kept while it stays the next)
            while rest:
                c = rest[-1]
                if c is top:
                    break
                k = c[1]
                if c[3] >= 0 or trail[k_ns[k]]:
                    if self._still(c, False):
                        break  # a state, a trailing namespace's leaf: ``make_room``'s
                elif k not in going and k_len[k] and not kid[k]:
                    nxt = pages_of(k)
                    if nxt is not None:
                        top = c
                        break
                rest.pop()
            if rest and rest[-1] is not top:
                break
            pages = None
            if up >= 0 and k_len[up] and up not in going and not trail[k_ns[up]]:
                c = kid[up]
                while c and c - 1 in going:  # a leaf once its children in the sets went
                    c = sib[c - 1]
                if not c:
                    pages = pages_of(up)
                    if pages:
                        if p_stride[pages[0]] != stride or len(pages) > 1 and any(
                                p_stride[p] != stride for p in pages):
                            break
                        t = used[pages[0]] if len(pages) == 1 else max([used[p] for p in pages])
                        if not t or (top is not None and t > top[0]):
                            pages = None
            if not pages:
                if top is None or any(p_stride[p] != stride for p in nxt):
                    break  # no candidate left (a fresh scoring next), or another class's
                pages = nxt  # page: the caller evicts and asks again
                rest.pop()
                top = None
            victims += pages
            got += len(pages)
            going.add(krec[pages[0]])
            up = t_up[krec[pages[-1]]] - 1  # (``KeyTree.above``)
        self._ranked = (stride, ranked[1], rest, up)
        return victims

    def doomed(self, p: int) -> list[int]:
        """``KeyTree.doomed``: ``p``'s dependants first, then ``p`` (the rules above)."""
        return self.tree.doomed(p)

    def may_go_ahead(self, p: int, going: Collection[int] = ()) -> bool:
        """``KeyTree.may_go_ahead``: nothing resident depends on ``p`` now (or once the keys
        ``going`` went)."""
        return self.tree.may_go_ahead(p, going)

    # ------------------------------------------------------------ questions

    def order(self, stride: int) -> Iterator[int]:
        """Committed page records of class ``stride``, least recently used first (pinned
        included): ``LruOrder.order``; ``make_room``'s choice is by leaf and score instead."""
        return self.lru.order(stride)

    def strides(self) -> list[int]:
        """The classes that have held a committed page."""
        return self.lru.strides()

    def ranked(self, ns: str) -> list[int]:
        """Every committed page record of namespace ``ns``, next victim first (quotas):
        ``KeyTree.ranked`` of them by last use."""
        return self.tree.ranked(super().ranked(ns))

    def upcoming(self, stride: int, n: int) -> list[int]:
        """The pages of class ``stride``'s next leaf segments (the least recently used leaves,
        up to ``n`` pages; their order by score is ``make_room``'s business)."""
        self._flush_leaves()
        ix = self.ix
        out, back, seen = [], [], set()
        while len(out) < n:
            t, p = self._pop(self._heaps, _LEAF, stride)
            if p < 0:
                break
            back.append((t, p))
            k = ix.p_krec[p]
            seg = self.tree.segment(k) if k not in seen else None
            seen.add(k)
            if seg is None:
                continue
            out.extend(seg)
            child = ix.p_krec[seg[-1]]  # then the keys above that would be leaves next
            tree = self.tree
            q = tree.up[child] - 1
            while q >= 0 and len(out) < n and tree.kid[q] == child + 1 and not tree.sib[child]:
                pages = tree.pages(q)
                if pages is None:
                    break
                out.extend(pages)
                child, q = q, tree.up[q] - 1
        if back:
            self._back(self._heaps, stride, back)
        return out[:n]

    def _still(self, c: tuple[int, int, float, int], whole: bool = True) -> list[int] | None:
        """The pages candidate ``c`` of an earlier ``make_room`` (same tick) takes, if it may
        still go: a leaf not evicted since (its record not reused: a new key's pages are
        pending), or a state still mid-chain and unpinned. ``whole`` False: a leaf's own pages
        only (as telling: its segment is them and maybe the keys above)."""
        ix = self.ix
        t, k, _, p = c
        if p >= 0:
            if (ix.p_flags[p] & COMMITTED and not ix.p_pins[p] and ix.p_used[p] == t
                    and self.tree.kid[k]):
                return [p]
            return None
        if not ix.k_len[k] or self.tree.kid[k]:
            return None
        return self.tree.segment(k) if whole else self.tree.pages(k)

    def _oldest_leaf_slab(self, stride: int):
        """(tick, slab) of the least recently used leaf page of another class whose slab holds
        no pinned page, or None."""
        ix, best = self.ix, None
        for other in list(self._heaps):
            if other == stride:
                continue
            t, p = self._pop(self._heaps, _LEAF, other)
            if p < 0:
                continue
            self._back(self._heaps, other, [(t, p)])
            slab = ix.alloc.slab_of(ix.p_off[p])
            if slab.pinned == 0 and (best is None or t < best[0]):
                best = (t, slab)
        return best

    def _value(self, k: int, t: int, tick: int) -> float | None:
        """The value of leaf ``k``'s segment (KV keys / bytes freed: cached per leaf, a hint),
        or None while it may not go: a page pinned or pending, or a state-less leaf in its
        grace (worth 0 after it)."""
        ix = self.ix
        pages = self.tree.pages(k)
        if pages is None:
            return None
        trail = ix.ns_trail[ix.k_ns[k]]
        if trail and not self.tree.has_state(k, trail):
            return None if tick - t < GRACE_TICKS else 0.0
        got = self._vals.get(k)
        if got is None:
            self.tree.trim(self.tree.up[k] - 1, k, trail, pages)
            # (no trailing pool: no key of the namespace has a state, so none is above)
            got = self._vals[k] = (len({ix.p_krec[p] for p in pages}),
                                   sum(ix.p_stride[p] for p in pages),
                                   self._state_above(ix.p_krec[pages[-1]], trail)[0]
                                   if trail else -1)
        return got[0] / got[1]

    def _state_value(self, k: int, p: int) -> float:
        """The value of state ``p`` of key ``k``, which has children: the keys a hit ending at
        it saves over the state above it, per byte of the state (cached, a hint): a long
        shared prefix's state is worth much, a conversation's earlier turn little."""
        got = self._vals.get(~k)
        if got is None:
            ix = self.ix
            q, n = self._state_above(k, ix.ns_trail[ix.k_ns[k]])
            got = self._vals[~k] = (n, ix.p_stride[p], q)
        return got[0] / got[1]

    def _state_above(self, k: int, trail: int) -> tuple[int, int]:
        """(the nearest key above key ``k`` with a state, -1 for none; the keys from ``k`` up
        to it, ``k`` included): what a hit ending at ``k``'s state saves over that state."""
        tree = self.tree
        up, has_state = tree.up, tree.has_state
        n, q = 1, up[k] - 1
        while q >= 0 and n < MAX_WALK and not has_state(q, trail):
            n, q = n + 1, up[q] - 1
        return (q if n < MAX_WALK else -1), n

    def _whole_if_slab(self, pages: list[int], stride: int) -> list[int]:
        """``pages`` (a victim set for class ``stride``), with ``split_ok`` False when they
        empty a slab of another class whole: then they go together, and the slab, free, serves
        ``stride`` (a state's reservation that splits the leaf segment it took keeps the KV
        slab the segment filled, and takes the next state, or the head of a chain's slab)."""
        ix = self.ix
        p_stride = ix.p_stride
        others = [p for p in pages if p_stride[p] != stride]
        if not others:  # (mostly: a segment of the class that asked)
            self.split_ok = True
            return pages
        counts, p_off, slab_of = {}, ix.p_off, ix.alloc.slab_of
        for p in others:
            slab = slab_of(p_off[p])
            counts[slab] = counts.get(slab, 0) + 1
        self.split_ok = not any(slab.used == m for slab, m in counts.items())
        return pages

