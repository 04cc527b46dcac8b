"""Slab allocator: exact offsets, class isolation, slab recycling."""

import pytest

from hicached.errors import ArenaError
from hicached.slabs import SlabAllocator, stride_for


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
