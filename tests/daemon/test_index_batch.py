"""The index's per-call paths (``hicached/daemon/commits.py``, ``reserving.py``, the pages
``evict.py`` takes in one pass) leave exactly the state of their scalar twins called page by page
(``one_by_one``: under ``prefix`` / ``hybrid`` a call whose class is short evicts its keys' victims
first, set by set): records, slots, generations, recency, slab ages, the presence table's bytes
and every policy's own state, under both policies, with evictions, keys of several pools and
kinds, chains and states; so does the controller's set path (``set_control.py``) with them. And
the batch calls under them (``alloc_many``, ``FpTable.put_many``, ``PresenceTable.set_many``)
against their one-by-one twins."""

import random

import numpy as np
import pytest

from hicached import protocol as P
from hicached.daemon import commits, evict, reserving
from hicached.daemon.reserving import BATCH_MIN
from hicached.daemon.controller import Controller
from hicached.daemon.eviction.hybrid import GRACE_TICKS
from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.fptable import FpTable
from hicached.daemon.index import KEY_BYTES, PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.leases import LeaseTable
from hicached.daemon.quotas import NamespaceQuotas
from hicached.daemon.sessions import Session, namespace_digest
from hicached.daemon.slabs import SlabAllocator
from hicached.presence import TABLE_WORD, PresenceTable

KV, MAMBA, OTHER = ("ns", "kv"), ("ns", "mamba"), ("other", "kv")


def snapshot(ix: PageIndex, shared: PresenceTable | None) -> dict:
    """Everything the index, its allocator, its policy and the presence table hold."""
    a, pol = ix.alloc, ix.policy
    r = ix.records
    out = {name: arr.tolist() for name, arr in r.np.items()}
    out.update(
        p_top=r.page_top, k_top=r.key_top, p_free=list(r.page_free), k_free=list(r.key_free),
        gen=r.gen, tick=r.tick, tcount=list(r.tcount), committed=ix.committed_count,
        evictions=ix.evictions, ns_bytes=dict(ix.ns_bytes), owners=sorted(r.owners.items()),
        long_keys=dict(r.long_keys),
        pending={t: [(k, e.rec, e.gen, e.slot_offset) for k, e in d.items()]
                 for t, d in ix.pending.items()},
        slots={i: list(s) for i, s in r.slot_recs.items()},
        keys=[dict(zip(*(x.tolist() for x in k.table.items()), strict=True)) for k in r.key_tables],
        slabs=[(s.stride, list(s.free), s.in_partial, s.pinned, s.last_used) for s in a.slabs],
        partial={st: [s.index for s in ss] for st, ss in a._partial.items()},
        by_age={st: [s.index for s in ss] for st, ss in a._by_age.items()},
        free_slabs=list(a._free_slabs),
        lru=(list(pol.lru._prev), list(pol.lru._next),
             {st: list(ends) for st, ends in pol.lru._ends.items()}),  # (ends: lists changed in place)
        shared=shared._w[TABLE_WORD:].tobytes() if shared is not None else None,
        shared_entries=shared.entries if shared is not None else None)
    if hasattr(pol, "_heaps"):
        out.update(heaps={s: list(h) for s, h in pol._heaps.items()},
                   mids={s: list(h) for s, h in pol._mids.items()}, queued=list(pol._queued),
                   tails=live_tails(ix), held=sorted(set(pol._held)),
                   class_ns={s: sorted(n) for s, n in pol._class_ns.items()},
                   tree=[list(getattr(pol.tree, n)) for n in ("up", "kid", "sib", "psib",
                                                              "kflags")])
    return out


def one_by_one(ix: PageIndex, table, keys: list[str], page_bytes: int, stride: int) -> list:
    """The reference ``reserve_many`` is held to: under a policy whose victims free runs of slots
    (``prefix`` / ``hybrid``), a call whose class is short first evicts what its keys need, one
    victim set at a time (``make_room``, each set evicted before the next is named; with trailing
    pools, in a daemon, the rest of a split segment first), then reserves its keys one by one;
    under LRU each key evicts its own victim as it comes."""
    pol, free_slots, rc = ix.policy, ix.alloc.free_slots, ix.reclaimer
    if pol.frees_runs and free_slots(stride) < len(keys):
        rc.pressed.add(stride)
        trailing = ix.trailing(table[0])
        while free_slots(stride) < len(keys):
            if trailing and rc.tails and rc.take(stride, len(keys)):
                continue
            victims = pol.make_room(stride)
            if not victims or not rc.evict_victims(victims, stride, len(keys)):
                break
    return [ix.reserve(table, k, page_bytes, stride) for k in keys]


def live_tails(ix: PageIndex) -> list[int]:
    """The key records the hybrid policy's tails hold that ``stale`` may take: live,
    state-less leaves of a namespace with trailing pools. (Page by page, a leaf's KV page
    queues a tail before the call's state of its key comes; ``commit_many`` judges the key on
    the call's final state: the entries that differ are ones ``stale`` skips, or duplicates.)"""
    pol = ix.policy
    return sorted({k for _, k in pol._tails if ix.records.k_len[k] and not pol.tree.kid[k]
                   and ix.records.ns_trail[ix.records.k_ns[k]]
                   and not pol.tree.has_state(k, ix.records.ns_trail[ix.records.k_ns[k]])})


def odd_key(rng: random.Random, i: int) -> str:
    return rng.choice([f"k{i}", "long-" + "x" * KEY_BYTES + str(i), f"clé-{i}"])


class Plan:
    """A seeded sequence of calls, replayed on two indexes: one page by page, one by call."""

    def __init__(self, seed: int, calls: int = 40, sizes=(1, 5, BATCH_MIN - 1, BATCH_MIN, 40, 70,
                                                              130), slab: int = 4096):
        self.slab = slab
        self.state_bytes = 512  # (a state's page)
        rng = random.Random(seed)
        self.calls = []
        fresh = iter(range(10**9))
        stored: list[str] = []
        for _ in range(calls):
            n = rng.choice(sizes)
            kind = rng.random()
            if kind < 0.1:  # keys of other kinds: one by one on both sides
                keys = [odd_key(rng, next(fresh)) for _ in range(n)]
            else:
                keys = [f"{rng.getrandbits(256):064x}" for _ in range(n)]
            if stored and rng.random() < 0.5:  # keys another pool holds, or this one
                keys[:n // 2] = rng.sample(stored, min(n // 2, len(stored)))
                keys = list(dict.fromkeys(keys))
            table = rng.choice([KV, KV, MAMBA, OTHER])  # (mamba: keys kv holds, often)
            states = [k for k in keys if rng.random() < 0.1] if table == KV else []
            stored += keys
            touch = rng.sample(stored, min(len(stored), rng.choice([3, 40, 90])))
            self.calls.append((table, keys, states, touch, rng.random() < 0.5))


def replay(plan: Plan, many: bool, policy: str, tmp_path, busy: bool = False) -> list[dict]:
    """The plan's calls, by call (``many``) or page by page; ``busy``: the index of a daemon
    (its reclaimer told whether a request waits: a reservation splits a leaf segment and
    defers its rest)."""
    shared = PresenceTable(str(tmp_path / f"p{many}"), 4096, 1, arena_bytes=24 * plan.slab,
                           grain=512)  # a state's slot is tagged
    ix = PageIndex(SlabAllocator(24 * plan.slab, plan.slab), policy=make_policy(policy),
                   presence=shared, busy=(lambda: False) if busy else None)
    ix.records.gen = 0  # slot generations start at random
    if not many:
        ix.evictor.batch_min = 1 << 30  # evictions page by page too (``Evictor``)
    else:
        real = ix.evictor._unpublish_many
        plan.passes = 0

        def counted(live):
            plan.passes += 1
            real(live)

        ix.evictor._unpublish_many = counted
    states_seen = []
    for table, keys, states, touch, link in plan.calls:
        live = [k for k in keys if ix.get(table, k) is None and ix.get_pending(table, k) is None]
        size = plan.state_bytes if table == MAMBA else 256
        if table == MAMBA:
            ix.mark_trailing(MAMBA)
        if many:
            entries = ix.reserve_many(table, live, size, size, owner=7)
        else:
            entries = one_by_one(ix, table, live, size, size)
            for e in entries:
                if e is not None:
                    e.owner = 7
        if states:
            ix.mark_trailing(MAMBA)
            for k in states:
                if ix.get(MAMBA, k) is None and ix.get_pending(MAMBA, k) is None:
                    entries.append(ix.reserve(MAMBA, k, plan.state_bytes, plan.state_bytes))
        if link:
            ix.link(table[0], keys, None, 0)
        done = [e for e in entries if e is not None]
        (ix.commit_many if many else ix.commits._commit_each)(done)
        found = [e for e in ix.get_many(KV, touch) if e is not None]
        if many and link:  # a get's pages in one pass
            ix.read_many(found)
            ix.unpin_many(found)
        elif many:
            ix.touch_many(found)
            ix.pin_many(found)
            ix.count_hits(found)
            ix.unpin_many(found)
        else:
            for e in found:
                ix.touch(e)
            for e in found:
                ix.pin(e)
                e.hits += 1
                ix.unpin(e)
        states_seen.append(snapshot(ix, shared))
    shared.close()
    assert ix.evictions and len(ix) > 0  # the plan did evict, and keeps pages
    return states_seen


@pytest.mark.parametrize("policy", ["lru", "hybrid", "prefix"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_calls_leave_exactly_the_state_of_pages_one_by_one(tmp_path, policy, seed):
    plan = Plan(seed)
    single, batched = replay(plan, False, policy, tmp_path), replay(plan, True, policy, tmp_path)
    for i, (a, b) in enumerate(zip(single, batched, strict=True)):
        diff = [k for k in a if a[k] != b[k]]
        assert not diff, (i, diff)
    if policy != "lru":
        assert plan.passes  # victim sets taken in one pass (``Evictor._unpublish_many``)


@pytest.mark.parametrize("policy", ["lru", "hybrid", "prefix"])
def test_a_full_class_reserves_the_slots_each_victim_frees_together_as_one_by_one(
        tmp_path, policy, monkeypatch):
    """Long chains on slabs of 64 KV pages: a call finds its class full, and under ``prefix``
    and ``hybrid`` a victim (a leaf segment) frees tens of slots, which the next keys take in
    one pass (``_reserve_run`` after an eviction); the state is still exactly that of one by
    one."""
    runs, real = [], reserving.Reservations._reserve_run

    def counted(self, table, tid, keys, mine, fps, recs, *rest):
        runs.append((len(keys), recs is None))
        return real(self, table, tid, keys, mine, fps, recs, *rest)

    monkeypatch.setattr(reserving.Reservations, "_reserve_run", counted)
    plan = Plan(7, calls=0, slab=16384)
    rng = random.Random(7)
    stored: list[str] = []
    for i in range(30):  # chains of fresh keys, a state at each chain's end, reads between
        keys = [f"{i:04d}{j:060x}" for j in range(rng.choice([40, 70, 130, 200]))]
        stored += keys
        plan.calls.append((KV, keys, [keys[-1]], rng.sample(stored, 40), True))
    single, batched = replay(plan, False, policy, tmp_path), replay(plan, True, policy, tmp_path)
    for i, (a, b) in enumerate(zip(single, batched, strict=True)):
        diff = [k for k in a if a[k] != b[k]]
        assert not diff, (i, diff)
    after = [n for n, evicted in runs if evicted]
    if policy != "lru":  # (LRU: only when it reclaims another class's slab)
        assert len(after) >= 2 and max(after) >= BATCH_MIN


@pytest.mark.parametrize("policy", ["hybrid", "prefix"])
def test_chains_with_no_state_name_many_victim_sets_a_policy_call_as_set_by_set(
        tmp_path, policy, monkeypatch):
    """Chains of a namespace with no trailing pool (attention-only): a call whose class is full
    gets several victim sets from one ``make_room_many`` (the ranked candidates, and the key
    above a leaf once it goes), and the index ends exactly as after ``one_by_one``, where the
    policy names one set at a time, each evicted before the next is named."""
    from hicached.daemon.eviction.hybrid import HybridPolicy
    sets, real = [], HybridPolicy.make_room_many

    def counted(self, stride, need):
        out = real(self, stride, need)
        sets.append(len({self.ix.p_krec[p] for p in out}))
        return out

    monkeypatch.setattr(HybridPolicy, "make_room_many", counted)
    plan = Plan(9, calls=0, slab=16384)
    rng = random.Random(9)
    stored: list[str] = []
    for i in range(40):  # chains of fresh keys, some continuing a stored prefix, reads between
        keys = [f"{i:04d}{j:060x}" for j in range(rng.choice([20, 40, 70, 130]))]
        stored += keys
        plan.calls.append((OTHER, keys, [], rng.sample(stored, 40), True))
    single, batched = replay(plan, False, policy, tmp_path), replay(plan, True, policy, tmp_path)
    for i, (a, b) in enumerate(zip(single, batched, strict=True)):
        diff = [k for k in a if a[k] != b[k]]
        assert not diff, (i, diff)
    assert sets and max(sets) >= 8  # (single: ``one_by_one`` never calls it)


def test_a_call_that_evicts_first_looks_its_keys_up_again(monkeypatch):
    """``fps`` / ``recs`` from a lookup before the call, of keys another pool holds: evicting
    first frees those keys' records (their pages in the other pool were the victims), so the
    run looks its keys up again (not the records the stale lookup names, which would make it
    fall back to one by one); every page is its key's."""
    runs, real = [], reserving.Reservations._reserve_run

    def counted(self, *args):
        got = real(self, *args)
        runs.append(None if got is None else len(got))
        return got

    monkeypatch.setattr(reserving.Reservations, "_reserve_run", counted)
    idx, kv = ("ns", "idx"), ("ns", "kv")
    ix = PageIndex(SlabAllocator(2 * 4096, 4096), policy=make_policy("hybrid"))
    olds = [f"a{i:063x}" for i in range(32)]  # the class's 32 slots, another pool's pages
    ix.commit_many([ix.reserve(idx, k, 256, 256) for k in olds])
    ix.records.table_id(kv)  # (a pool the index knows: ``lookup`` answers at once)
    keys = olds[:16] + [f"b{i:063x}" for i in range(16)]
    _, fps, recs = ix.lookup(kv, keys)
    assert (recs[:16] >= 0).all()  # looked up while the idx pool held them
    got = ix.reserve_many(kv, keys, 256, 256, 0, fps, recs)
    r = ix.records
    assert ix.evictions == 32 and all(e is not None for e in got) and runs == [32]
    assert [r.key_of(r.p_krec[e.rec]) for e in got] == keys
    assert len({r.p_krec[e.rec] for e in got}) == len(keys)
    assert all(ix.get_pending(kv, k) is e for k, e in zip(keys, got))


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_a_full_class_with_pages_pinned_refuses_keys_as_one_by_one(policy):
    """Half the arena's pages pinned (read now): the keys past the room the other half gives get
    no slot, and the index is left as reserving them one by one leaves it."""
    states = []
    for many in (False, True):
        ix = PageIndex(SlabAllocator(4 * 16384, 16384), policy=make_policy(policy))
        ix.records.gen = 0
        ix.mark_trailing(MAMBA)
        first = [f"a{i:063x}" for i in range(256)]
        done = [ix.reserve(KV, k, 256, 256) for k in first]
        ix.link("ns", first, None, 0)
        ix.commit_many(done)
        for e in done[:128]:
            ix.pin(e)
        keys = [f"b{i:063x}" for i in range(200)]
        got = (ix.reserve_many(KV, keys, 256, 256) if many
               else one_by_one(ix, KV, keys, 256, 256))
        assert sum(e is not None for e in got) == 128 and got[-1] is None
        states.append((snapshot(ix, None), [e is None for e in got]))
    assert states[0] == states[1]


def test_a_state_committed_with_its_kv_page_queues_no_tail(tmp_path):
    """A leaf key's KV page and state in one commit: page by page the KV page queued a tail
    (the key was state-less then) that ``stale`` skips; ``commit_many`` judges the key on the
    call's final state and queues none. Everything else is the same."""
    states, tails = [], []
    for many in (False, True):
        ix = PageIndex(SlabAllocator(8 * 4096, 4096), policy=make_policy("hybrid"))
        ix.records.gen = 0
        ix.mark_trailing(MAMBA)
        keys = [f"{i:064x}" for i in range(BATCH_MIN + 3)]
        entries = [ix.reserve(KV, k, 256, 256) for k in keys]
        entries += [ix.reserve(MAMBA, keys[-1], 512, 512)]
        ix.link("ns", keys, None, 0)
        (ix.commit_many if many else ix.commits._commit_each)(entries)
        states.append(snapshot(ix, None))
        tails.append(list(ix.policy._tails))
        ix.records.tick += 2 * GRACE_TICKS
        assert ix.policy.stale() == []  # the leaf has its state
    assert states[0] == states[1]
    assert len(tails[0]) == 1 and tails[1] == [] and states[0]["tails"] == []


def test_alloc_many_gives_the_slots_of_alloc_one_by_one():
    rng = random.Random(5)
    allocs = [SlabAllocator(6 * 1024, 1024) for _ in range(2)]
    for step in range(60):
        stride, n = rng.choice([128, 256, 512]), rng.randrange(1, 20)
        got = [off for slab, slots in allocs[1].alloc_many(stride, n)
               for off in (slab.offset + i * stride for i in slots)]
        want = []
        for _ in range(n):
            off = allocs[0].alloc(stride)
            if off is None:
                break
            want.append(off)
        assert got == want, step
        for off in rng.sample(want, len(want) // 2):  # free some: partial slabs, in turns
            for a in allocs:
                a.free(off)
        assert ([(s.stride, list(s.free), s.in_partial) for s in allocs[0].slabs]
                == [(s.stride, list(s.free), s.in_partial) for s in allocs[1].slabs])
        assert allocs[0]._free_slabs == allocs[1]._free_slabs


def test_put_many_holds_what_puts_hold():
    rng = random.Random(2)
    one, many = FpTable(8), FpTable(8)
    ref = {}
    for _ in range(40):
        fps = list({rng.getrandbits(64) | 1 for _ in range(rng.randrange(1, 300))} - set(ref))
        values = [rng.randrange(1 << 40) for _ in fps]
        for fp, v in zip(fps, values, strict=True):
            one.put(fp, v)
            ref[fp] = v
        many.put_many(np.array(fps, np.uint64), np.array(values, np.int64))
        for fp in rng.sample(list(ref), len(ref) // 4):  # removals: probe runs shift back
            assert one.remove(fp) == many.remove(fp) == ref.pop(fp)
        assert len(one) == len(many) == len(ref) and one.capacity == many.capacity
        probe = list(ref) + [rng.getrandbits(64) | 1 for _ in range(50)]
        assert many.get_many(np.array(probe, np.uint64)).tolist() == [ref.get(p, -1)
                                                                       for p in probe]


@pytest.mark.parametrize("slots", [64, 4096])
def test_set_many_leaves_the_bytes_of_sets(tmp_path, slots):
    rng = random.Random(slots)
    tables = [PresenceTable(str(tmp_path / f"t{i}"), slots, 1) for i in range(2)]
    known = []
    for _ in range(30):  # new keys, and new masks of known ones, till the table fills (64)
        fps = list(dict.fromkeys([rng.getrandbits(64) | 2 for _ in range(rng.randrange(1, 40))]
                                 + rng.sample(known, min(len(known), 5))))
        masks = [rng.randrange(1, 1 << 20) for _ in fps]
        for fp, mask in zip(fps, masks, strict=True):
            tables[0].set(fp, mask)
        tables[1].set_many(np.array(fps, np.uint64), np.array(masks, np.int64))
        known += fps
        for fp in rng.sample(known, len(known) // 5):
            for t in tables:
                t.remove(fp)
        assert tables[0]._w[TABLE_WORD:].tobytes() == tables[1]._w[TABLE_WORD:].tobytes()
        assert (tables[0].entries, tables[0].flags) == (tables[1].entries, tables[1].flags)
    assert tables[0].overflowed == (slots == 64)
    for t in tables:
        t.close()


# ---------------------------------------------------------------- through the controller


def controller_run(monkeypatch, tmp_path, batched: bool, policy: str) -> tuple[list, dict]:
    """A seeded run of Reserve / Commit calls through ``Controller`` (new keys, keys present,
    in flight, twice in a call, set-ahead slots, a second pool of states, a quota, evictions);
    with ``batched`` False every call goes page by page. The answers and the final state."""
    if not batched:
        monkeypatch.setattr(commits, "BATCH_MIN", 1 << 30)
        monkeypatch.setattr(reserving, "BATCH_MIN", 1 << 30)
        monkeypatch.setattr(evict, "BATCH_MIN", 1 << 30)
    shared = PresenceTable(str(tmp_path / f"c{batched}"), 2048, 1)
    ix = PageIndex(SlabAllocator(40 * 4096, 4096), policy=make_policy(policy), presence=shared)
    ix.records.gen = 0
    workers = IOWorkers()
    ctl = Controller(ix, LeaseTable(ix, 60.0, 60.0), L3Tier(ix, workers), lambda: 0.0,
                     quotas=NamespaceQuotas(ix, {"b": 90 * 256}),
                     ahead_session_bytes=8 * 256, ahead_total_bytes=1 << 20)
    sessions = [Session(i + 1, name, namespace_digest(name), 1, name)
                for i, name in enumerate(("a", "b"))]
    for s in sessions:
        ctl.sessions[s.id] = s
        ctl.register_pool(s, "kv", 256)
        ctl.register_pool(s, "mamba", 512)
    rng = random.Random(11)
    stored: list[str] = []
    answers, open_ = [], []
    for step in range(60):
        s = rng.choice(sessions)
        n = rng.choice([3, 40, 70, 150])
        keys = [f"{rng.getrandbits(256):064x}" for _ in range(n)]
        if stored and rng.random() < 0.5:
            at = rng.randrange(n)
            keys[at:at] = rng.sample(stored, min(10, len(stored)))  # present or in flight
        if rng.random() < 0.2:
            keys.insert(rng.randrange(len(keys)), keys[0])  # a key twice
        transfers = [P.PoolKeys("kv", keys)]
        if rng.random() < 0.3:
            transfers.append(P.PoolKeys("mamba", keys[-1:]))
        held = ctl.leases.ahead.get(s.id)
        ahead = []
        if held is not None and rng.random() < 0.5:  # name some granted slots
            slots = list(held.pools.get("kv", {}))
            ahead = [[slots.pop() if slots and rng.random() < 0.2 else -1 for _ in keys]]
        msg = P.Reserve(step, s.id, transfers, ahead=ahead, want_ahead=[rng.choice([0, 4])],
                        trailing=["mamba"], parent="", depth=0 if rng.random() < 0.5 else -1)
        r = ctl.sets.reserve(s, msg)
        answers.append((r.reservation_id != 0, r.offsets, r.tags, r.ahead, r.bound))
        stored += keys
        if r.reservation_id:
            open_.append((s, r))
        while open_ and (len(open_) > 2 or rng.random() < 0.6):  # commit, some pages failed
            s2, r2 = open_.pop(rng.randrange(len(open_)))
            ok = [[off >= 0 and rng.random() < 0.95 for off in row] for row in r2.offsets]
            c = ctl.sets.commit(s2, P.Commit(0, s2.id, r2.reservation_id, ok))
            answers.append(c.stored)
    state = snapshot(ix, shared)
    state["counters"] = dict(ctl.counters)
    workers.close()
    shared.close()
    assert ix.evictions
    return answers, state


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_the_controller_answers_and_leaves_what_it_did_page_by_page(monkeypatch, tmp_path,
                                                                   policy):
    with monkeypatch.context() as m:
        single = controller_run(m, tmp_path, False, policy)
    batched = controller_run(monkeypatch, tmp_path, True, policy)
    assert single[0] == batched[0]
    diff = [k for k in single[1] if single[1][k] != batched[1][k]]
    assert not diff, diff
    reserved = [a for a in single[0] if isinstance(a, tuple)]
    offsets = [off for a in reserved for row in a[1] for off in row]
    for answer in (P.SLOT_PRESENT, P.SLOT_INFLIGHT, P.SLOT_NO_SPACE):  # every kind of key
        assert answer in offsets
    assert any(b for a in reserved for row in a[4] for b in row)  # a set-ahead slot bound
