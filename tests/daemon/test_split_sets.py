"""A daemon's split victim sets (``hicached/daemon/reclaim.py``): a reservation evicts of a
leaf segment only the keys its call needs, counted first and evicted in one call, the rest
deferred to the idle turns; a later reservation takes the deferred keys it needs in one call
(``Reclaimer.take``); a call with trailing pools evicts first, one set at a time
(``Reclaimer.evict_first``). Each is held to what its keys, reserved one by one, evict
(``test_index_batch.py``'s harness: the index's whole state compared after every call)."""

import random

import pytest
from test_index_batch import KV, MAMBA, OTHER, Plan, replay, snapshot

from hicached.daemon import commits, evict
from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import PageIndex
from hicached.daemon.slabs import SlabAllocator
from hicached.presence import PresenceTable


@pytest.mark.parametrize("policy", ["hybrid", "prefix"])
@pytest.mark.parametrize("state_bytes", [256, 512])
def test_a_daemon_evicts_the_keys_a_split_segment_needs_in_one_call_as_key_by_key(
        tmp_path, policy, state_bytes, monkeypatch):
    """A daemon's reservation evicts a leaf segment only as far as its class needs, the rest
    deferred (``Reclaimer.evict_victims``): the keys that go are counted first and evicted in
    one call (one pass), leaving exactly the state of one call a key, page by page. States in
    the KV pages' class, and in another (a segment of two classes)."""
    from hicached.daemon import reclaim

    calls, real = [], reclaim.Reclaimer.evict_victims

    def counted(self, victims, stride, need):
        before = len(self._queue)
        out = real(self, victims, stride, need)
        calls.append((out, len(self._queue) > before))
        return out

    monkeypatch.setattr(reclaim.Reclaimer, "evict_victims", counted)
    plan = Plan(9, calls=0, slab=16384)
    plan.state_bytes = state_bytes
    rng = random.Random(9)
    stored: list[str] = []
    for i in range(40):  # chains of fresh keys, a state at the end of most, reads between
        keys = [f"{i:04d}{j:060x}" for j in range(rng.choice([3, 20, 40, 70, 130]))]
        stored += keys
        states = [keys[-1]] if rng.random() < 0.8 else []
        plan.calls.append((KV, keys, states, rng.sample(stored, 40), True))
    with monkeypatch.context() as m:  # the reference: a call a key, each page on its own
        m.setattr(reclaim, "ONE_CALL", False)
        m.setattr(evict, "BATCH_MIN", 1 << 30)
        (tmp_path / "each").mkdir()
        single = replay(plan, True, policy, tmp_path / "each", busy=True)
    assert not plan.passes
    batched = replay(plan, True, policy, tmp_path, busy=True)
    for i, (a, b) in enumerate(zip(single, batched, strict=True)):
        diff = [k for k in a if a[k] != b[k]]
        assert not diff, (i, diff)
    assert plan.passes and any(deferred for _, deferred in calls)  # segments split


def segment_in_full_arena(slabs: int, state: int = 0, states: int = 0):
    """A daemon-style index (``busy`` set) of ``slabs`` 16 KiB slabs: a chain of 40 KV pages of
    256 bytes, its last key's state of ``state`` bytes (0: none) and ``states`` more states of
    other keys, 8 pages of another namespace, then that namespace's pages till the KV class is
    full. Returns the index, the chain's keys, the leaf segment of its last key (states first,
    from the leaf up) and the 8 pages' entries."""
    ix = PageIndex(SlabAllocator(slabs * 16384, 16384), policy=make_policy("hybrid"),
                   busy=lambda: False)
    ix.mark_trailing(MAMBA)
    keys = [f"c{i:03d}" for i in range(40)]
    es = ix.reserve_many(KV, keys, 256, 256)
    ix.link("ns", keys, None, 0)
    if state:
        es.append(ix.reserve(MAMBA, keys[-1], state, state))
    es += [ix.reserve(MAMBA, f"s{i}", state, state) for i in range(states)]
    ix.commit_many(es)
    more = ix.reserve_many(OTHER, [f"o{i:03d}" for i in range(8)], 256, 256)
    ix.commit_many(more)
    while ix.alloc.free_slots(256):  # another namespace takes the rest of the arena
        ix.commit(ix.reserve(OTHER, f"x{ix.records.gen}", 256, 256))
    victims = ix.policy.tree.segment(ix.records.find_key("ns", keys[-1]))
    return ix, keys, victims, more


@pytest.mark.parametrize("one_call", [False, True])
def test_a_split_set_that_empties_a_slab_of_another_class_stops_where_key_by_key_does(
        tmp_path, monkeypatch, one_call):
    """A split victim set whose state empties its slab (a state a slab): the free slab is room
    for the KV pages asked, so the set stops after that key, counted first as key by key stops
    (the policies name such a set whole, ``split_ok`` False: this asks the reclaimer alone)."""
    from hicached.daemon import reclaim

    monkeypatch.setattr(reclaim, "ONE_CALL", one_call)
    slab = 16384
    ix, keys, victims, _ = segment_in_full_arena(8, state=slab)  # a state a slab
    ix.reclaimer.pressed.add(256)
    assert [ix.records.p_stride[p] for p in victims[:2]] == [slab, 256]
    ix.policy.split_ok = True
    before = ix.evictions
    assert ix.reclaimer.evict_victims(victims, 256, 10) == 2  # the state and its key's page
    assert ix.evictions - before == 2 and ix.alloc.free_slots(256) >= 10
    assert [p for p, _, _ in reversed(ix.reclaimer._queue)] == victims[2:]  # the rest deferred


def resident(ix: PageIndex) -> list[tuple[str, str]]:
    """(pool, key) of every committed page, sorted."""
    r = ix.records
    return sorted((r.table_of[r.p_tid[p]][1], r.key_of(r.p_krec[p])) for p in range(r.page_top)
                  if r.p_flags[p] & commits.COMMITTED)


@pytest.mark.parametrize("policy", ["hybrid", "prefix"])
@pytest.mark.parametrize("state_bytes,most,busy", [(256, 3, False), (256, 3, True),
                                                   (512, 1, False)])
def test_a_trailing_namespace_evicting_first_evicts_what_key_by_key_evicts(
        tmp_path, policy, busy, state_bytes, most, monkeypatch):
    """With trailing pools a call whose class is short evicts first too, one victim set at a time
    (``Reclaimer.evict_first``: split where the class has room for the call's keys, the rest
    deferred in a daemon; once the first slot is free, a set goes on only through keys with a
    page of the class, as the next keys' ``take`` would): the pages that go, in their order,
    are those its keys evict reserved one by one (each key's ``make_room``), and so is what
    stays after every call, with states in the KV pages' class (several a call, whole sets or
    split ones) or in another (whole sets). What differs is which freed slot a key takes, and
    that key by key a reservation holds its slot (pinned, counted used) before the next set is
    named: with states in another class and split sets, the choices that weigh slabs
    (``_oldest_leaf_slab`` skips a slab with a pinned page; a set that empties a slab of
    another class goes whole) see other slabs, and may differ, as they did for calls of
    ``BATCH_MIN`` keys or more, which evicted a set's keys before reserving them, already. The
    benchmarks on the real traces judge those (``docs/benchmarks.md``)."""
    from hicached.daemon import reclaim

    def run(first: bool) -> tuple[list, list]:
        with monkeypatch.context() as m:
            if not first:
                m.setattr(reclaim.Reclaimer, "evicts_first", lambda self, ns: False)
            ix = PageIndex(SlabAllocator(24 * 4096, 4096), policy=make_policy(policy),
                           busy=(lambda: False) if busy else None)
            ix.mark_trailing(MAMBA)
            gone, real = [], ix.evictor.evict_pages
            r = ix.records

            def logged(pages, *a, **k):  # the pages that went, in their order
                live = {p: (r.p_gen[p], r.p_tid[p], r.key_of(r.p_krec[p])) for p in pages
                        if r.p_flags[p] & commits.COMMITTED}
                out = real(pages, *a, **k)
                gone.extend(live.pop(p)[1:] for p in pages
                            if p in live and r.p_gen[p] != live[p][0])
                return out

            ix.evictor.evict_pages = logged
            rng, stored, seen = random.Random(5), [], []
            for i in range(60):  # chains, a state at the end of most, reads between
                keys = [f"{i:04d}{j:060x}" for j in range(rng.choice([3, 9, 20, 40, 70]))]
                stored += keys
                got = ix.reserve_many(KV, keys, 256, 256)
                if rng.random() < 0.8:  # states: the last key's, and some branch points
                    mine = sorted({len(keys) - 1} | {rng.randrange(len(keys))
                                                     for _ in range(rng.choice([0, 0, 1, 2]))})
                    mine = mine[-most:]
                    got += ix.reserve_many(MAMBA, [keys[j] for j in mine], state_bytes,
                                           state_bytes)
                ix.link("ns", keys, None, 0)
                ix.commit_many([e for e in got if e is not None])
                found = [e for e in ix.get_many(KV, rng.sample(stored, 30)) if e is not None]
                ix.read_many(found)
                ix.unpin_many(found)
                if busy:
                    while ix.reclaimer.wanted() and ix.reclaimer.step(pages=2 if i % 2 else 64):
                        pass
                seen.append(resident(ix))
            assert ix.evictions > 500
            return gone, seen

    each, first = run(False), run(True)
    assert each[0] == first[0]  # the same pages evicted, in the same order
    assert each[1] == first[1]


@pytest.mark.parametrize("state_bytes,seed", [(256, 11), (512, 11), (512, 12)])
def test_a_reservation_takes_the_deferred_keys_it_needs_in_one_call_as_key_by_key(
        tmp_path, state_bytes, seed, monkeypatch):
    """The rest of split segments waits in the reclaimer's queue; a reservation that needs many
    slots takes its next keys (``Reclaimer.take``): counted first, each checked as it would be
    once the keys before it went, and evicted in one call, leaving exactly the state of a key at
    a time (``_take_each``), where keys of the queue were read since (its set ends there), are
    pinned now, or had a chain continued from them (``may_go_ahead``)."""
    from hicached.daemon import reclaim

    def run(one_call: bool, where) -> tuple[list, dict]:
        seen: dict = {"batches": 0, "each": 0}
        with monkeypatch.context() as m:
            m.setattr(reclaim, "ONE_CALL", one_call)
            real_each = reclaim.Reclaimer._take_each

            def each(self, stride, need):
                seen["each"] += 1
                return real_each(self, stride, need)

            m.setattr(reclaim.Reclaimer, "_take_each", each)
            where.mkdir()
            shared = PresenceTable(str(where / "p"), 4096, 1, arena_bytes=24 * 16384, grain=256)
            ix = PageIndex(SlabAllocator(24 * 16384, 16384), policy=make_policy("hybrid"),
                           presence=shared, busy=lambda: False)
            ix.records.gen = 0
            ix.mark_trailing(MAMBA)
            real_evict = ix.evictor.evict_pages

            def evict_pages(pages, *a, **k):
                if len({ix.records.p_krec[p] for p in pages}) > 1:
                    seen["batches"] += 1
                return real_evict(pages, *a, **k)

            ix.evictor.evict_pages = evict_pages
            rng, chains, states = random.Random(seed), [], []
            for i in range(120):
                n = rng.choice([2, 5, 9, 40, 70, 130])
                r, queued = ix.records, ix.reclaimer._queue
                queued = [r.key_of(r.p_krec[p]) for p, gen, _ in queued
                          if r.p_gen[p] == gen and r.p_flags[p] & commits.COMMITTED]
                parent, depth, early = None, 0, []
                if queued and rng.random() < 0.3:  # a chain continued from a deferred key
                    parent, depth = rng.choice(queued), -1
                if queued and rng.random() < 0.3:  # a deferred key's state, set meanwhile
                    early = [ix.reserve(MAMBA, rng.choice(queued), state_bytes, state_bytes)]
                keys = [f"{i:04d}{j:060x}" for j in range(n)]
                if queued and rng.random() < 0.3:  # deferred keys read since
                    some = rng.sample(queued, min(3, len(queued)))
                    found = [e for e in ix.get_many(KV, some) if e]
                    ix.read_many(found)
                    ix.unpin_many(found)
                pinned = []
                if queued and rng.random() < 0.3:  # a read holds deferred keys' pages now
                    some = rng.sample(queued, min(3, len(queued)))
                    pinned = [e for e in ix.get_many(KV, some) if e]
                    ix.pin_many(pinned)
                got = ix.reserve_many(KV, keys, 256, 256)
                if rng.random() < 0.8:
                    got += ix.reserve_many(MAMBA, keys[-1:], state_bytes, state_bytes)
                ix.unpin_many(pinned)
                got += [e for e in early if e is not None and e.alive]
                ix.link("ns", keys, parent, depth)
                ix.commit_many([e for e in got if e is not None])
                chains.append(keys)
                for _ in range(rng.choice([0, 1, 3])):  # reads, some of deferred keys
                    found = [e for e in ix.get_many(KV, rng.choice(chains)[:30]) if e]
                    ix.read_many(found)
                    ix.unpin_many(found)
                states.append(snapshot(ix, shared))
            shared.close()
            assert ix.evictions > 1000
            return states, seen

    each, first = run(False, tmp_path / "each"), run(True, tmp_path / "first")
    for i, (a, b) in enumerate(zip(each[0], first[0], strict=True)):
        diff = [k for k in a if a[k] != b[k]]
        assert not diff, (i, diff)
    assert first[1]["batches"] > each[1]["batches"]  # keys taken together
    assert first[1]["each"] > 0  # and some a key at a time (a check it could not count on)


def test_a_page_queued_twice_ends_the_keys_taken_together_where_key_by_key_goes_on():
    """A victim set may name a page twice (two tails whose walks up meet): ``take`` counts the
    keys before it and leaves the rest to ``_take_each``, which skips it once gone: both leave
    the same index."""
    from hicached.daemon import reclaim

    states = []
    for one_call in (False, True):
        ix = PageIndex(SlabAllocator(4 * 4096, 4096), policy=make_policy("hybrid"),
                       busy=lambda: False)
        ix.records.gen = 0
        keys = [f"{i:064x}" for i in range(64)]
        es = ix.reserve_many(KV, keys, 256, 256)
        ix.link("ns", keys, None, 0)
        ix.commit_many(es)
        pages = [e.rec for e in reversed(es)]  # the chain from its leaf up
        ix.reclaimer.defer(pages[:10] + pages[5:6] + pages[10:30])
        rc, take = ix.reclaimer, (ix.reclaimer.take if one_call else
                                  ix.reclaimer._take_each)
        old = reclaim.ONE_CALL
        reclaim.ONE_CALL = one_call
        try:
            got = take(256, 20)
        finally:
            reclaim.ONE_CALL = old
        assert got == 20 and ix.alloc.free_slots(256) == 20
        states.append((snapshot(ix, None), [(p, g) for p, g, _ in rc._queue]))
    assert states[0] == states[1]


@pytest.mark.parametrize("one_call", [False, True])
@pytest.mark.parametrize("queued", [False, True])
def test_a_set_split_for_several_states_stops_where_the_next_state_would_name_its_own(
        tmp_path, monkeypatch, one_call, queued):
    """Two states' slots asked of a state-led leaf segment (a state, then KV keys): key by key
    the first state's reservation takes the state and its key's KV page, and the second's
    finds no state among the rest (``take`` goes on only through keys with a page of the
    class), so the policy names it another set. Asked for both at once, the set stops there
    too, and the rest is deferred; so it does after the first slot whenever something is
    queued before the rest (it would go after it)."""
    from hicached.daemon import reclaim

    monkeypatch.setattr(reclaim, "ONE_CALL", one_call)
    ix, keys, victims, more = segment_in_full_arena(8, state=512, states=31)  # states: full
    r = ix.records
    assert [r.p_stride[p] for p in victims[:3]] == [512, 256, 256]
    rc = ix.reclaimer
    rc.pressed.add(512)
    ix.policy.split_ok = True
    if queued:  # the rest of an older set, queued: state-less keys of another chain
        rc.defer([e.rec for e in more])
    assert ix.alloc.free_slots(512) == 0
    assert rc.evict_victims(victims, 512, 2) == 2  # the state and its key's KV page
    assert ix.alloc.free_slots(512) == 1
    assert [p for p, _, _ in reversed(rc._queue)][-len(victims) + 2:] == victims[2:]
    assert rc.take(512, 2) == 0  # no state among the rest: the next one names its own set


@pytest.mark.parametrize("one_call", [False, True])
def test_a_split_set_goes_on_for_the_keys_asked_only_when_nothing_is_queued_before_it(
        monkeypatch, one_call):
    """Key by key, the rest of a split set goes after what is queued, so the next keys'
    reservations take the queued pages first: a set split for three KV slots goes on past the
    first key only when nothing is queued."""
    from hicached.daemon import reclaim

    monkeypatch.setattr(reclaim, "ONE_CALL", one_call)
    for queued in (False, True):
        ix, keys, victims, more = segment_in_full_arena(4)
        rc = ix.reclaimer
        if queued:
            rc.defer([e.rec for e in more])
        rc.pressed.add(256)
        ix.policy.split_ok = True
        went = rc.evict_victims(victims, 256, 3)
        assert rc.take(256, 3) == 3 - went
        assert ix.alloc.free_slots(256) == 3
        assert went == (1 if queued else 3)  # the leaf's key (one slot), then the rest
        kept = [k for k in keys if ix.get(KV, k) is not None]
        assert kept == keys[:-1 if queued else -3]
        assert [ix.get(OTHER, f"o{i:03d}") is None for i in range(3)] == (
            [True, True, False] if queued else [False] * 3)  # the queued pages first
