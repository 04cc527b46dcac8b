"""Slot allocator: fixed-size slabs carved into equal slots, one size class per slot size.

Pools of different models (different page sizes) share one arena. Each slot size gets its own
slabs, so a class never fragments another; a slab whose last slot is freed goes back to the
global free list and any class can take it. Slots of a fresh slab are handed out in ascending
order, so a batch of pages usually lands in consecutive slots (the client coalesces those copies).

    arena   |<----- slab_bytes ----->|<----- slab_bytes ----->| ...
    slab k  | slot 0 | slot 1 | ...  | slot n-1 | (waste < stride)
            ^ offset = k * slab_bytes + i * stride,   stride = round_up(page_bytes, ALIGN)

This module only does bookkeeping; what to evict when ``alloc`` returns None is ``index.py``'s call.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from hicached.errors import ArenaError

ALIGN = 64  # bytes; cache-line aligned slots, and a multiple of every dtype's itemsize


def _nothing(slab_index: int) -> None:
    pass


def stride_for(page_bytes: int) -> int:
    """Slot stride (bytes) for a page of ``page_bytes``."""
    return -(-page_bytes // ALIGN) * ALIGN


class Slab:
    """One slab: its offset, its class (0 while free) and its free slot indices."""

    __slots__ = ("free", "in_partial", "index", "last_used", "num_slots", "offset", "pinned",
                 "stride")

    def __init__(self, index: int, offset: int):
        self.index = index
        self.offset = offset
        self.stride = 0
        self.num_slots = 0
        # stack of free slot indices, lowest on top (an int array: a slab of 4 KiB pages has
        # 16k slots, and a list would hold an int object for each)
        self.free = array("i")
        self.in_partial = False  # on its class's stack of slabs with free slots
        self.pinned = 0  # entries in this slab that may not be evicted (owned by index.py)
        self.last_used = 0.0  # newest access of any entry in this slab (owned by index.py)

    @property
    def used(self) -> int:
        return self.num_slots - len(self.free)

    def slot_offsets(self) -> range:
        return range(self.offset, self.offset + self.num_slots * self.stride, self.stride)


class SlabAllocator:
    """Allocates slots of any size class from ``arena_bytes // slab_bytes`` slabs."""

    def __init__(self, arena_bytes: int, slab_bytes: int,
                 handed_out: Callable[[int], None] | None = None):
        """``handed_out(slab index)``: told of every slot given (``alloc``, ``alloc_many``):
        the journal's stamps (``journal.py``: what a crashed daemon's clients may still write)."""
        self.handed_out = handed_out or _nothing
        if slab_bytes <= 0 or slab_bytes % ALIGN:
            raise ArenaError(f"slab size must be a positive multiple of {ALIGN}, got {slab_bytes}")
        if arena_bytes < slab_bytes:
            raise ArenaError(f"arena of {arena_bytes} bytes holds no slab of {slab_bytes} bytes")
        self.slab_bytes = slab_bytes
        self.slabs = [Slab(i, i * slab_bytes) for i in range(arena_bytes // slab_bytes)]
        # heap of the free slabs' indices: the lowest offset is given first (pages land low and
        # together), and freeing thousands of slabs (a flush) costs log n each, not a sort
        self._free_slabs: list[int] = list(range(len(self.slabs)))
        # stride -> stack of slabs with free slots (a list: a dict that sees many deletions
        # makes ``next(iter(...))`` walk its tombstones)
        self._partial: dict[int, list[Slab]] = {}
        # stride -> its slabs, least recently touched first (``touch``): the oldest slab of a
        # class is found without walking every slab of the arena (thousands in a large one)
        self._by_age: dict[int, OrderedDict[Slab, None]] = {}
        self._free_slots: dict[int, int] = {}  # stride -> free slots in its slabs

    def check_page_bytes(self, page_bytes: int) -> int:
        """Validate a page size; return its stride."""
        stride = stride_for(page_bytes)
        if page_bytes <= 0 or stride > self.slab_bytes:
            raise ArenaError(
                f"page of {page_bytes} bytes does not fit a slab of {self.slab_bytes} bytes "
                "(raise slab_size in the config)"
            )
        return stride

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all slabs (the arena, less a tail smaller than a slab)."""
        return self.slab_bytes * len(self.slabs)

    def slab_of(self, offset: int) -> Slab:
        return self.slabs[offset // self.slab_bytes]

    @property
    def free_slab_count(self) -> int:
        return len(self._free_slabs)

    def alloc(self, stride: int) -> int | None:
        """A free slot's offset for class ``stride``, or None when the class and the free slab
        list are both empty (the caller evicts and retries)."""
        partial = self._partial.setdefault(stride, [])
        if not partial and not self._take_slab(stride, partial):
            return None
        slab = partial[-1]
        slot = slab.free.pop()
        self._free_slots[stride] -= 1
        self.handed_out(slab.index)
        if not slab.free:
            partial.pop()
            slab.in_partial = False
        return slab.offset + slot * stride

    def has_free(self, stride: int) -> bool:
        """Whether ``alloc(stride)`` would give a slot now (without the caller evicting)."""
        return bool(self._partial.get(stride)) or bool(self._free_slabs)

    def free_bytes(self, stride: int) -> int:
        """Bytes ``alloc(stride)`` can give without the caller evicting: the free slots of the
        class and the free slabs (which any class may take)."""
        return self._free_slots.get(stride, 0) * stride + len(self._free_slabs) * self.slab_bytes

    def free_slots(self, stride: int) -> int:
        """How many ``alloc(stride)`` can give without the caller evicting."""
        return (self._free_slots.get(stride, 0)
                + len(self._free_slabs) * (self.slab_bytes // stride))

    def alloc_many(self, stride: int, n: int) -> list[tuple[Slab, array]]:
        """Up to ``n`` free slots of class ``stride``: exactly the slots, in the same order and
        leaving the same state, as ``n`` calls of ``alloc`` that stop at the first None (a
        batch of reservations takes whole runs off a slab's free stack at once). Returns
        (slab, its slot indices in the order given) per slab drawn from; fewer than ``n``
        slots in all when the class and the free slab list ran dry."""
        partial = self._partial.setdefault(stride, [])
        out = []
        while n > 0:
            if not partial and not self._take_slab(stride, partial):
                break
            slab = partial[-1]
            free = slab.free
            k = min(n, len(free))
            got = free[len(free) - k:]
            del free[len(free) - k:]
            got.reverse()  # popped from the top of the stack, one after the other
            out.append((slab, got))
            self.handed_out(slab.index)
            self._free_slots[stride] -= k
            n -= k
            if not free:
                partial.pop()
                slab.in_partial = False
        return out

    def claim(self, offset: int, stride: int) -> None:
        """Make the slot at ``offset`` of class ``stride`` the one ``alloc(stride)`` gives next
        (adoption: a kept page goes back to its own slot through the index's own ``reserve``).
        The slot's slab is given the class if free; ArenaError when the slab has another class,
        the offset is no slot of it, or the slot is taken."""
        slab = self.slab_of(offset)
        if slab.stride == 0:
            self._take_slab(stride, self._partial.setdefault(stride, []), slab.index)
        rel = offset - slab.offset
        if slab.stride != stride or rel % stride or rel // stride >= slab.num_slots:
            raise ArenaError(f"offset {offset} is not a slot of class {stride} (slab "
                             f"{slab.index} has class {slab.stride})")
        i = rel // stride
        free = slab.free
        if not free or free[-1] != i:
            try:
                free.remove(i)
            except ValueError:
                raise ArenaError(f"slot {offset} of class {stride} is taken") from None
            free.append(i)
        partial = self._partial[stride]
        if not slab.in_partial:  # (a slab with a free slot is in its class's partial list)
            raise ArenaError(f"slab {slab.index} lost track of its free slots")
        if partial[-1] is not slab:
            partial.remove(slab)
            partial.append(slab)

    def _take_slab(self, stride: int, partial: list[Slab], index: int = -1) -> bool:
        """Give class ``stride`` the free slab of the lowest offset, or free slab ``index``
        (False: none is left)."""
        if not self._free_slabs:
            return False
        if index < 0:
            slab = self.slabs[heapq.heappop(self._free_slabs)]
        else:
            self._free_slabs.remove(index)
            heapq.heapify(self._free_slabs)
            slab = self.slabs[index]
        slab.stride = stride
        slab.num_slots = self.slab_bytes // stride
        slab.free = array("i", range(slab.num_slots - 1, -1, -1))
        self._free_slots[stride] = self._free_slots.get(stride, 0) + slab.num_slots
        slab.in_partial = True
        partial.append(slab)
        self._by_age.setdefault(stride, OrderedDict())[slab] = None
        return True

    def free(self, offset: int) -> None:
        """Return a slot; a slab left empty goes back to the global free list."""
        self.free_many((offset,))

    def _emptied(self, slab: Slab) -> None:
        """``slab``, its last slot just freed, goes back to the global free list."""
        self._free_slots[slab.stride] -= slab.num_slots - 1
        if slab.in_partial:
            self._partial[slab.stride].remove(slab)
            slab.in_partial = False
        del self._by_age[slab.stride][slab]
        slab.stride = slab.num_slots = 0
        slab.free = array("i")
        slab.last_used = 0.0
        heapq.heappush(self._free_slabs, slab.index)

    def free_many(self, offsets: Sequence[int]) -> None:
        """``free`` of each of ``offsets`` in turn (an eviction's pages: ``Evictor``): each slot
        back on its slab's free stack, a slab left empty back on the global free list."""
        slabs, sb = self.slabs, self.slab_bytes
        free_slots, partials = self._free_slots, self._partial
        for offset in offsets:
            slab = slabs[offset // sb]
            stride = slab.stride
            rel = offset - slab.offset
            if stride == 0 or rel % stride or rel // stride >= slab.num_slots:
                raise ArenaError(f"offset {offset} is not a slot of slab {slab.index}")
            slab.free.append(rel // stride)
            if len(slab.free) == slab.num_slots:
                self._emptied(slab)
            else:
                free_slots[stride] += 1
                if not slab.in_partial:
                    slab.in_partial = True
                    partials[stride].append(slab)

    def touch(self, offset: int, tick: int) -> None:
        """The entry at ``offset`` was used at ``tick`` (ticks only grow)."""
        slab = self.slabs[offset // self.slab_bytes]
        slab.last_used = tick
        self._by_age[slab.stride].move_to_end(slab)

    def touched(self, slabs: Iterable[Slab]) -> None:
        """Slabs whose ``last_used`` the caller set, in the order of those touches: each
        becomes its class's most recently used (``touch`` of many pages at once)."""
        by_age = self._by_age
        for slab in slabs:
            by_age[slab.stride].move_to_end(slab)

    def oldest_unpinned(self, not_stride: int) -> Slab | None:
        """The least recently touched slab holding no pinned entry, of any class but
        ``not_stride`` (a slab whose pages can all be evicted to give it to another class)."""
        best = None
        for stride, slabs in self._by_age.items():
            if stride == not_stride:
                continue
            for slab in slabs:  # oldest first; a pinned one is skipped
                if slab.pinned == 0:
                    if best is None or slab.last_used < best.last_used:
                        best = slab
                    break
        return best

    def used_bytes(self) -> int:
        """Bytes in allocated slots (strides, not page bytes)."""
        return sum(s.used * s.stride for s in self.slabs if s.stride)
