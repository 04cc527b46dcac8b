"""Evicting ahead in the control loop's idle turns (``hicached/daemon/reclaim.py``): the same
victims the sets would have evicted, page by page, stopping safely between any two."""

import random
import time

import pytest
import torch
from inproc_daemon import inproc_daemon
from pools import kv_pool, kv_tokens, pages
from test_hybrid_eviction import KV, STATE, chain, held, make, store

from hicached import Client, HostPool, PoolTransfer
from hicached.daemon.orphans import orphans


def free_kv(ix):
    return ix.alloc.free_bytes(KV) // KV


def test_nothing_is_evicted_ahead_before_a_set_had_to_evict_or_when_off():
    ix = make(2, "lru")
    store(ix, chain("a", 20))
    r = ix.reclaimer
    r.set_ahead(0.25)
    assert not r.wanted() and r.step() == 0  # 12 slots free, no class pressed
    store(ix, chain("b", 14))  # 2 over: the set evicts a00, a01 itself
    assert ix.pressed == {KV} and held(ix) == sorted(chain("a", 20)[2:] + chain("b", 14))
    r.set_ahead(0.0)
    assert not r.wanted()  # off
    r.set_ahead(0.25)
    assert r.wanted()
    assert r.step() == 8  # a quarter of 2 slabs of 16: 8 slots free, the oldest 8 pages gone
    assert held(ix) == sorted(chain("a", 20)[10:] + chain("b", 14)) and free_kv(ix) == 8
    assert not r.wanted() and r.step() == 0 and r.evicted == 8


@pytest.mark.parametrize("policy", ["lru", "prefix", "hybrid"])
def test_evicting_ahead_page_by_page_never_leaves_an_orphan(policy):
    """A seeded workload (chains continued across calls, branches, states) with a reclaimer
    freeing 2 slots ahead after each call, one page per step as a busy loop would: no orphan
    at any moment under the chain-aware policies, and the room is there for the next call."""
    rng = random.Random(5)
    calls = []
    for i in range(80):
        parent = rng.choice([None, None] + [c[-1] for c in calls[-6:]])
        calls.append((chain(f"c{i}-", rng.randint(1, 6)), parent, rng.random() < 0.5))
    ix = make(4, policy)
    r = ix.reclaimer
    r.set_ahead(2 * KV / ix.alloc.capacity_bytes)
    for keys, parent, with_state in calls:
        p = parent if parent is not None and ix.get(("ns", "kv"), parent) else None
        store(ix, keys, parent=p, depth=-1, states=[keys[-1]] if with_state else ())
        while r.wanted():
            assert r.step(pages=1) <= 2  # a page, or a key's KV page and its state
            assert policy == "lru" or orphans(ix.records) == (0, 0)
        assert r._blocked or all(ix.alloc.free_bytes(c) >= max(c, 2 * KV) for c in ix.pressed)
    assert r.evicted > 50


def test_a_set_stopped_between_pages_leaves_no_orphan_and_a_page_read_since_stays():
    ix = make(2, "prefix")  # 1 slab of 16 KV pages, 1 of 2 states
    store(ix, chain("a", 8), states=["a07"])
    store(ix, chain("b", 8), states=["b07"])
    store(ix, chain("n", 1))  # the set evicts a's segment (9 pages) for one slot
    assert held(ix) == sorted(chain("b", 8) + ["n00"])
    store(ix, chain("a", 6), states=["a05"])
    r = ix.reclaimer
    r.set_ahead(8 * KV / ix.alloc.capacity_bytes)  # 8 slots free wanted: 1 now
    assert r.step(busy=lambda: True) == 2  # b07's state and b07, then a request arrives
    assert "b07" not in held(ix) and "b06" in held(ix) and r.wanted()  # a segment begun
    # no grace: b00..b06 (going) and n00 (waiting for its state) would be orphans; the stats
    # leave out the pages going
    assert orphans(ix.records, grace_ticks=0) == (8, 8 * KV)
    assert sorted(r.leaving()) == sorted(ix.get(("ns", "kv"), k).rec for k in chain("b", 7))
    assert orphans(ix.records, grace_ticks=0, leaving=r.leaving()) == (1, KV)
    ix.touch_many([ix.get(("ns", "kv"), "b05")])  # the request reads b05 (b06 is next)
    assert r.step(pages=1) == 1 and held(ix) == sorted(chain("b", 6) + ["n00"] + chain("a", 6))
    r.step(pages=1)  # b05 was read since the set was chosen: the set ends there
    assert "b05" in held(ix)
    assert orphans(ix.records, grace_ticks=1 << 40) == (0, 0)  # b00..b05 wait for their grace


def test_a_chain_continued_from_the_middle_of_a_set_keeps_its_ancestors():
    ix = make(4, "prefix")  # 16 KV pages or 2 states a slab
    store(ix, chain("a", 10), states=["a09"])
    store(ix, chain("b", 6), states=["b05"])
    store(ix, chain("c", 16))
    store(ix, chain("d", 16))  # every slab used
    store(ix, chain("e", 1))  # the set evicts a's segment, the oldest leaf with a state
    assert ix.pressed == {KV} and not any(k in held(ix) for k in chain("a", 10))
    r = ix.reclaimer
    r.set_ahead(16 * KV / ix.alloc.capacity_bytes)
    assert r.step(busy=lambda: True) == 2  # b05's state and b05 of the segment b05..b00
    store(ix, chain("z", 3), parent="b02", depth=3)  # b continued from the set's middle
    r.step(pages=3)  # b04, b03; b02 now has a child: the set ends there
    assert [k for k in chain("b", 6) if k in held(ix)] == chain("b", 3)
    assert all(k in held(ix) for k in chain("z", 3))
    assert orphans(ix.records, grace_ticks=1 << 40) == (0, 0)


def test_nothing_that_may_go_blocks_until_the_index_changes():
    ix = make(1, "lru")
    store(ix, chain("a", 16))
    pins = [ix.get(("ns", "kv"), k) for k in chain("a", 16)]
    for e in pins:
        ix.pin(e)
    assert store(ix, ["b"]) == []  # no room, nothing may go
    r = ix.reclaimer
    r.set_ahead(0.25)
    assert r.wanted() and r.step() == 0
    assert not r.wanted()  # nothing changed: the loop does not spin on it
    for e in pins:
        ix.unpin(e)
    ix.touch_many(pins[8:])
    assert r.wanted() and r.step() == 4 and held(ix) == chain("a", 16)[4:]


def test_the_daemon_evicts_ahead_while_idle_and_reads_stay_exact(tmp_path):
    """A real daemon: once sets had to evict, its idle turns free ``evict_ahead`` of the arena
    ahead; pages still held read back exactly."""
    with inproc_daemon(tmp_path, l2_size=1 << 20, slab_size=64 << 10, l3_backend="none",
                       evict_ahead=0.25) as d, Client(d.endpoint, "ns") as c:
        src = kv_pool(num_pages=1200, seed=3)  # 1 KiB pages: 1024 fill the arena
        c.register_mem_host_pool_v2(src, "kv")
        for i in range(0, 1200, 100):
            keys = [f"k{j}" for j in range(i, i + 100)]
            assert all(c.batch_set_v2([PoolTransfer("kv", pages(i, 100), keys=keys)])["kv"])
        deadline = time.monotonic() + 10
        while (st := c.stats())["l2_pages"] > 1024 - 256:  # a quarter of the arena freed
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        assert st["evictions_ahead"] > 0 and st["evictions"] >= 1200 - 768
        held_keys = [f"k{j}" for j in range(1200) if c.batch_exists([f"k{j}"])]
        assert len(held_keys) == st["l2_pages"]
        dst = kv_pool(num_pages=1200)
        c.register_mem_host_pool_v2(dst, "kv")
        idx = [int(k[1:]) for k in held_keys]
        assert all(c.batch_get_v1(held_keys, torch.cat([pages(j, 1) for j in idx])))
        for j in idx:
            assert torch.equal(kv_tokens(dst, j, 1), kv_tokens(src, j, 1))


def test_a_daemons_commits_leave_the_tails_due_to_its_idle_turns_unless_it_has_none():
    ix = make(4, "prefix", busy=lambda: False)
    r = ix.reclaimer
    store(ix, chain("s", 2), states=["s01"])  # the namespace's hits need a state
    stem = [ix.get(("ns", "kv"), k) for k in chain("s", 2)]

    def age(ticks):  # other pages used: ``ticks`` page uses go by
        for _ in range(ticks // 2):
            ix.touch_many(stem)

    store(ix, chain("t", 3))  # a state-less leaf: its state may come with the next call
    assert not r.wanted()  # nothing due
    age(1100)  # its grace is over
    store(ix, chain("u", 1), states=["u00"])  # a commit right after the loop's last turn
    assert held(ix) == sorted(chain("s", 2) + chain("t", 3) + ["u00"])  # left to the loop
    assert r.wanted() and r.step() == 3 and "t00" not in held(ix)
    assert orphans(ix.records) == (0, 0)
    store(ix, chain("v", 3))
    assert not r.wanted()
    age(1100)
    assert r.wanted()  # the loop has work for its idle turns, but requests keep coming:
    time.sleep(0.02)  # no idle turn for longer than TAILS_WAIT_S
    store(ix, chain("w", 1), states=["w00"])
    assert "v00" not in held(ix) and r.evicted == 3  # the commit took them itself
    age(1100)
    store(ix, chain("x", 2))  # due at once, the loop still busy: a stats call settles them
    age(1100)
    assert orphans(ix.records)[0] == 2
    r.settle()
    assert orphans(ix.records) == (0, 0)


# ---------------------------------------------------------------- a key's pages go together

IX = 128  # INDEXER slot stride: 8 a slab


def store_both(ix, keys, parent=None, states=()):
    """One call storing KV and INDEXER pages of ``keys`` (a chain under ``parent``) and the
    states of ``states``, as the controller reserves them (pool after pool) and commits them."""
    entries = [ix.reserve(("ns", "kv"), k, KV, KV) for k in keys]
    entries += [ix.reserve(("ns", "indexer"), k, IX, IX) for k in keys]
    for k in states:
        ix.mark_trailing(("ns", "mamba"))
        entries.append(ix.reserve(("ns", "mamba"), k, STATE, STATE))
    assert None not in entries
    ix.link("ns", list(keys), parent, -1)
    ix.commit_many(entries)


def torn(ix, keys):
    """The keys of which L2 holds one of the KV and INDEXER pages without the other."""
    kv, idx = ix.contains(("ns", "kv"), keys), ix.contains(("ns", "indexer"), keys)
    return [k for k, a, b in zip(keys, kv, idx) if a != b]


def tails_setup(more=()):
    """A trailing namespace (chain s with a state) and a state-less leaf t00..t02 (KV and
    INDEXER pages) whose grace is over: the idle turns' next victim set is t02, t01, t00 (each
    key's INDEXER page first, as its call reserved them last). ``more``: (keys, states) of
    other calls, stored before (a commit once the tails are due may take them itself)."""
    ix = make(8, "hybrid", busy=lambda: False)
    r = ix.reclaimer
    store_both(ix, chain("s", 2), states=["s01"])
    for keys, states in more:
        store_both(ix, keys, states=states)
    store_both(ix, chain("t", 3))
    stem = [ix.get(("ns", "kv"), k) for k in chain("s", 2)]
    for _ in range(600):  # 1200 page uses of others: t's grace (GRACE_TICKS) is over
        ix.touch_many(stem)
    assert r.wanted()
    return ix, r


def test_a_step_stopped_at_any_page_never_leaves_half_a_key():
    """The idle turns take a state-less tail a page at a time at most: each key's KV and
    INDEXER pages still go in one turn (a get between two turns must never find the KV page
    of a key whose INDEXER page its call stored with it is gone)."""
    ix, r = tails_setup()
    keys = chain("t", 3)
    steps = []
    while r.wanted():
        n = r.step(pages=1)  # one page asked for: the key's both go
        assert torn(ix, keys) == []
        if n:
            steps.append((n, [k for k in keys if k in held(ix)]))
    assert steps == [(2, ["t00", "t01"]), (2, ["t00"]), (2, [])]
    assert held(ix) == held(ix, "indexer") == chain("s", 2)


def test_a_step_stopped_by_a_request_stops_at_a_key_s_end():
    """A leaf segment with a state (state, INDEXER, KV of its leaf, then the keys above):
    a request arriving after the first pages stops the turn only once the key is gone."""
    ix, r = tails_setup(more=[(chain("u", 2), ["u01"])])
    r.defer(ix.policy.doomed(ix.get(("ns", "mamba"), "u01").rec))  # u01's state, u01, u00
    assert r.step(busy=lambda: True) == 3  # u01's state and both its pages, then the request
    assert torn(ix, chain("u", 2)) == [] and held(ix, "indexer") == sorted(
        chain("s", 2) + chain("t", 3) + ["u00"])


def test_a_key_read_since_its_set_was_named_keeps_both_pages():
    """A get reads t01's KV page (no lease: the daemon hears of it in a later ``Release``)
    after the idle turns began the set: t01 stays with both its pages, t00 above it too."""
    ix, r = tails_setup()
    assert r.step(pages=1) == 2 and "t02" not in held(ix)
    ix.touch(ix.get(("ns", "kv"), "t01"))
    while r.wanted():
        r.step(pages=1)
    assert held(ix) == held(ix, "indexer") == sorted(chain("s", 2) + chain("t", 2))


def test_a_key_that_gained_a_page_since_its_set_was_named_stays_whole():
    """t01's INDEXER page leaves another way and comes back (a new call) before the idle
    turns reach t01: its KV page, named with the old one, stays with the new one."""
    ix, r = tails_setup()
    assert r.step(pages=1) == 2
    ix.evict(ix.get(("ns", "indexer"), "t01"))  # (with its dependants: t01's KV page, t02)
    assert "t01" not in held(ix)
    store_both(ix, ["t01"], parent="t00")  # stored again: not the pages the set named
    while r.wanted():
        r.step(pages=1)
    assert torn(ix, chain("t", 3)) == []


def test_a_set_taking_deferred_pages_of_its_class_takes_their_keys_whole():
    """A reservation of INDEXER slots takes the deferred pages of that class first: each key
    it takes goes with its KV page (the next page of the queue is of another class)."""
    ix, r = tails_setup()
    ix.reclaimer.defer(ix.policy.stale())  # t02, t01, t00 for the idle turns
    assert r.take(IX, ix.alloc.free_slots(IX) + 1) == 2  # one INDEXER slot: t02 whole
    assert torn(ix, chain("t", 3)) == [] and held(ix) == sorted(chain("s", 2) + chain("t", 2))


def split_setup():
    """A slab of 16 KV pages and one of 2 states, full of states: chain a (12 KV pages and a
    state at its end, a segment of 13 pages) and chain b (2 and a state), with a daemon's
    reclaimer attached."""
    ix = make(2, "prefix", busy=lambda: False)
    r = ix.reclaimer
    store(ix, chain("a", 12), states=["a11"])
    store(ix, chain("b", 2), states=["b01"])
    return ix, r


def test_a_set_that_needs_a_state_slot_leaves_the_rest_of_the_segment_to_the_idle_turns():
    """The victim for one state slot is a's whole segment; the set evicts its leaf key (the
    state and a11) and leaves a00..a10, which no hit can use now, to the loop's idle turns:
    they are going (not orphans), and go in the next step."""
    ix, r = split_setup()
    store(ix, chain("c", 1), states=["c00"])
    assert held(ix, "mamba") == ["b01", "c00"]
    assert held(ix) == sorted(chain("a", 11) + chain("b", 2) + ["c00"])
    going = sorted(ix.get(("ns", "kv"), k).rec for k in chain("a", 11))
    assert sorted(r.leaving()) == going and r.wanted()
    assert orphans(ix.records, grace_ticks=0, leaving=r.leaving()) == (0, 0)
    assert r.step(pages=4) == 4 and held(ix) == sorted(chain("a", 7) + chain("b", 2) + ["c00"])
    # a leaf first: a10..a07
    assert orphans(ix.records, grace_ticks=0, leaving=r.leaving()) == (0, 0)
    assert r.step() == 7 and not r.wanted()
    assert held(ix) == sorted(chain("b", 2) + ["c00"])
    assert orphans(ix.records, grace_ticks=0) == (0, 0)
    assert r.evicted == 11


def test_without_a_reclaimer_the_segment_goes_whole():
    ix = make(2, "prefix")
    store(ix, chain("a", 12), states=["a11"])
    store(ix, chain("b", 2), states=["b01"])
    store(ix, chain("c", 1), states=["c00"])
    assert held(ix) == sorted(chain("b", 2) + ["c00"])


def test_a_set_that_needs_kv_slots_takes_the_deferred_pages_before_any_live_one():
    """After the split, a set of 12 KV pages finds 2 slots free: it takes a10 down to a01 (the
    dead tail, in its order, as far as it needs) and evicts nothing that can still give a hit;
    a00 goes in the next idle turn."""
    ix, r = split_setup()
    store(ix, chain("c", 1), states=["c00"])
    assert ix.alloc.free_slots(KV) == 2
    before = ix.evictions
    store(ix, chain("d", 12))
    assert held(ix) == sorted(["a00"] + chain("b", 2) + ["c00"] + chain("d", 12))
    assert held(ix, "mamba") == ["b01", "c00"] and ix.evictions - before == 10
    assert r.evicted == 0  # (on the set's path: none evicted ahead)
    # (d's state may come with its next call)
    assert orphans(ix.records, leaving=r.leaving()) == (0, 0)
    assert r.wanted() and r.step() == 1 and "a00" not in held(ix) and r.evicted == 1


def test_a_deferred_tail_continued_since_keeps_what_the_new_chain_needs():
    """A request continues a's remaining prefix at a05 with a new state before the idle turn:
    a00..a05 lead to a state again; the idle turn takes a10..a06 and stops there."""
    ix, r = split_setup()
    store(ix, chain("c", 1), states=["c00"])  # a's state and a11 go, a00..a10 deferred
    ix.touch_many([ix.get(("ns", "kv"), k) for k in chain("a", 6)])  # a get of a00..a05
    store(ix, ["e0"], parent="a05", depth=6, states=["e0"])  # a state slot: evicts b or c
    while r.wanted():
        r.step()
    kv = held(ix)
    assert set(chain("a", 6) + ["e0"]) <= set(kv) and not set(chain("a", 11)[6:]) & set(kv)
    assert "e0" in held(ix, "mamba")
    assert orphans(ix.records, grace_ticks=0) == (0, 0)


def test_the_daemon_leaves_the_rest_of_a_split_segment_to_its_idle_turns(tmp_path):
    """A real daemon, a slab of 16 KV pages and one of 3 states: chain a (12 pages and a state),
    then b and c (a page and a state each). n's state needs a slot: its set evicts a's state and
    a11 only; a00..a10 go in the loop's idle turns (counted as evicted ahead). What is held
    reads back exactly and no orphan is ever counted."""
    with inproc_daemon(tmp_path, eviction="prefix", l2_size=32 << 10, slab_size=16 << 10,
                       l3_backend="none", shared_exists=False) as d, \
            Client(d.endpoint, "ns") as c:
        src = kv_pool(num_pages=32, seed=4)
        states = HostPool.allocate_mamba(8, 2, (16, 32), [(3, 4)])
        for b in states.buffers:
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(5)).to(b.dtype))
        c.register_mem_host_pool_v2(src, "kv")
        c.register_mem_host_pool_v2(states, "mamba")

        def put(keys, first, slot):
            res = c.batch_set_v2([PoolTransfer("kv", pages(first, len(keys)), keys=keys),
                                  PoolTransfer("mamba", [slot], keys=keys[-1:],
                                               hit_policy="trailing_pages")],
                                 anchor_pool="kv", depth=0)
            assert all(res["kv"]) and res["mamba"] == [True]

        a = [f"a{i}" for i in range(12)]
        put(a, 0, 0)
        put(["b0"], 12, 1)
        put(["c0"], 13, 2)
        assert c.stats()["evictions"] == 0
        put(["n0"], 14, 3)
        deadline = time.monotonic() + 10
        while (st := c.stats())["evictions_ahead"] < 11:
            assert time.monotonic() < deadline, st
            time.sleep(0.02)
        assert st["evictions"] == 13 and st["l2_orphan_bytes"] == 0
        assert c.batch_exists(a) == 0
        dst = kv_pool(num_pages=32)
        c.register_mem_host_pool_v2(dst, "kv")
        assert all(c.batch_get_v1(["b0", "c0", "n0"], pages(12, 3)))
        assert torch.equal(kv_tokens(dst, 12, 3), kv_tokens(src, 12, 3))
