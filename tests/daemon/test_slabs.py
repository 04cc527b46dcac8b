"""Slab allocator: exact offsets, class isolation, slab recycling."""

import pytest

from hicached.daemon.slabs import SlabAllocator, stride_for
from hicached.errors import ArenaError


def test_stride_rounds_to_64():
    assert stride_for(64) == 64
    assert stride_for(65) == 128
    assert stride_for(1000) == 1024


def test_consecutive_slots_in_a_fresh_slab():
    a = SlabAllocator(4096, 1024)
    assert [a.alloc(256) for _ in range(5)] == [0, 256, 512, 768, 1024]
    assert a.free_slab_count == 2


def test_classes_take_separate_slabs():
    a = SlabAllocator(4096, 1024)
    assert a.alloc(256) == 0
    assert a.alloc(512) == 1024
    assert a.alloc(256) == 256
    assert a.alloc(512) == 1536


def test_full_returns_none_and_free_recycles_slab():
    a = SlabAllocator(2048, 1024)
    offs = [a.alloc(512) for _ in range(4)]
    assert offs == [0, 512, 1024, 1536]
    assert a.alloc(512) is None
    assert a.alloc(256) is None
    a.free(1024)
    a.free(1536)
    assert a.free_slab_count == 1
    assert a.alloc(256) == 1024  # the emptied slab now serves another class
    assert a.used_bytes() == 512 * 2 + 256


def test_bad_free_and_page_too_big():
    a = SlabAllocator(2048, 1024)
    a.alloc(512)
    with pytest.raises(ArenaError):
        a.free(100)
    with pytest.raises(ArenaError, match="does not fit a slab"):
        a.check_page_bytes(2000)
    with pytest.raises(ArenaError):
        SlabAllocator(100, 1024)


def test_oldest_unpinned_slab_of_another_class_by_last_touch():
    a = SlabAllocator(8 * 1024, 1024)  # 8 slabs
    s256 = [a.alloc(256) for _ in range(4 * 4)]  # slabs 0-3, class 256
    s512 = [a.alloc(512) for _ in range(2 * 2)]  # slabs 4-5, class 512
    assert a.oldest_unpinned(512).index == 0  # never touched since given: in order given
    for tick, off in enumerate([s256[4], s256[0], s256[12], s256[8]], start=1):
        a.touch(off, tick)  # slabs 1, 0, 3, 2 in that order
    assert a.oldest_unpinned(512).index == 1
    a.slab_of(s256[4]).pinned = 1  # slab 1 holds a leased page: never reclaimed
    assert a.oldest_unpinned(512).index == 0
    a.touch(s512[0], 5)
    assert a.oldest_unpinned(256).index == 5  # slab 4 was touched, slab 5 not
    assert a.oldest_unpinned(999).index == 5  # the oldest of every other class
    for off in s512[2:]:
        a.free(off)  # slab 5 empties: back to the free list, no class's any more
    assert a.oldest_unpinned(256).index == 4
    for off in s512[:2]:
        a.free(off)
    assert a.oldest_unpinned(256) is None
