"""PageIndex: visibility, pins, exact LRU eviction order, cross-class slab reclaim."""

import random

import pytest

from hicached.daemon.index import MAX_POOLS, PageIndex
from hicached.daemon.slabs import SlabAllocator
from hicached.presence import TABLE_WORD, PresenceTable

T = ("ns", "kv")
M = ("ns", "mamba")


def make(arena=2048, slab=1024):
    return PageIndex(SlabAllocator(arena, slab))


def test_pending_is_invisible_until_commit():
    ix = make()
    e = ix.reserve(T, "a", 256, 256)
    assert ix.get(T, "a") is None and ix.get_pending(T, "a") is e
    ix.commit(e)
    assert ix.get(T, "a") == e and ix.get_pending(T, "a") is None
    assert e.pins == 0


def test_abort_frees_slot():
    ix = make()
    e = ix.reserve(T, "a", 256, 256)
    ix.abort(e)
    assert ix.get_pending(T, "a") is None
    assert ix.alloc.used_bytes() == 0


def test_lru_eviction_order_and_pins():
    ix = make(arena=1024, slab=1024)  # 4 slots of 256
    es = []
    for k in "abcd":
        e = ix.reserve(T, k, 256, 256)
        ix.commit(e)
        es.append(e)
    ix.touch(es[0])  # a becomes newest: order b c d a
    ix.pin(es[1])  # b is leased
    c_offset = es[2].offset
    e = ix.reserve(T, "e", 256, 256)
    assert e.offset == c_offset  # c was the oldest unpinned
    assert es[2].offset == -1 and not es[2].committed
    assert ix.get(T, "c") is None and ix.get(T, "b") is not None
    ix.commit(e)
    assert [x.key for x in ix.lru_order(256)] == ["b", "d", "a", "e"]
    assert ix.evictions == 1


def test_everything_pinned_means_no_space():
    ix = make(arena=1024, slab=1024)
    for k in "abcd":
        ix.reserve(T, k, 256, 256)  # pending = pinned
    assert ix.reserve(T, "e", 256, 256) is None


def test_other_class_slab_reclaimed_when_older():
    ix = make(arena=2048, slab=1024)
    old = [ix.reserve(M, k, 512, 512) for k in "xy"]  # slab 0, class 512
    for e in old:
        ix.commit(e)
    new = [ix.reserve(T, k, 256, 256) for k in "abcd"]  # slab 1, class 256
    for e in new:
        ix.commit(e)
    # class 256 is full; its oldest page is newer than the whole 512 slab -> reclaim that slab
    e = ix.reserve(T, "e", 256, 256)
    assert e.offset == 0
    assert ix.get(M, "x") is None and ix.get(M, "y") is None
    assert all(ix.get(T, k) is not None for k in "abcd")
    assert ix.evictions == 2


def test_same_class_page_evicted_when_other_slab_is_newer():
    ix = make(arena=2048, slab=1024)
    for k in "abcd":
        ix.commit(ix.reserve(T, k, 256, 256))
    for k in "xy":
        ix.commit(ix.reserve(M, k, 512, 512))
    e = ix.reserve(T, "e", 256, 256)
    assert ix.get(T, "a") is None  # oldest of its own class
    assert ix.get(M, "x") is not None
    assert e.offset == 0


def test_drop_skips_pinned():
    ix = make()
    a, b = ix.reserve(T, "a", 256, 256), ix.reserve(T, "b", 256, 256)
    ix.commit(a)
    ix.commit(b)
    ix.pin(a)
    assert ix.drop(list(ix.table(T).values())) == 1
    assert ix.get(T, "a") == a and ix.get(T, "b") is None


# ---------------------------------------------------------------- presence masks


def expected_presence(ix, ns, keys):
    """What ``presence`` must say, rebuilt from the committed tables."""
    return [sum(bit for pool, bit in ix.records.pool_bits.get(ns, {}).items()
                if ix.get((ns, pool), k) is not None) for k in keys]


def test_presence_follows_commit_abort_evict_and_drop():
    ix = make(arena=1024, slab=1024)  # 4 slots of 256
    kv, mb = ix.pool_bit(T), ix.pool_bit(M)
    assert kv != mb and ix.pool_bit(T) == kv
    a, b = ix.reserve(T, "a", 256, 256), ix.reserve(M, "a", 256, 256)
    assert ix.presence("ns", ["a"]).tolist() == [0]  # pending pages are invisible
    ix.commit(a)
    assert ix.presence("ns", ["a"]).tolist() == [kv]
    ix.commit(b)
    c = ix.reserve(T, "c", 256, 256)
    ix.abort(c)
    assert ix.presence("ns", ["a", "c", "zz"]).tolist() == [kv | mb, 0, 0]
    assert ix.presence("other", ["a"]).tolist() == [0]  # another namespace sees nothing
    ix.commit(ix.reserve(T, "b", 256, 256))
    ix.commit(ix.reserve(T, "d", 256, 256))
    ix.reserve(T, "e", 256, 256)  # full: evicts the oldest unpinned page, kv "a"
    assert ix.get(T, "a") is None
    assert ix.presence("ns", ["a", "b"]).tolist() == [mb, kv]
    ix.pin(ix.get(T, "b"))
    assert ix.drop([ix.get(M, "a"), ix.get(T, "b"), ix.get(T, "d")]) == 2  # b is pinned
    assert ix.presence("ns", ["a", "b", "d"]).tolist() == [0, kv, 0]
    assert ix.chain("ns", "a") == (None, -1)  # no key record kept for a key L2 lacks


def test_presence_random_operations_match_the_tables():
    rng = random.Random(7)
    ix = make(arena=4096, slab=1024)  # 16 slots of 256: eviction happens often
    tables = [(ns, pool) for ns in ("n1", "n2") for pool in ("kv", "mamba", "indexer")]
    keys = [f"k{i}" for i in range(12)]
    pending = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            table, key = rng.choice(tables), rng.choice(keys)
            if ix.get(table, key) is None and ix.get_pending(table, key) is None:
                e = ix.reserve(table, key, 256, 256)
                if e is not None:
                    pending.append(e)
        elif op < 0.8 and pending:
            e = pending.pop(rng.randrange(len(pending)))
            (ix.commit if rng.random() < 0.8 else ix.abort)(e)
        elif op < 0.9:
            table = rng.choice(tables)
            ix.drop(rng.sample(list(ix.table(table).values()), len(ix.table(table)) // 2))
        else:
            lru = [e for e in ix.lru_order(256) if e.pins == 0]
            if lru:
                ix.evict(rng.choice(lru))
        for ns in ("n1", "n2"):
            assert ix.presence(ns, keys).tolist() == expected_presence(ix, ns, keys)


def test_pool_bits_are_limited_per_namespace():
    ix = make()
    bits = {ix.pool_bit(("ns", f"p{i}")) for i in range(MAX_POOLS)}
    assert len(bits) == MAX_POOLS and max(bits) < 2**63  # all fit an int64 mask
    with pytest.raises(ValueError, match="at most"):
        ix.reserve(("ns", "one-too-many"), "a", 256, 256)
    assert ix.alloc.used_bytes() == 0 and not ix.pending  # nothing was reserved
    assert ix.pool_bit(("other", "p0")) == 1  # each namespace has its own bits


def test_entries_that_survive_a_full_collection_are_frozen_out_of_later_ones():
    """The daemon's gc callback: a full pass leaves its survivors (the index's entries) to the
    permanent generation, so later full passes do not walk every page again."""
    import gc

    from hicached.daemon.loop_gc import freeze_survivors

    ix = make()
    for i in range(8):
        ix.commit(ix.reserve(T, f"k{i}", 256, 256))
    gc.unfreeze()
    try:
        gc.collect()
        freeze_survivors("stop", {"generation": 1})
        assert gc.get_freeze_count() == 0  # a young pass freezes nothing
        freeze_survivors("stop", {"generation": 2})
        frozen = gc.get_freeze_count()
        assert frozen > 0  # records are arrays now: few objects, whatever survives is frozen
        ix.drop(list(ix.tables[T].values()))  # frozen entries still come and go
        ix.commit(ix.reserve(T, "new", 256, 256))
        assert ix.get(T, "new") is not None and ix.get(T, "k0") is None
    finally:
        gc.unfreeze()


def _state(ix, shared):
    """Everything commit changes, comparable across two indexes built alike."""
    return (
        {t: sorted((k, e.offset, e.gen, e.last_used, e.pins) for k, e in d.items())
         for t, d in ix.tables.items()},
        {t: sorted(d) for t, d in ix.pending.items()},
        {s: [(e.table, e.key) for e in ix.lru_order(s)] for s in ix.policy.strides()},
        {ns: ix.presence(ns, [f"k{i}" for i in range(200)]).tolist() for ns in ("ns", "other")},
        ix.records.tick,
        [(s.index, s.pinned, s.last_used) for s in ix.alloc.slabs],
        {s: [x.index for x in o] for s, o in ix.alloc._by_age.items()},
        shared._w[TABLE_WORD:].tobytes() if shared is not None else None,  # slots and tags
    )


@pytest.mark.parametrize("with_table", [False, True])
def test_commit_many_leaves_exactly_the_state_of_single_commits(tmp_path, with_table):

    rng = random.Random(7)
    plan = []  # (table, key, stride): three pools, two page sizes, keys shared between pools
    for i in range(300):
        table = rng.choice([T, M, ("other", "kv")])
        plan.append((table, f"k{rng.randrange(200)}", 256 if table != M else 512))
    states = []
    for many in (False, True):
        shared = None
        if with_table:  # tags of pages of at least 512 bytes are published too
            shared = PresenceTable(str(tmp_path / f"t{many}"), 1024, 1, arena_bytes=64 * 1024,
                                   grain=512)
        ix = PageIndex(SlabAllocator(64 * 1024, 4096), presence=shared)
        ix.records.gen = 0  # slot generations start at random
        for round_ in range(3):  # later rounds re-commit keys other pools hold, and evict
            entries = []
            for table, key, stride in plan[round_ * 100:(round_ + 1) * 100]:
                if ix.get(table, key) is None and ix.get_pending(table, key) is None:
                    entries.append(ix.reserve(table, key, stride, stride))
            random.Random(round_).shuffle(entries)  # committed out of slot order: slabs of a
            # class are touched in turns
            ix.pin(entries[0])  # one entry is leased as well: still pinned after its commit
            if T in ix.tables:
                ix.touch(next(iter(ix.tables[T].values())))
            if many:
                ix.commit_many(entries)
            else:
                for e in entries:
                    ix.commit(e)
        states.append(_state(ix, shared))
    assert states[0] == states[1]
    assert states[1][0]  # it did commit


def test_commit_many_refuses_an_entry_that_is_not_pending():
    ix = make()
    e = ix.reserve(T, "a", 256, 256)
    ix.commit(e)
    with pytest.raises(AssertionError):
        ix.commit_many([e])


# ------------------------------------------------------------ exact LRU, by hand

N0, N1 = ("n0", "kv"), ("n1", "kv")  # two namespaces, each with a pool


def full_index(keys, evicted=None):
    """An index of one slab of four 256-byte slots, ``keys`` reserved (pending) in ``N0``."""
    ix = PageIndex(
        SlabAllocator(1024, 1024),
        on_evict=None if evicted is None else lambda e: evicted.append(e.key),
    )
    return ix, [ix.reserve(N0, k, 256, 256) for k in keys]


def test_commit_many_order_is_recency_order():
    evicted = []
    ix, (a, b, c, d) = full_index("abcd", evicted)
    ix.commit_many([c, a, d, b])
    assert [e.key for e in ix.lru_order(256)] == list("cadb")
    assert [ix.reserve(N0, k, 256, 256).offset for k in "wxyz"] == [512, 0, 768, 256]
    assert evicted == list("cadb")


def test_touch_moves_to_the_end_and_pinned_pages_are_skipped():
    evicted = []
    ix, (a, b, c, d) = full_index("abcd", evicted)
    ix.commit_many([a, b, c, d])
    ix.touch(ix.get(N0, "a"))
    ix.pin(ix.get(N0, "b"))
    assert [e.key for e in ix.lru_order(256)] == list("bcda")
    e = ix.reserve(N0, "e", 256, 256)
    assert evicted == ["c"] and e.offset == 2 * 256 and ix.get(N0, "c") is None
    ix.commit(e)
    assert [e.key for e in ix.lru_order(256)] == list("bdae")
    ix.unpin(ix.get(N0, "b"))
    assert ix.reserve(N0, "f", 256, 256).offset == 256 and evicted == ["c", "b"]


def test_pending_and_unbound_are_never_evicted():
    evicted = []
    ix, (a, _) = full_index("ab", evicted)
    ix.commit(a)
    u = ix.reserve_unbound("n0", 256)
    ix.pin(ix.get(N0, "a"))
    assert ix.reserve(N0, "c", 256, 256).key == "c"  # the last free slot
    assert ix.reserve(N1, "d", 256, 256) is None and ix.reserve_unbound("n1", 256) is None
    assert evicted == [] and ix.evictions == 0
    assert ix.ns_bytes["n0"] == 4 * 256 and ix.ns_bytes.get("n1", 0) == 0
    u_offset = u.offset
    ix.bind(u, N0, "u", 250)
    ix.commit(ix.get_pending(N0, "u"))
    assert ix.reserve(N1, "d", 256, 256).offset == u_offset and evicted == ["u"]
    assert ix.ns_bytes == {"n0": 3 * 256, "n1": 256}


# ------------------------------------------------------------ a key's pools in the shared table


def test_the_shared_table_never_shows_a_key_with_part_of_a_calls_pools(tmp_path):
    """Clients answer exists from the shared table while the control loop writes it. A commit
    of keys' KV and INDEXER pages (fewer than a batch: page by page) writes each key's mask
    once, with both pools; an eviction (the hybrid policy takes a key's pages together) and a
    flush's drop write it once too, without both: never a key with a KV page and no INDEXER
    page the same call stored (issue 45)."""
    from hicached.daemon.eviction.registry import make_policy
    from hicached.presence import fingerprint

    shared = PresenceTable(str(tmp_path / "t"), 1024, 1)
    ix = PageIndex(SlabAllocator(16 * 1024, 1024), policy=make_policy("hybrid"), presence=shared)
    written = []  # (fp, mask) as the table got them (0: removed)
    set_, remove = shared.set, shared.remove
    shared.set = lambda fp, mask: (written.append((fp, mask)), set_(fp, mask))
    shared.remove = lambda fp: (written.append((fp, 0)), remove(fp))
    keys = ["a0", "a1", "a2"]
    fps = [fingerprint(ix.seed("ns"), k) for k in keys]
    entries = [ix.reserve(T, k, 256, 256) for k in keys]
    entries += [ix.reserve(("ns", "indexer"), k, 64, 64) for k in keys]
    ix.link("ns", keys, None, 0)
    ix.commit_many(entries)
    both = ix.pool_bit(T) | ix.pool_bit(("ns", "indexer"))
    assert sorted(written) == sorted((fp, both) for fp in fps)
    written.clear()
    assert ix.evict(ix.get(T, "a1")) == 4  # a2 (its dependant) and a1, each key's both pages
    assert sorted(written) == sorted((fp, 0) for fp in fps[1:])
    written.clear()
    assert ix.drop_one(ix.get(("ns", "indexer"), "a0")) == 2
    assert written == [(fps[0], 0)] and len(ix) == 0
    shared.close()
