"""The hybrid cache controller's eviction: keep the pages that can still give a hit.

A hit is a prefix (key i stands for pages 0..i), so a page is worth something only while every
page before it on its chain is kept, and a trailing-pool state (Mamba, sliding window) only while
its KV prefix is restorable; in a namespace whose hits need a trailing state, KV pages past the
last state of their branch restore nothing either. ``LruPolicy`` evicts pages one by one from the
old end and keeps the wrong ones; this policy knows the chains (``Records.link``: by (namespace,
key), parent and depth, whoever sent them) as a tree of key records:

    up[k]  kid[k]  sib[k] / psib[k]     parent, first child, next / previous sibling (+1; 0 none)
    flags[k]                            ANCHOR_L3 / STATE_L3: a page of that kind left L2 with an
                                        L3 copy (still restorable); BROKEN: its parent left with none

Rules, on every path that frees pages (``PageIndex.evict`` / ``drop_one`` ask ``doomed``):

- a **leaf segment** goes whole: a leaf key (no child in L2) with, in a namespace with trailing
  pools, the chain of single-child, state-less keys above it (what a hit at the leaf alone
  needed). ``make_room`` only ever picks such segments;
- a page whose key others depend on (an ALL_PAGES pool: KV, DSA indexer) takes its dependants
  first: the keys below it, deepest first, and its key's other pages; then the state-less keys
  above that it leaves as a leaf. A page with a copy in L3 takes nothing (still restorable);
- a state takes the state-less leaf segment it ended, if it ended one.

Victims (``make_room``): the ``CANDIDATES`` least recently used leaves (a lazily invalidated heap
of (tick, key): an entry is live while the key is a leaf and a page of it still has that tick),
each scored Marconi-style as ``recency + alpha x value``, both normalised over the candidates to
[0, 1], where value = the segment's KV pages (the tokens a hit at its leaf saves over the state
above it) / the bytes it frees. The lowest score that frees a slot of the wanted class goes. A
state-less leaf of a trailing namespace is worth 0 once ``GRACE_TICKS`` have passed (the state
of its call, or of the next one, makes it a real leaf); before that it is passed over. When no
candidate frees a slot of the class, or another class's least recently used slab is older than
the best candidate, that slab is reclaimed as ``LruPolicy`` does, with every page's dependants.
``alpha`` 0 is the ``prefix`` policy: leaves in LRU order.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from hicached.daemon.policy import COMMITTED, LruPolicy

PENDING = 2  # entry.PENDING
IN_L3 = 4  # entry.IN_L3
ANCHOR_L3, STATE_L3, BROKEN = 1, 2, 4
CANDIDATES = 16  # leaves scored per eviction
GRACE_TICKS = 1024  # page uses a state-less leaf waits for its state before it is worth 0
FALLBACK_PAGES = 256  # pages of a class tried, oldest first, when no leaf of it may go
MAX_WALK = 1 << 20  # keys a cycle check walks at most (a cycle is refused, never followed)


class HybridPolicy(LruPolicy):
    """Prefix- and state-aware eviction (module docstring); ``alpha`` 0: ``prefix``."""

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = float(alpha)
        self.name = "hybrid" if alpha else "prefix"
        self._heaps: dict[int, list[tuple[int, int]]] = {}  # stride -> (tick, leaf key)
        self._pushes = 0
        self._class_ns: dict[int, set[int]] = {}  # stride -> namespace ids that had a leaf in it
        # (tick, key): leaves of trailing namespaces committed without a state; ``stale`` takes
        # the ones still state-less after ``GRACE_TICKS`` (no hit can end on them)
        self._tails: list[tuple[int, int]] = []  # a heap
        self._held: list[int] = []  # such leaves found pinned: looked at on every call
        for name in ("_up", "_kid", "_sib", "_psib"):
            setattr(self, name, memoryview(np.zeros(0, np.int32)))
        self._kflags = memoryview(np.zeros(0, np.uint8))

    def grow_keys(self, n: int) -> None:
        for name, dtype in (("_up", np.int32), ("_kid", np.int32), ("_sib", np.int32),
                            ("_psib", np.int32), ("_kflags", np.uint8)):
            arr = np.zeros(n, dtype)
            old = getattr(self, name)
            arr[:len(old)] = old
            setattr(self, name, memoryview(arr))

    # ------------------------------------------------------------ the tree of keys

    def linked(self, recs, parent: int) -> None:
        """Key records ``recs`` (-1: not in L2) were linked in a chain, the first under
        ``parent`` (-1: a root or not in L2)."""
        q = parent
        for k in recs:
            if k >= 0:
                self._attach(k, q)
            q = k

    def _attach(self, k: int, q: int) -> None:
        if self._up[k] == q + 1:
            return
        if q >= 0 and (q == k or (self._kid[k] and self._below(q, k))):
            q = -1  # a cycle: k would hang under its own descendant
        self._detach(k)
        if q < 0:
            return
        first = self._kid[q]
        self._up[k], self._sib[k], self._psib[k] = q + 1, first, 0
        if first:
            self._psib[first - 1] = k + 1
        self._kid[q] = k + 1

    def _below(self, q: int, k: int) -> bool:
        """Whether ``q`` is ``k`` or hangs under it (walks up from ``q``)."""
        up, n = self._up, 0
        while q >= 0 and n < MAX_WALK:
            if q == k:
                return True
            q = up[q] - 1
            n += 1
        return n >= MAX_WALK

    def _detach(self, k: int) -> None:
        q = self._up[k] - 1
        if q < 0:
            return
        s, ps = self._sib[k], self._psib[k]
        if ps:
            self._sib[ps - 1] = s
        else:
            self._kid[q] = s
        if s:
            self._psib[s - 1] = ps
        self._up[k] = self._sib[k] = self._psib[k] = 0
        if not self._kid[q]:
            self._push(q)  # a leaf now
            self._maybe_tail(q)

    def key_freed(self, k: int) -> None:
        """Key record ``k`` is freed (its last page left L2): off its parent; its children
        become roots (BROKEN unless its KV prefix is still in L3)."""
        self._detach(k)
        broken = 0 if self._kflags[k] & ANCHOR_L3 else BROKEN
        c = self._kid[k]
        while c:
            nxt = self._sib[c - 1]
            self._up[c - 1] = self._sib[c - 1] = self._psib[c - 1] = 0
            self._kflags[c - 1] |= broken
            c = nxt
        self._kid[k] = 0
        self._kflags[k] = 0

    # ------------------------------------------------------------ the index's events

    def inserted(self, p: int) -> None:
        super().inserted(p)
        if not self._kid[self.ix.p_krec[p]]:
            self._push_page(p)
            self._maybe_tail(self.ix.p_krec[p])

    def inserted_many(self, ps: np.ndarray, used_before: np.ndarray,
                      mask_before: np.ndarray) -> None:
        """``inserted`` of each of ``ps`` in turn: the lists at once, then the leaves (within
        a call's chain only its last key is one) each seen as ``inserted`` saw it, the call's
        later pages still pending: their pools not yet in its key's mask, their ``p_used`` as
        before, and the index's committed count as it was then (``_push_page``)."""
        super().inserted_many(ps, used_before, mask_before)
        ix = self.ix
        krecs = ix.np["p_krec"][ps]
        leaves = np.flatnonzero(np.frombuffer(self._kid, np.int32)[krecs] == 0)
        if not leaves.size:
            return
        base = ix.committed_count - len(ps)
        krec_list = krecs.tolist()
        last = {k: j for j, k in enumerate(krec_list)}  # each key's last page in the call
        pages_of: dict[int, list[int]] = {}  # key -> its pages' positions (when needed)
        for i in leaves.tolist():
            p, k = int(ps[i]), krec_list[i]
            self._push_page(p, base + i + 1)
            if last[k] == i:  # no later page of its key: its state is as it was then
                self._maybe_tail(k)
                continue
            if not pages_of:
                for j, kj in enumerate(krec_list):
                    pages_of.setdefault(kj, []).append(j)
            mask = int(mask_before[i])
            for j in pages_of[k]:
                if j <= i:
                    mask |= ix._tbit[ix.p_tid[ps[j]]]
            self._maybe_tail(k, mask, {int(ps[j]): int(used_before[j])
                                       for j in pages_of[k] if j > i})

    def _maybe_tail(self, k: int, mask: int | None = None,
                    used: dict[int, int] | None = None) -> None:
        """Queue leaf ``k`` for ``stale`` if its namespace has trailing pools and it holds no
        state. ``mask`` / ``used``: its key's mask and some of its pages' uses to go by
        instead of the records' (``inserted_many``)."""
        ix = self.ix
        trail = ix._ns_trail[ix.k_ns[k]]
        if not trail:
            return
        if mask is None:
            if self._has_state(k, trail):
                return
        elif mask & trail or self._kflags[k] & STATE_L3:
            return
        p, t = ix.k_head[k], 0
        while p >= 0:  # its grace runs from its newest use (as ``orphans`` counts it)
            t = max(t, ix.p_used[p] if used is None else used.get(p, ix.p_used[p]))
            p = ix.p_knext[p]
        heapq.heappush(self._tails, (t, k))

    def stale(self) -> list[int]:
        """Page records to evict now: the state-less leaves (and the state-less keys above
        them) of trailing namespaces whose grace is over."""
        ix, tails, out = self.ix, self._tails, []
        limit = ix._tick - GRACE_TICKS
        due, self._held = self._held, []
        while tails and tails[0][0] <= limit:
            due.append(heapq.heappop(tails)[1])
        for k in due:
            trail = ix._ns_trail[ix.k_ns[k]]
            if not ix.k_len[k] or self._kid[k] or self._has_state(k, trail):
                continue
            pages = self._pages(k)
            if pages is None:  # read or written now: at the next call once it is not
                self._held.append(k)
                continue
            newest = max(ix.p_used[p] for p in pages)
            if newest > limit:  # used since (or a new key in the record): a new grace
                heapq.heappush(tails, (newest, k))
                continue
            seen = set(pages)
            self._trim(self._up[k] - 1, k, trail, pages, seen)
            out.extend(pages)
        return out

    def touched(self, p: int) -> None:
        super().touched(p)
        if not self._kid[self.ix.p_krec[p]]:
            self._push_page(p)

    def touched_many(self, ps: list[int], ticks: list[int]) -> None:
        """``touched`` of each in turn: the lists, then a push per use of a leaf's page, with
        the tick of that use."""
        super().touched_many(ps, ticks)
        kid, krec = self._kid, self.ix.p_krec
        for p, t in zip(ps, ticks):
            if not kid[krec[p]]:
                self._push_page(p, used=t)

    def _push_page(self, p: int, committed: int | None = None, used: int | None = None) -> None:
        """Page record ``p`` of a leaf is a candidate in its class, as of its last use (or
        ``used``); the heaps are compacted when they hold many times the index's committed
        pages (or ``committed``) in entries."""
        ix = self.ix
        heap = self._heaps.get(ix.p_stride[p])
        if heap is None:
            heap = self._heaps[ix.p_stride[p]] = []
            self._class_ns[ix.p_stride[p]] = set()
        self._class_ns[ix.p_stride[p]].add(ix.k_ns[ix.p_krec[p]])
        heapq.heappush(heap, (ix.p_used[p] if used is None else used, ix.p_krec[p]))
        self._pushes += 1
        if self._pushes > 4 * (ix.committed_count if committed is None else committed) + 4096:
            self._compact()

    def removed(self, p: int) -> None:
        super().removed(p)
        ix = self.ix
        if ix.p_flags[p] & IN_L3:
            k = ix.p_krec[p]
            trail = ix._ns_trail[ix.k_ns[k]]
            self._kflags[k] |= STATE_L3 if ix._tbit[ix.p_tid[p]] & trail else ANCHOR_L3

    def _push(self, k: int) -> None:
        """Key ``k`` became a leaf: each of its committed pages is a candidate in its class."""
        ix = self.ix
        p = ix.k_head[k]
        while p >= 0:
            if ix.p_flags[p] & COMMITTED:
                self._push_page(p)
            p = ix.p_knext[p]

    def _compact(self) -> None:
        """Drop the heaps' dead entries (each use of a leaf pushes one)."""
        for stride, heap in list(self._heaps.items()):
            live = [(t, k) for t, k in heap if self._live(t, k)]
            heapq.heapify(live)
            self._heaps[stride] = live
        self._pushes = sum(map(len, self._heaps.values()))

    def _live(self, t: int, k: int) -> bool:
        ix = self.ix
        if not ix.k_len[k] or self._kid[k]:
            return False
        p = ix.k_head[k]
        while p >= 0:
            if ix.p_used[p] == t and ix.p_flags[p] & COMMITTED:
                return True
            p = ix.p_knext[p]
        return False

    # ------------------------------------------------------------ what goes with a page

    def _pages(self, k: int) -> list[int] | None:
        """Key ``k``'s pages, states first; None when one is pinned or pending."""
        ix = self.ix
        trail = ix._ns_trail[ix.k_ns[k]]
        states, rest = [], []
        p = ix.k_head[k]
        while p >= 0:
            if ix.p_pins[p] or not ix.p_flags[p] & COMMITTED:
                return None
            (states if ix._tbit[ix.p_tid[p]] & trail else rest).append(p)
            p = ix.p_knext[p]
        return states + rest

    def _has_state(self, k: int, trail: int, without: int = 0) -> bool:
        return bool(self.ix.k_mask[k] & trail & ~without) or bool(self._kflags[k] & STATE_L3)

    def _trim(self, q: int, child: int, trail: int, out: list[int], seen: set) -> int:
        """Append the pages of the state-less single-child keys from ``q`` up (``child``: the
        key below ``q`` that goes); returns how many keys."""
        n = 0
        while (q >= 0 and trail and self._kid[q] == child + 1 and not self._sib[child]
               and not self._has_state(q, trail)):
            pages = self._pages(q)
            if pages is None:
                break
            out.extend(p for p in pages if p not in seen)
            seen.update(pages)
            n += 1
            child, q = q, self._up[q] - 1
        return n

    def doomed(self, p: int) -> list[int]:
        """The page records to evict for ``p`` to go, in order (dependants first): see the
        module docstring. Empty when a page that depends on ``p`` is pinned or pending (a
        client reads or writes it): ``p`` stays until it is not."""
        ix = self.ix
        k = ix.p_krec[p]
        trail = ix._ns_trail[ix.k_ns[k]]
        bit = ix._tbit[ix.p_tid[p]]
        out, seen = [], {p}
        if bit & trail:  # a state
            if ix.p_flags[p] & IN_L3 or self._kid[k] or self._has_state(k, trail, bit):
                return [p]
            out.append(p)
            rest = self._pages(k)
            if rest is None:  # its KV pages are read now: they go once their grace is over
                self._held.append(k)
                return out
            out.extend(q for q in rest if q != p)
            seen.update(rest)
            self._trim(self._up[k] - 1, k, trail, out, seen)
            return out
        if ix.p_flags[p] & IN_L3:
            return [p]
        stack, order = [self._kid[k]], []
        while stack:  # the keys below k, parents before children; reversed: deepest first
            c = stack.pop()
            while c:
                order.append(c - 1)
                if self._kid[c - 1]:
                    stack.append(self._kid[c - 1])
                c = self._sib[c - 1]
        for c in reversed(order):
            pages = self._pages(c)
            if pages is None:
                return []  # a dependant is read or written now: ``p`` stays for now
            out.extend(pages)
        pages = self._pages(k)
        if pages is None:
            return []
        out.extend(q for q in pages if q != p)
        out.append(p)
        seen.update(out)
        up = self._up[k] - 1
        if up >= 0 and self._kid[up] == k + 1 and not self._sib[k]:
            self._trim(up, k, trail, out, seen)
        return out

    def ranked(self, ns: str) -> list[int]:
        """Every committed page record of namespace ``ns``, next victim first (quotas): by the
        newest use in their key's subtree, then deepest first, so a chain goes from its leaf
        and a stem stays while a branch below it is used."""
        ix = self.ix
        sel = super().ranked(ns)
        if not sel:
            return sel
        top = ix._k_top
        up = np.frombuffer(self._up, np.int32)[:top].astype(np.int64) - 1
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

    # ------------------------------------------------------------ victims

    def make_room(self, stride: int) -> list[int]:
        ix = self.ix
        heap, tick = self._heaps.get(stride, []), ix._tick
        cands, back = [], []  # (tick, key, pages, value) / heap entries to put back
        while heap and len(cands) < CANDIDATES:
            t, k = heapq.heappop(heap)
            if not self._live(t, k):
                continue
            seg = self._segment(k, t, tick)
            if seg is None:
                back.append((t, k))
                continue
            cands.append((t, k, *seg))
        best = None
        if cands:
            lo, hi = cands[0][0], max(c[0] for c in cands)
            top = max(c[3] for c in cands) or 1.0
            span = (hi - lo) or 1
            for c in cands:
                score = (c[0] - lo) / span + self.alpha * c[3] / top
                if best is None or score < best[0]:
                    best = (score, c)
        for c in cands:
            if best is None or c is not best[1]:
                back.append((c[0], c[1]))
        for entry in back:
            heapq.heappush(heap, entry)
        if best is not None:
            slab = ix.alloc.oldest_unpinned(stride)
            if (slab is None or slab.last_used >= cands[0][0]
                    or self._class_ns.get(slab.stride, set()) & self._class_ns[stride]):
                return best[1][2]
            # an older slab of a class of other namespaces (another model, idle): reclaimed
            # as LRU does (a KV class's slabs are older than its own namespaces' states: the
            # stems of their chains, never reclaimed by age for them)
            pages = self._expand([p for p in ix._slots.get(slab.index, ()) if p >= 0])
            if pages:
                return pages
            return best[1][2]
        for p in itertools.islice(self.unpinned(stride), FALLBACK_PAGES):
            pages = self.doomed(p)  # the class's least recently used page that may go
            if pages:
                return pages
        return []

    def _segment(self, k: int, t: int, tick: int) -> tuple[list[int], float] | None:
        """(the pages a leaf ``k`` takes with it, its value), or None while it may not go (a
        page pinned or pending, or a state-less leaf in its grace)."""
        ix = self.ix
        pages = self._pages(k)
        if pages is None:
            return None
        trail = ix._ns_trail[ix.k_ns[k]]
        seen = set(pages)
        n = 1 + self._trim(self._up[k] - 1, k, trail, pages, seen)
        if trail and not self._has_state(k, trail):
            if tick - t < GRACE_TICKS:
                return None
            return pages, 0.0
        size = sum(ix.p_stride[p] for p in pages)
        return pages, n / size

    def _expand(self, pages: list[int]) -> list[int]:
        out, seen = [], set()
        for p in pages:
            for q in self.doomed(p):
                if q not in seen:
                    seen.add(q)
                    out.append(q)
        return out


def make_policy(name: str, alpha: float = 1.0) -> LruPolicy:
    """The eviction policy ``name`` (``EVICTIONS``)."""
    if name == "lru":
        return LruPolicy()
    if name == "prefix":
        return HybridPolicy(0.0)
    if name == "hybrid":
        return HybridPolicy(alpha)
    raise ValueError(f"eviction: {name!r} is not one of {', '.join(EVICTIONS)}")


EVICTIONS = ("lru", "prefix", "hybrid")


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
