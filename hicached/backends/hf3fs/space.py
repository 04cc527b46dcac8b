"""This node's share of a 3FS root: its identity, its segment files and the slots in them.

A node owns the segment files under ``segments/<uuid>/`` and is their only writer; readers on
any node find its pages through pointer records. ``NodeSpace`` keeps, in memory, what the
directory regions of its segments say on disk:

    live      key hash -> Slot, one LRU per slot class (slot_bytes)
    free      per class, a FIFO of (ready_at, segment, slot): a slot freed by eviction becomes
              reusable only ``grace_s`` after its pointer was removed (quarantine)
    segments  name -> Segment; ``used_bytes`` = sum of their file sizes <= ``capacity`` (a
              restart with a smaller capacity retires segments down to it: ``hf3fs_restart``)

Allocation takes a ready free slot, else grows a new segment while the capacity allows, else
evicts: the least recently used live slot of the class, or (a class with no live slot) retires
the whole segment of another class that holds the oldest page, deleting it after the grace.

Eviction order on disk: remove the pointer (only if it still names this slot), then mark the
directory entry free, then quarantine. Commit order: slot data, directory entry, pointer. A
crash between two steps leaves a page only this node can see, never a pointer to a reused slot.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict, deque

from hicached.backends.hf3fs.fds import FdTable
from hicached.backends.hf3fs.format import (
    BLOCK,
    DIR_ENTRY_BYTES,
    DirEntry,
    SegmentHeader,
    safe_name,
)
from hicached.backends.hf3fs.node import (
    NodeId,
    bump_epoch,
    lock_node,
    remove_lost_segments,
    write_owner,
)
from hicached.backends.hf3fs.records import remove_pointer_if
from hicached.backends.hf3fs.restart import Segment, Slot, SpaceRestart

log = logging.getLogger(__name__)

GROW_RETRY_S = 5.0  # after a segment could not be created, evict instead for this long
EVICTED_MAX = 1 << 16  # evicted keys kept for ``take_evicted``; past it, it answers None


# ---------------------------------------------------------------- the slot space


class NodeSpace(SpaceRestart):
    """Slots of this node (see the module docstring). ``allocate`` / ``commit`` / ``release``
    / eviction run on the writer thread only; ``lookup`` / ``touch`` from any thread."""

    def __init__(self, root: str, node: str, capacity: int, segment_bytes: int, grace_s: float,
                 fds: FdTable, file_mode: int = 0o600, clock=time.monotonic,
                 lock_wait_s: float = 5.0):
        self.root, self.node, self.capacity = root, node, capacity
        self.segment_bytes, self.grace_s, self.fds = segment_bytes, grace_s, fds
        self.file_mode, self.clock = file_mode, clock
        self.lock = threading.Lock()  # guards live / lru against the reader and loop threads
        self._lock_fd = lock_node(root, node, file_mode, lock_wait_s)
        self.evictions = 0
        self.waits = 0  # allocations that waited out a grace period
        self._unremoved: list[Slot] = []  # evicted slots whose pointer removal failed
        self._grow_failed_at = -GROW_RETRY_S  # a segment could not be created then
        self._evicted: list[tuple[str, str, str]] = []  # for ``take_evicted``
        self._evicted_lost = False
        self._evicted_lock = threading.Lock()
        try:
            self._set_id(bump_epoch(root, node, mode=file_mode))
            self._reset_state()
            if self.id.lost:  # the node file was damaged: this is a new uuid
                remove_lost_segments(root, node, self.uuid)
            self._load()
            self._shrink()
        except BaseException:
            self.close()  # (the node lock: a later attach in this process must get it)
            raise

    def _set_id(self, node_id: NodeId) -> None:
        self.id = node_id
        self.uuid, self.epoch = node_id.uuid, node_id.epoch

    def _reset_state(self) -> None:
        self.dir = os.path.join(self.root, "segments", self.uuid.hex())
        os.makedirs(self.dir, exist_ok=True)
        write_owner(self.dir, self.node, self.file_mode)
        self.segments: dict[str, Segment] = {}
        self._retiring: list[Segment] = []  # retired, deleted at their ready_at
        self.live: dict[bytes, Slot] = {}
        self.lru: dict[int, OrderedDict[bytes, Slot]] = {}
        self.free: dict[int, deque[tuple[float, Segment, int]]] = {}
        self.used_bytes = 0
        self._seq = 0  # segments created in this epoch
        self._counter = 0  # generations handed out in this epoch

    # ------------------------------------------------------------ lookups (any thread)

    def lookup(self, kh: bytes) -> Slot | None:
        return self.live.get(kh)

    def touch(self, slots: list[Slot]) -> None:
        """Mark ``slots`` as just used (LRU order)."""
        now = self.clock()
        with self.lock:
            for slot in slots:
                od = self.lru.get(slot.seg.head.slot_bytes)
                if od is not None and od.get(slot.kh) is slot:
                    od.move_to_end(slot.kh)
                    slot.used = now

    def _add_live(self, slot: Slot) -> None:
        with self.lock:
            self.live[slot.kh] = slot
            self.lru.setdefault(slot.seg.head.slot_bytes, OrderedDict())[slot.kh] = slot

    def forget_live(self, slot: Slot) -> bool:
        """Stop serving ``slot`` (any thread; a read found it broken); True if it was live, and
        then only the caller evicts it (later, on the writer thread)."""
        with self.lock:
            if self.live.get(slot.kh) is not slot:
                return False  # evicted meanwhile (its slot may hold another page by now)
            del self.live[slot.kh]
            del self.lru[slot.seg.head.slot_bytes][slot.kh]
            return True

    def _drop_live(self, slot: Slot) -> None:
        with self.lock:
            if self.live.get(slot.kh) is slot:
                del self.live[slot.kh]
                del self.lru[slot.seg.head.slot_bytes][slot.kh]

    # ------------------------------------------------------------ allocation (writer thread)

    def next_gen(self) -> int:
        self._counter += 1
        if self._counter >= 1 << 32:  # 2**32 writes in one epoch: go on in a new one
            self._set_id(bump_epoch(self.root, self.node, self.id, self.file_mode))
            self._counter = 1
        return self.epoch << 32 | self._counter

    def allocate(self, slot_bytes: int, n: int) -> list[tuple[Segment, int]]:
        """Up to ``n`` free slots of class ``slot_bytes``; evicts (and waits out the grace of
        evicted slots) at capacity. Fewer than ``n`` when even eviction cannot make room."""
        if SegmentHeader.layout(slot_bytes, 1, self.uuid, 0).file_bytes > self.capacity:
            return []
        out: list[tuple[Segment, int]] = []
        while len(out) < n:
            self._mature_retired()
            got = self._take_free(slot_bytes)
            if got is not None:
                out.append(got)
            elif not self._grow(slot_bytes):
                soonest = self._soonest(slot_bytes)
                if soonest is None:
                    if not self._evict_for(slot_bytes, n - len(out)):
                        break
                else:
                    self.waits += 1
                    time.sleep(max(0.0, soonest - self.clock()))
        return out

    def _take_free(self, sb: int) -> tuple[Segment, int] | None:
        q = self.free.get(sb)
        now = self.clock()
        while q and q[0][0] <= now:
            _, seg, i = q.popleft()
            if not seg.retiring:
                return seg, i
        return None

    def _soonest(self, sb: int) -> float | None:
        """When a quarantined slot of ``sb`` or a retiring segment becomes usable, if any."""
        times = [t for t, seg, _ in self.free.get(sb, ()) if not seg.retiring][:1]
        times += [s.ready_at for s in self._retiring]
        return min(times) if times else None

    def _grow(self, sb: int) -> bool:
        room = self.capacity - self.used_bytes
        limit = min(room, max(self.segment_bytes,
                              SegmentHeader.layout(sb, 1, self.uuid, 0).file_bytes))
        n = max(0, (limit - BLOCK) // (sb + DIR_ENTRY_BYTES))
        while n and SegmentHeader.layout(sb, n, self.uuid, 0).file_bytes > limit:
            n -= 1
        if n == 0:
            return False
        if self.clock() - self._grow_failed_at < GROW_RETRY_S:
            return False
        self._seq += 1
        name = f"{sb}-{self.epoch}-{self._seq}"
        head = SegmentHeader.layout(sb, n, self.uuid, time.time_ns())
        path = os.path.join(self.dir, name + ".seg")
        try:
            fd = self.fds.open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.file_mode)
            try:
                os.ftruncate(fd, head.file_bytes)  # sparse; 3FS sets the length now
                os.pwrite(fd, head.pack(), 0)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        except OSError as e:  # quota, ENOSPC, too many files...: evict within what we have
            log.warning("hf3fs: cannot create segment %s: %s (evicting instead; retried in "
                        "%.0f s)", path, e, GROW_RETRY_S)
            self._grow_failed_at = self.clock()
            return False
        seg = self.segments[name] = Segment(name, path, head, self.uuid)
        self.fds.release(self.fds.acquire(seg.key, path, writable=True, fd=fd))
        self.used_bytes += head.file_bytes
        now = self.clock()
        q = self.free.setdefault(sb, deque())
        q.extendleft((now, seg, i) for i in reversed(range(n)))  # ready now: ahead of quarantine
        return True

    def _evict_for(self, sb: int, k: int) -> bool:
        """Make room for class ``sb``: evict its ``k`` oldest pages, or retire the segment of
        another class that holds the oldest page. False when nothing can be evicted."""
        victims = self._oldest(sb, k)
        if victims:
            self.evict(victims)
            return True
        with self.lock:  # the reader thread reorders the LRUs (touch)
            heads = [next(iter(o.values())) for c, o in self.lru.items() if o and c != sb]
        if heads:
            victim_seg = min(heads, key=lambda s: s.used).seg
        else:  # no live page of another class either: retire a segment holding only free slots
            victim_seg = next((s for s in self.segments.values()
                               if not s.retiring and s.head.slot_bytes != sb), None)
            if victim_seg is None:
                return False
        self._retire(victim_seg)
        return True

    def _retire(self, seg: Segment, why: str = "for another page size",
                victims: list[Slot] | None = None) -> None:
        """Evict every page of ``seg`` (``victims``, when the caller knows them) and delete the
        segment once the grace period passed; its slots are never used again."""
        if victims is None:
            with self.lock:
                victims = [s for s in self.live.values() if s.seg is seg]
        self.evict(victims, quarantine=False)
        seg.retiring = True
        seg.ready_at = self.clock() + self.grace_s
        self._retiring.append(seg)
        log.info("hf3fs node %s: retiring segment %s (%d pages) %s", self.node, seg.name,
                 len(victims), why)

    def maintain(self) -> None:
        """Finish what waits on the clock: pointer removals to retry, retired segments whose
        grace passed (writer thread, before a batch; ``allocate`` does it too)."""
        self._mature_retired()

    def _retry_unremoved(self) -> None:
        """Pointers eviction could not remove: try again; their slots are free once removed."""
        left = []
        for slot in self._unremoved:
            try:
                remove_pointer_if(os.path.join(self.root, slot.pointer_rel()),
                                  slot.pointer(self.uuid))
            except OSError:
                left.append(slot)
                continue
            if not slot.seg.retiring:
                self.release(slot.seg, slot.index)
        self._unremoved = left

    def _mature_retired(self) -> None:
        if self._unremoved:
            self._retry_unremoved()
        now = self.clock()
        ready = [s for s in self._retiring if s.ready_at <= now]
        if not ready:
            return
        self._retiring = [s for s in self._retiring if s.ready_at > now]
        for seg in ready:
            del self.segments[seg.name]
            self.used_bytes -= seg.head.file_bytes
            self.fds.drop(seg.key)
            try:
                os.unlink(seg.path)
            except OSError as e:
                log.warning("hf3fs: cannot delete retired segment %s: %s", seg.path, e)

    def evict(self, victims: list[Slot], quarantine: bool = True, tell: bool = True) -> None:
        """Make ``victims`` unreachable (pointer, then directory entry), then quarantine them;
        ``tell``: their keys (where known) are reported by ``take_evicted``."""
        if tell:
            self._tell([slot.key for slot in victims if slot.key is not None])
        for slot in victims:
            self._drop_live(slot)
            try:
                remove_pointer_if(os.path.join(self.root, slot.pointer_rel()),
                                  slot.pointer(self.uuid))
            except OSError as e:  # the pointer may remain: never reuse the slot it names
                log.warning("hf3fs: cannot remove the pointer of slot %d of %s: %s (the slot "
                            "is reused once it is removed)", slot.index, slot.seg.name, e)
                self._unremoved.append(slot)
                continue
            try:
                self.write_dir(slot.seg, slot.index,
                               DirEntry(0, slot.gen, 0, 0, b"\0" * 16, "", ""))
            except OSError as e:  # left "live" on disk: a restart sees a page only we can read
                log.warning("hf3fs: cannot free slot %d of %s: %s", slot.index, slot.seg.name, e)
            if quarantine:
                self.release(slot.seg, slot.index)
        self.evictions += len(victims)

    def top_up(self, sb: int) -> None:
        """At capacity, keep a few slots of ``sb`` in quarantine ahead of demand, so writes at
        capacity rarely wait out the grace period themselves."""
        if self.grace_s <= 0 or self._could_grow(sb):
            return
        short = max(1, len(self.lru.get(sb, ())) // 32) - len(self.free.get(sb, ()))
        if short > 0:
            self.evict(self._oldest(sb, short))

    def _oldest(self, sb: int, k: int) -> list[Slot]:
        """The ``k`` least recently used live slots of class ``sb``."""
        with self.lock:
            od = self.lru.get(sb)
            return [od[kh] for kh, _ in zip(od, range(k))] if od else []

    def _could_grow(self, sb: int) -> bool:
        return SegmentHeader.layout(sb, 1, self.uuid, 0).file_bytes <= (
            self.capacity - self.used_bytes)

    def release(self, seg: Segment, index: int) -> None:
        """Return a slot to its class after the grace period (an abandoned or evicted write)."""
        q = self.free.setdefault(seg.head.slot_bytes, deque())
        q.append((self.clock() + self.grace_s, seg, index))

    # ------------------------------------------------------------ evicted keys (any thread)

    def _tell(self, keys: list[tuple[str, str, str]]) -> None:
        if not keys:
            return
        with self._evicted_lock:
            if not self._evicted_lost:
                self._evicted.extend(keys)
                if len(self._evicted) > EVICTED_MAX:  # nobody asks: stop keeping them
                    self._evicted_lost, self._evicted = True, []

    def lost_track(self) -> None:
        """Pages may have gone without their keys told (``take_evicted`` answers None)."""
        with self._evicted_lock:
            self._evicted_lost = True
            self._evicted = []

    def take_evicted(self) -> list[tuple[str, str, str]] | None:
        with self._evicted_lock:
            out = None if self._evicted_lost else self._evicted
            self._evicted, self._evicted_lost = [], False
        return out

    # ------------------------------------------------------------ commit (writer thread)

    def write_dir(self, seg: Segment, index: int, entry: DirEntry) -> None:
        """Write slot ``index``'s directory entry (raises OSError)."""
        h = self.fds.acquire(seg.key, seg.path, writable=True)
        try:
            os.pwrite(h.fd, entry.pack(), seg.head.dir_entry_off(index))
        finally:
            self.fds.release(h)

    def commit(self, slot: Slot) -> None:
        """Record ``slot`` as live on disk (directory) and in memory. Call after the slot's
        data is written and before its pointer is published."""
        self.write_dir(slot.seg, slot.index, DirEntry(1, slot.gen, slot.page_bytes,
                                                      time.time_ns(), slot.kh, slot.ns_name,
                                                      slot.pool_name))
        slot.used = self.clock()
        old = self.live.get(slot.kh)
        if old is not None:  # the same key stored again: still stored, nothing to tell
            self.evict([old], tell=False)
        self._add_live(slot)

    # ------------------------------------------------------------ reset, stats, close

    def wiped(self) -> bool:
        """True when this node's segment directory vanished (another node ran ``clear``)."""
        try:
            os.stat(self.dir)
        except FileNotFoundError:
            return True
        except OSError:  # cannot tell now (a transient error): not a wipe
            return False
        return False

    def reset(self) -> None:
        """Forget every slot (after the files were deleted) and start a fresh epoch."""
        for seg in self.segments.values():
            self.fds.drop(seg.key)
        with self.lock:  # forgotten first: if the new epoch fails, nothing stale is served
            self.segments, self.live, self.lru, self.free = {}, {}, {}, {}
            self._retiring = []
            self.used_bytes, self._unremoved = 0, []
        self._set_id(bump_epoch(self.root, self.node, self.id, self.file_mode))
        with self.lock:
            self._reset_state()

    def stats(self) -> dict:
        with self.lock:
            pages = len(self.live)
            page_bytes = sum(s.page_bytes for s in self.live.values())
        return {"node": self.node, "pages": pages, "page_bytes": page_bytes,
                "bytes": self.used_bytes, "capacity": self.capacity,
                "segments": len(self.segments), "evictions": self.evictions,
                "alloc_waits": self.waits}

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    @staticmethod
    def default_node() -> str:
        return safe_name(socket.gethostname())
