"""PageIndex: visibility, pins, exact LRU eviction order, cross-class slab reclaim."""

from hicached.index import PageIndex
from hicached.slabs import SlabAllocator

T = ("ns", "kv")
M = ("ns", "mamba")


def make(arena=2048, slab=1024):
    return PageIndex(SlabAllocator(arena, slab))


def test_pending_is_invisible_until_commit():
    ix = make()
    e = ix.reserve(T, "a", 256, 256)
    assert ix.get(T, "a") is None and ix.get_pending(T, "a") is e
    ix.commit(e)
    assert ix.get(T, "a") is e and ix.get_pending(T, "a") is None
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
    assert ix.get(T, "a") is a and ix.get(T, "b") is None
