"""Hybrid radix cache: exact tree shapes, LRU orders, locks, eviction and the leak identity.

Cases follow ``hybrid-radix-cache.md`` §8 (upstream scenario, best match at the last state,
branching, eviction order, locks, split under lock, duplicates, tombstone fill, paged matching,
double free), with KV in pages: ``mK`` is the state slot the K-th insert donated.
"""

import pytest

from hicached.engine.pools import DoubleFree, IdAllocator, LeakDetected, check_identity
from hicached.engine.radix import HybridRadixCache


class Harness:
    """A tree over debug allocators (128 KV pages, 20 state slots), inserting like a request."""

    def __init__(self, page_size=1, hybrid=True, kv_pages=128, slots=20, debug=True):
        self.kv = IdAllocator(kv_pages, "kv pages", debug=debug)
        self.st = IdAllocator(slots, "state slots", debug=debug) if hybrid else None
        self.tree = HybridRadixCache(page_size, self.kv, self.st, hybrid=hybrid)
        self.ps = page_size
        self.slots = []  # donated slot of each insert, in order (m1 is slots[0])

    def ins(self, tokens, prev=0, pages=None):
        n = len(tokens) // self.ps
        pages = self.kv.alloc(n) if pages is None else pages
        state = self.st.alloc(1)[0] if self.st else None
        self.slots.append(state)
        res = self.tree.insert(tokens, pages, [f"h{p}" for p in pages], state, prev)
        if res.state_exists:
            self.st.free([state])
        return res

    def m(self, k):
        return self.slots[k - 1]

    def shape(self, node=None):
        """{edge tokens: (state or None, subtree)} for exact tree comparisons."""
        node = node or self.tree.root
        return {n.key: (n.state, self.shape(n)) for n in node.children.values()}

    def kv_lru(self):
        """Edges, most recently used first."""
        return [n.key for n in reversed(self.tree.kv_lru.values())]

    def state_lru(self):
        return [n.state for n in reversed(self.tree.state_lru.values())]

    def check_idle(self):
        t = self.tree
        t.sanity_check()
        check_identity(self.kv, t.kv_evictable, t.kv_protected, accounted=t.tree_pages())
        if self.st:
            check_identity(self.st, t.state_evictable, t.state_protected,
                           accounted=t.tree_states())


def upstream_tree():
    h = Harness()
    h.ins([1, 2, 3])
    h.ins([1, 2, 3, 4, 5, 6, 7])
    h.ins([10, 11, 12])
    h.ins([1, 2, 3, 4, 5, 60, 70])
    return h


def test_upstream_scenario():
    h = upstream_tree()
    assert h.shape() == {
        (1, 2, 3): (h.m(1), {(4, 5): (None, {(6, 7): (h.m(2), {}), (60, 70): (h.m(4), {})})}),
        (10, 11, 12): (h.m(3), {}),
    }
    assert h.kv_lru() == [(60, 70), (6, 7), (4, 5), (1, 2, 3), (10, 11, 12)]
    assert h.state_lru() == [h.m(4), h.m(2), h.m(1), h.m(3)]
    # duplicates of the shared prefix were freed by insert: 3 + 4 + 3 + 2 tokens cached
    assert h.tree.cached_pages == 12 and h.kv.available == 128 - 12
    h.check_idle()

    assert h.tree.evict(1) == 3  # the whole LRU leaf [10, 11, 12] and m3
    assert (10, 11, 12) not in h.shape() and h.st.available == 20 - 3
    assert h.tree.evict_states(1) == 1  # [1, 2, 3] becomes a tombstone, its KV stays
    assert h.shape()[(1, 2, 3)][0] is None and h.tree.cached_pages == 9
    assert h.tree.match_prefix([1, 2, 3, 4, 5]).pages == []
    r = h.tree.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert len(r.pages) == 7 and r.node.key == (60, 70)
    assert len(h.tree.match_prefix([1, 2, 3, 4, 5, 6, 7]).pages) == 7
    assert h.tree.evict_states(1) == 1  # now the LRU state is the [60, 70] leaf: evicted whole
    assert h.shape() == {(1, 2, 3): (None, {(4, 5): (None, {(6, 7): (h.m(2), {})})})}
    r = h.tree.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert r.pages == [] and r.node is h.tree.root and r.kv_len == 5 and r.branching_len == 5
    h.check_idle()


def test_best_match_stops_at_last_state():
    h = Harness(page_size=2)
    h.ins([1, 2, 3, 4, 5, 6, 7, 8])
    r = h.tree.match_prefix([1, 2, 3, 4, 9, 9])  # leaves the edge after 2 pages: a split
    assert r.pages == [] and r.kv_len == 4 and r.branching_len == 4
    assert h.shape() == {(1, 2, 3, 4): (None, {(5, 6, 7, 8): (h.m(1), {})})}
    assert h.tree.cached_pages == 4  # splitting moves no pages
    r = h.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(r.pages) == 4 and r.node.key == (5, 6, 7, 8) and r.branching_len is None
    h.check_idle()


def test_branching_point_gets_a_state():
    h = Harness(page_size=2)
    r1 = list(range(100, 116))  # 16 tokens, 8 pages
    h.ins(r1)
    r2 = r1[:10] + [1, 2, 3, 4]
    r = h.tree.match_prefix(r2)
    assert r.pages == [] and r.branching_len == 10  # KV matched past the last state
    res = h.ins(r2[:10])  # the engine snapshots at the branching point and inserts it
    assert res.prefix_len == 10 and not res.state_exists
    assert h.shape() == {tuple(r1[:10]): (h.m(2), {tuple(r1[10:]): (h.m(1), {})})}
    r3 = r1[:12] + [7, 7]
    r = h.tree.match_prefix(r3)
    assert len(r.pages) == 5 and r.kv_len == 12 and r.branching_len == 12
    h.check_idle()


def test_state_eviction_order_root_end_first():
    h = Harness()
    h.ins([1, 2, 3])
    h.ins([1, 2, 3, 4, 5])
    h.ins([1, 2, 3, 4, 5, 6])
    h.tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert h.state_lru() == [h.m(3), h.m(2), h.m(1)]
    assert h.tree.evict_states(1) == 1 and h.tree.cached_pages == 6  # m1 tombstoned
    assert h.shape()[(1, 2, 3)][0] is None
    assert h.tree.evict_states(1) == 1 and h.tree.cached_pages == 6  # m2 tombstoned
    assert h.tree.evict_states(1) == 1  # the leaf goes, and the tombstones it leaves
    assert h.shape() == {} and h.kv.available == 128 and h.st.available == 20
    assert (h.tree.kv_evictable, h.tree.state_evictable) == (0, 0)
    h.check_idle()


def test_locked_path_blocks_eviction():
    h = upstream_tree()
    lock = h.tree.inc_lock(h.tree.match_prefix([1, 2, 3, 4, 5, 6, 7]).node)
    assert (h.tree.kv_protected, h.tree.state_protected) == (7, 1)
    assert h.tree.evict(100) == 5  # [10, 11, 12] and [60, 70]; the cascade stops at [4, 5]
    assert h.tree.evict_states(5) == 1  # [1, 2, 3] tombstoned; m2 is locked
    assert h.shape() == {(1, 2, 3): (None, {(4, 5): (None, {(6, 7): (h.m(2), {})})})}
    h.tree.sanity_check(idle=False)
    h.tree.dec_lock(lock)
    assert (h.tree.kv_evictable, h.tree.kv_protected) == (7, 0)
    assert (h.tree.state_evictable, h.tree.state_protected) == (1, 0)
    h.check_idle()


def test_lock_accounting():
    h = upstream_tree()
    node = h.tree.match_prefix([10, 11, 12]).node
    before = (h.tree.kv_evictable, h.tree.kv_protected, h.tree.state_evictable)
    a, b = h.tree.inc_lock(node), h.tree.inc_lock(node)
    assert (node.kv_lock, node.state_lock) == (2, 2)
    assert (h.tree.kv_protected, h.tree.state_protected) == (3, 1)  # counted once
    h.tree.dec_lock(a)
    h.tree.dec_lock(b)
    assert (h.tree.kv_evictable, h.tree.kv_protected, h.tree.state_evictable) == before
    with pytest.raises(AssertionError):
        h.tree.dec_lock(b)


def test_split_under_lock():
    h = Harness()
    h.ins(list(range(1, 11)))
    lock = h.tree.inc_lock(h.tree.match_prefix(list(range(1, 11))).node)
    h.ins([1, 2, 3, 4, 99])
    mid = h.tree.root.children[(1,)]
    assert mid.key == (1, 2, 3, 4) and mid.state is None
    assert (mid.kv_lock, mid.state_lock) == (1, 0)
    assert (h.tree.kv_protected, h.tree.kv_evictable) == (10, 1)
    h.tree.dec_lock(lock)
    assert (h.tree.kv_protected, h.tree.kv_evictable) == (0, 11)
    h.check_idle()


def test_duplicate_insert_frees_callers_copies():
    h = Harness(page_size=2)
    h.ins(list(range(1, 9)))
    avail_kv, avail_st = h.kv.available, h.st.available
    res = h.ins(list(range(1, 9)))  # a second request computed the same 4 pages
    assert res.prefix_len == 8 and res.state_exists
    assert (h.kv.available, h.st.available) == (avail_kv, avail_st)
    h.check_idle()


def test_tombstone_fill_then_duplicate_state():
    h = Harness()
    h.ins(list(range(1, 9)))
    h.tree.match_prefix([1, 2, 3, 4, 9])  # split: [1..4] is a tombstone
    evictable = h.tree.state_evictable
    res = h.ins([1, 2, 3, 4])
    assert (res.prefix_len, res.state_exists) == (4, False)
    assert h.tree.state_evictable == evictable + 1 and res.node.state == h.m(2)
    assert h.ins([1, 2, 3, 4]).state_exists  # a state is never overwritten
    h.check_idle()


def test_paged_matching():
    h = Harness(page_size=4)
    h.ins(list(range(1, 9)))
    r = h.tree.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])  # a partial page never matches
    assert r.pages == [] and r.kv_len == 4
    assert len(h.tree.match_prefix(list(range(1, 10))).pages) == 2
    h.check_idle()


def test_lru_eviction_order_in_pages():
    h = Harness(page_size=2)
    a, b, c = [1] * 8, [2] * 6, [3] * 4
    h.ins(a), h.ins(b), h.ins(c)
    h.tree.match_prefix(a)  # a becomes most recent: b goes first, then c
    assert h.tree.evict(1) == 3 and (2, 2) not in h.tree.root.children
    assert h.tree.evict(1) == 2 and (3, 3) not in h.tree.root.children
    assert h.tree.cached_pages == 4
    h.check_idle()


def test_non_hybrid_tree_matches_anywhere():
    h = Harness(page_size=2, hybrid=False)
    h.ins(list(range(1, 9)))
    r = h.tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert len(r.pages) == 2 and r.branching_len is None
    h.ins([1, 2, 3, 4, 9, 9])
    assert h.tree.cached_pages == 5
    assert h.tree.evict(1) == 2 and h.tree.cached_pages == 3  # the older leaf, no cascade
    h.check_idle()


def test_double_free_detected_in_debug_mode():
    alloc = IdAllocator(8, "kv pages", debug=True)
    p, q = alloc.alloc(2)
    alloc.free([p])
    with pytest.raises(DoubleFree, match=f"id {p} freed twice"):
        alloc.free([p])
    with pytest.raises(DoubleFree):
        alloc.free([q, q])


def test_identity_catches_double_free_without_debug():
    alloc = IdAllocator(8, "kv pages")
    pages = alloc.alloc(4)
    alloc.free(pages[:1])
    alloc.free(pages[:1])  # silently double-freed: the pool over-reports by one page
    with pytest.raises(LeakDetected, match="excess"):
        check_identity(alloc, evictable=0, protected=0, in_use=3)
    alloc2 = IdAllocator(8, "kv pages", debug=True)
    alloc2.alloc(3)  # never freed, owned by nobody
    with pytest.raises(LeakDetected, match=r"deficit \(leak\) of 3; leaked ids \[0, 1, 2\]"):
        check_identity(alloc2, evictable=0, protected=0, accounted=[])
