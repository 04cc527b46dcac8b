"""The chains an eviction policy knows: key records as a tree (``hybrid.py`` evicts by it).

``KeyTree`` keeps arrays indexed by key record, grown with the records (``grow_keys``): ``up`` /
``kid`` / ``sib`` / ``psib`` (parent, first child, next and previous sibling, each +1, 0 for
none) and ``kflags``. ``Records.link`` tells ``linked`` where a call's keys hang; a key record
freed leaves the tree (``key_freed``), its children becoming roots. A link that would make a
cycle (a key under its own descendant: a client's bug, or two clients disagreeing) makes the key
a root instead: the tree is walked by eviction and must stay a tree. ``doomed`` (with ``pages`` /
``trim``) says which pages must go with a page: the rules of ``hybrid.py``'s docstring. The
policy that owns the tree hears of its changes through the ``TreeListener`` it gave the tree's
constructor: ``key_moved`` (a key changed place), ``parent_now`` (a leaf got its first child),
``leaf_now`` (a key lost its last child), ``state_gone_alone`` (a state went without its KV
pages). Reads the index only through ``IndexView`` (``interface.py``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

import numpy as np

from hicached.daemon.columns import grown
from hicached.daemon.entry import COMMITTED, IN_L3
from hicached.daemon.eviction.interface import IndexView

STATE_L3 = 1  # key flag: a state of the key left L2 with a copy in L3 (still restorable)
MAX_WALK = 1 << 20  # keys a cycle check walks at most (a cycle is refused, never followed)


class TreeListener(Protocol):
    """What a ``KeyTree`` tells its owner, as the tree changes (each call O(1) but
    ``keys_moved``: O(len)). A listener reads the tree and the index; it must not change the
    tree from these calls."""

    def key_moved(self, k: int) -> None:
        """Key record ``k`` changed place in the tree (linked under a parent, or freed)."""

    def keys_moved(self, ks: list[int]) -> None:
        """``key_moved`` of each of ``ks`` (a new chain linked at once)."""

    def parent_now(self, q: int) -> None:
        """Key ``q``, a leaf, got its first child."""

    def leaf_now(self, q: int) -> None:
        """Key ``q`` lost its last child (it is a leaf now, or freed a moment later)."""

    def state_gone_alone(self, k: int) -> None:
        """``doomed`` named a state of leaf ``k`` without its KV pages (pinned): they go
        later."""


class NoListener:
    """The Null ``TreeListener``: hears everything, does nothing."""

    def key_moved(self, k: int) -> None:
        pass

    def keys_moved(self, ks: list[int]) -> None:
        pass

    def parent_now(self, q: int) -> None:
        pass

    def leaf_now(self, q: int) -> None:
        pass

    def state_gone_alone(self, k: int) -> None:
        pass


class KeyTree:
    """The tree of key records (module docstring).

    Owns the per-key arrays ``up`` / ``kid`` / ``sib`` / ``psib`` / ``kflags`` (read-only to
    others; replaced when they grow, so read them through the tree at each call) and mutates
    nothing else; reads the index only through ``IndexView``; calls only its ``listener``
    (``TreeListener``), given at construction, as the tree changes. The pages it names
    (``doomed``, ``segment``, ``trim``, ``expand``) are committed and unpinned when named,
    dependants first.
    """

    def __init__(self, ix: IndexView, listener: TreeListener | None = None):
        self.ix = ix
        listener = NoListener() if listener is None else listener
        # the listener's calls, bound once (the tree calls them per key)
        self._moved, self._moved_many = listener.key_moved, listener.keys_moved
        self._parent_now, self._leaf_now = listener.parent_now, listener.leaf_now
        self._state_gone_alone = listener.state_gone_alone
        self.up = memoryview(np.zeros(0, np.int32))
        self.kid = memoryview(np.zeros(0, np.int32))
        self.sib = memoryview(np.zeros(0, np.int32))
        self.psib = memoryview(np.zeros(0, np.int32))
        self.kflags = memoryview(np.zeros(0, np.uint8))

    def grow_keys(self, n: int) -> None:
        """Key records now number ``n`` (the arrays grow; their contents stay)."""
        for name, dtype in (("up", np.int32), ("kid", np.int32), ("sib", np.int32),
                            ("psib", np.int32), ("kflags", np.uint8)):
            setattr(self, name, memoryview(grown(getattr(self, name), n, dtype)))

    def state_in_l3(self, k: int) -> None:
        """A state of key ``k`` left L2 with a copy in L3 (``STATE_L3``: still restorable)."""
        self.kflags[k] |= STATE_L3

    def linked(self, recs, parent: int) -> None:
        """Key records ``recs`` (a list or an int64 array; -1: not in L2) were linked in a
        chain, the first under ``parent`` (-1: a root or not in L2)."""
        if isinstance(recs, np.ndarray):
            if self._linked_fresh(recs, parent):
                return
            recs = recs.tolist()
        q = parent
        for k in recs:
            if k >= 0:
                self._attach(k, q)
            q = k

    def _linked_fresh(self, recs: np.ndarray, parent: int) -> bool:
        """``linked`` of a call's new chain at once, in the state ``_attach`` of each in turn
        leaves: when every key is in L2, none twice, none ``parent``, and none has a child,
        nor (but the first) a parent. False, having done nothing, otherwise."""
        n = len(recs)
        if n < 2 or recs.min() < 0:
            return False
        up, kid = np.asarray(self.up), np.asarray(self.kid)
        rest, head = recs[1:], recs[:-1]
        if kid[recs].any() or up[rest].any() or parent in recs:
            return False
        order = np.sort(recs)
        if not (order[1:] != order[:-1]).all():  # a key twice
            return False
        self._attach(int(recs[0]), parent)  # (touches no other key of the call)
        up[rest] = head + 1
        np.asarray(self.sib)[rest] = 0
        np.asarray(self.psib)[rest] = 0
        kid[head] = rest + 1
        self._moved_many(rest.tolist())
        mask = self.ix.np["k_mask"]
        for q in head[mask[head] != 0].tolist():  # keys with committed pages
            self._parent_now(q)
        return True

    def _attach(self, k: int, q: int) -> None:
        if self.up[k] == q + 1:
            return
        if q >= 0 and (q == k or (self.kid[k] and self._below(q, k))):
            q = -1  # a cycle: k would hang under its own descendant
        self._detach(k)
        if q < 0:
            return
        first = self.kid[q]
        self.up[k], self.sib[k], self.psib[k] = q + 1, first, 0
        if first:
            self.psib[first - 1] = k + 1
        self.kid[q] = k + 1
        self._moved(k)
        if not first:
            self._parent_now(q)

    def _below(self, q: int, k: int) -> bool:
        """Whether ``q`` is ``k`` or hangs under it (walks up from ``q``)."""
        up, n = self.up, 0
        while q >= 0 and n < MAX_WALK:
            if q == k:
                return True
            q = up[q] - 1
            n += 1
        return n >= MAX_WALK

    def _detach(self, k: int) -> None:
        up = self.up
        q = up[k] - 1
        if q < 0:
            return
        sib, psib, kid = self.sib, self.psib, self.kid
        s, ps = sib[k], psib[k]
        if ps:
            sib[ps - 1] = s
        else:
            kid[q] = s
        if s:
            psib[s - 1] = ps
        up[k] = sib[k] = psib[k] = 0
        if not kid[q]:
            self._leaf_now(q)

    def key_freed(self, k: int) -> None:
        """Key record ``k`` is freed (its last page left L2): off its parent; its children
        (left only when its pages had L3 copies, or are pinned) become roots."""
        self._detach(k)
        kid = self.kid
        c = kid[k]
        if c:
            up, sib, psib = self.up, self.sib, self.psib
            while c:
                nxt = sib[c - 1]
                up[c - 1] = sib[c - 1] = psib[c - 1] = 0
                c = nxt
            kid[k] = 0
        self.kflags[k] = 0
        self._moved(k)

    # ------------------------------------------------------------ what goes with a page

    def pages(self, k: int) -> list[int] | None:
        """Key ``k``'s pages, states first; None when one is pinned or pending."""
        ix = self.ix
        trail = ix.ns_trail[ix.k_ns[k]]
        pins, flags, knext = ix.p_pins, ix.p_flags, ix.p_knext
        p = ix.k_head[k]
        if not trail:  # no state: list order
            out = []
            while p >= 0:
                if pins[p] or not flags[p] & COMMITTED:
                    return None
                out.append(p)
                p = knext[p]
            return out
        states, rest = [], []
        t_bit, tid = ix.t_bit, ix.p_tid
        while p >= 0:
            if pins[p] or not flags[p] & COMMITTED:
                return None
            (states if t_bit[tid[p]] & trail else rest).append(p)
            p = knext[p]
        return states + rest

    def has_state(self, k: int, trail: int, without: int = 0) -> bool:
        return bool(self.ix.k_mask[k] & trail & ~without) or bool(self.kflags[k] & STATE_L3)

    def trim(self, q: int, child: int, trail: int, out: list[int]) -> int:
        """Append the pages of the state-less single-child keys from ``q`` up (``child``: the
        key below ``q`` that goes; each key once: the walk goes up from it), up to the first
        with a page pinned or pending; returns how many keys. (``pages`` inlined: a segment
        is tens to hundreds of keys, walked for every candidate ``make_room`` scores.)"""
        if not trail:
            return 0
        ix = self.ix
        kid, sib, up, kflags = self.kid, self.sib, self.up, self.kflags
        k_mask, k_head, p_knext, p_pins, p_flags = (ix.k_mask, ix.k_head, ix.p_knext, ix.p_pins,
                                                    ix.p_flags)
        n = 0
        while (q >= 0 and kid[q] == child + 1 and not sib[child] and not k_mask[q] & trail
               and not kflags[q] & STATE_L3):
            start = len(out)
            p = k_head[q]
            while p >= 0:  # no state among them: in list order (``pages`` puts states first)
                if p_pins[p] or not p_flags[p] & COMMITTED:
                    del out[start:]
                    return n
                out.append(p)
                p = p_knext[p]
            n += 1
            child, q = q, up[q] - 1
        return n

    def doomed(self, p: int) -> list[int]:
        """The page records to evict for ``p`` to go, in order (dependants first): see the
        module docstring. Empty when a page that depends on ``p`` is pinned or pending (a
        client reads or writes it): ``p`` stays until it is not."""
        ix = self.ix
        k = ix.p_krec[p]
        trail = ix.ns_trail[ix.k_ns[k]]
        bit = ix.t_bit[ix.p_tid[p]]
        out = []
        if bit & trail:  # a state
            if ix.p_flags[p] & IN_L3 or self.kid[k] or self.has_state(k, trail, bit):
                return [p]
            out.append(p)
            rest = self.pages(k)
            if rest is None:  # its KV pages are read now: they go once their grace is over
                self._state_gone_alone(k)
                return out
            out.extend(q for q in rest if q != p)
            self.trim(self.up[k] - 1, k, trail, out)
            return out
        if ix.p_flags[p] & IN_L3:
            return [p]
        stack, order = [self.kid[k]], []
        while stack:  # the keys below k, parents before children; reversed: deepest first
            c = stack.pop()
            while c:
                order.append(c - 1)
                if self.kid[c - 1]:
                    stack.append(self.kid[c - 1])
                c = self.sib[c - 1]
        for c in reversed(order):
            pages = self.pages(c)
            if pages is None:
                return []  # a dependant is read or written now: ``p`` stays for now
            out.extend(pages)
        pages = self.pages(k)
        if pages is None:
            return []
        out.extend(q for q in pages if q != p)
        out.append(p)
        up = self.up[k] - 1
        if up >= 0 and self.kid[up] == k + 1 and not self.sib[k]:
            self.trim(up, k, trail, out)
        return out

    def may_go_ahead(self, p: int, going: Collection[int] = ()) -> bool:
        """A state, a page with an L3 copy, or a page of a key with no child now, or none once
        the keys ``going`` (key records leaving with all their pages) went: nothing resident
        depends on it (a chain continued from a segment's middle since ``make_room`` named it
        does)."""
        ix = self.ix
        k = ix.p_krec[p]
        c = self.kid[k]
        if not c or ix.p_flags[p] & IN_L3 or ix.t_state[ix.p_tid[p]]:
            return True
        sib = self.sib
        while c:  # (a key freed leaves its parent: ``key_freed``)
            if c - 1 not in going:
                return False
            c = sib[c - 1]
        return True

    def segment(self, k: int) -> list[int] | None:
        """The pages leaf ``k`` takes with it (its own and the state-less single-child keys
        above it), or None when one of its own is pinned or pending."""
        pages = self.pages(k)
        if pages is None:
            return None
        ix = self.ix
        trail = ix.ns_trail[ix.k_ns[k]]
        if trail:  # (``trim`` takes nothing in a namespace without trailing pools)
            self.trim(self.up[k] - 1, k, trail, pages)
        return pages

    def newest(self, k: int, stride: int) -> int:
        """The newest use of key ``k``'s committed, unpinned pages of class ``stride`` (0: it
        has none, or one of its pages is pinned)."""
        ix, t = self.ix, 0
        pins, flags, strides = ix.p_pins, ix.p_flags, ix.p_stride
        used, knext = ix.p_used, ix.p_knext
        p = ix.k_head[k]
        while p >= 0:
            if pins[p]:
                return 0
            if flags[p] & COMMITTED and strides[p] == stride and used[p] > t:
                t = used[p]
            p = knext[p]
        return t

    def above(self, pages: list[int]) -> int:
        """The key above a segment (its last page's key's parent), -1 for none."""
        return self.up[self.ix.p_krec[pages[-1]]] - 1

    def expand(self, pages: list[int]) -> list[int]:
        """``doomed`` of each of ``pages`` in turn, each page once (a slab reclaimed)."""
        out, seen = [], set()
        for p in pages:
            for q in self.doomed(p):
                if q not in seen:
                    seen.add(q)
                    out.append(q)
        return out

    def ranked(self, sel: list[int]) -> list[int]:
        """Committed page records ``sel`` (a namespace's, by last use: ``EvictionPolicy.ranked``)
        next victim first (quotas): by the newest use in their key's subtree, then deepest
        first, so a chain goes from its leaf and a stem stays while a branch below it is
        used."""
        ix = self.ix
        if not sel:
            return sel
        top = ix.key_top
        up = np.frombuffer(self.up, np.int32)[:top].astype(np.int64) - 1
        newest = np.zeros(top, np.int64)
        recs = np.asarray(sel, np.int64)
        krec = ix.np["p_krec"][recs]
        np.maximum.at(newest, krec, ix.np["p_used"][recs])
        depth = _depths(up)
        order = np.argsort(-depth, kind="stable")
        order = order[up[order] >= 0]
        for chunk in np.split(order, np.flatnonzero(np.diff(depth[order])) + 1):
            np.maximum.at(newest, up[chunk], newest[chunk])  # deepest first: up the tree
        keys = np.lexsort((-depth[krec], newest[krec]))
        return recs[keys].tolist()


def _depths(up: np.ndarray) -> np.ndarray:
    """Keys above each key (``up``: the parent, -1 none), by pointer jumping (at most 64
    rounds: 2^64 levels, or a cycle, are not followed)."""
    anc, depth = up.copy(), (up >= 0).astype(np.int64)
    for _ in range(64):
        more = anc >= 0
        if not more.any():
            break
        a = anc[more]
        depth[more] += depth[a]
        anc[more] = anc[a]
    return depth
