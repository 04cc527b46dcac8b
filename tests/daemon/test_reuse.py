"""``hicached/daemon/eviction/reuse.py``: the classes of new pages learned as they are stored and
read, and ``demote`` storing the seldom-read ones demoted (issue 48), on small real indexes."""

import numpy as np

from hicached.daemon.eviction.reuse import THETA, ReuseClasses
from tests.daemon.test_hybrid_eviction import held, make, store


def test_a_class_never_read_is_demoted_once_it_has_the_evidence():
    """One-page root calls at depth 0: ``(reads + 1) / (stored + 2)`` falls under 0.05 at the
    19th page; a read counts once per page and takes the demotion off."""
    r = ReuseClasses()
    r.grow(64)
    r.grow_keys(64)
    one = np.array([True])
    for i in range(20):
        r.stored(np.array([i]), np.array([i]), one, ~one, np.array([0]), -1, tick=i)
        assert r.demoted(i) == ((0 + 1) / (i + 1 + 2) < THETA), i
    assert r.demoted_pages == 2 and r.stored_pages.sum() == 20
    r.read(np.array([19, 19]), np.array([19, 19]), tick=30)
    assert not r.demoted(19) and r.read_pages.sum() == 1
    r.read(np.array([19]), np.array([19]), tick=31)
    assert r.read_pages.sum() == 1  # a page's first read only


def test_the_gap_is_the_parents_use_before_the_last_in_page_uses():
    """A call that extends a key read just now is classed by the use before that read."""
    r = ReuseClasses()
    r.grow(8)
    r.grow_keys(8)
    t = np.array([True])
    r.stored(np.array([0]), np.array([0]), t, ~t, np.array([0]), -1, tick=100)
    r.read(np.array([0]), np.array([0]), tick=5000)  # the request's get of its parent
    r.stored(np.array([1]), np.array([1]), t, ~t, np.array([1]), 0, tick=5001)
    # gap 4901 page uses: bucket 1 + 3 (512 <= 4901 < 16384 ... 4096 <= 4901); one new key
    cls = int(np.flatnonzero(r.stored_pages)[-1])
    assert cls == (1 * 7 + 1 + 3) * 10 + 1


def test_demote_evicts_a_demoted_page_before_an_older_one_and_hybrid_does_not():
    for policy, kept in (("demote", True), ("hybrid", False), ("prefix", False)):
        ix = make(2, policy)  # 2 slabs of 16 KV pages
        store(ix, ["a"])
        for i in range(30):  # never read: the class is demoted from x17 on
            store(ix, [f"x{i:02d}"])
        store(ix, ["y"])  # the arena is full
        store(ix, ["z"])  # one must go: LRU's oldest is "a"; hybrid's first, a demoted page
        assert ("a" in held(ix)) == kept, policy
        assert len(held(ix)) == 32
        if policy == "demote":
            assert "x17" not in held(ix) and "x16" in held(ix)
