"""A 3FS node's restart: the in-memory records of its segments and slots, rebuilt from the
segment directories (``SpaceRestart._load``) and cut down to the configured capacity when that
is smaller than what the node holds (``SpaceRestart._shrink``). A mixin of
``space.NodeSpace`` (its root, dir, fds, clock, grace_s, capacity, segments, live, lru,
free, used_bytes and eviction)."""

from __future__ import annotations

import logging
import os
from collections import deque

from hicached.backends.hf3fs.format import (
    BLOCK,
    DIR_ENTRY_BYTES,
    DirEntry,
    Pointer,
    SegmentHeader,
    pointer_relpath,
    segment_tag,
)

log = logging.getLogger(__name__)


class Segment:
    """One segment file of this node: a header, a directory and ``num_slots`` slots."""

    __slots__ = ("head", "key", "name", "path", "ready_at", "retiring", "tag")

    def __init__(self, name: str, path: str, head: SegmentHeader, node_uuid: bytes):
        self.name, self.path, self.head = name, path, head
        self.key = (node_uuid, name)  # FdTable key
        self.tag = segment_tag(node_uuid, name)
        self.retiring = False
        self.ready_at = 0.0  # retiring: deleted once the clock passes this


class Slot:
    """A live page of this node: where it is and what its pointer says."""

    __slots__ = ("gen", "index", "key", "kh", "ns_name", "page_bytes", "pool_name", "seg",
                 "used")

    def __init__(self, seg: Segment, index: int, gen: int, page_bytes: int, kh: bytes,
                 ns_name: str, pool_name: str, used: float,
                 key: tuple[str, str, str] | None = None):
        self.seg, self.index, self.gen, self.page_bytes = seg, index, gen, page_bytes
        self.kh, self.ns_name, self.pool_name, self.used = kh, ns_name, pool_name, used
        # (namespace, pool, key) once this daemon put or read the page (the disk keeps only
        # its hash): what ``take_evicted`` tells the daemon when the slot is evicted
        self.key = key

    def pointer(self, node_uuid: bytes) -> Pointer:
        return Pointer(node_uuid, self.seg.name, self.index, self.seg.head.slot_off(self.index),
                       self.gen, self.page_bytes, self.kh)

    def pointer_rel(self) -> str:
        return pointer_relpath(self.ns_name, self.pool_name, self.kh)


class SpaceRestart:
    """What ``NodeSpace`` does once at start, before any other thread uses it."""

    def _load(self) -> None:
        """Rebuild live and free slots from the segment directories (one read per segment)."""
        now, found = self.clock(), []
        free: dict[int, list] = {}
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(".seg"):
                continue
            path = os.path.join(self.dir, name)
            seg = self._open_existing(name[:-4], path)
            if seg is None:
                continue
            sb, n = seg.head.slot_bytes, seg.head.num_slots
            fd = self.fds.acquire(seg.key, path, writable=True)
            try:
                raw = os.pread(fd.fd, n * DIR_ENTRY_BYTES, seg.head.dir_off)
            finally:
                self.fds.release(fd)
            for i in range(n):
                e = DirEntry.unpack(raw[i * DIR_ENTRY_BYTES:(i + 1) * DIR_ENTRY_BYTES])
                if e is not None and e.state == 1:
                    found.append((e.written_ns, seg, i, e))
                else:
                    free.setdefault(sb, []).append((now + self.grace_s if e else now, seg, i))
        for _, seg, i, e in sorted(found, key=lambda t: t[0]):
            old = self.live.get(e.key_hash)
            if old is not None:  # a key twice (a crash between two writes): keep the newer
                self._drop_live(old)
                free.setdefault(old.seg.head.slot_bytes, []).append(
                    (now + self.grace_s, old.seg, old.index))
            self._add_live(Slot(seg, i, e.gen, e.page_bytes, e.key_hash, e.ns_name, e.pool_name,
                                now))
        for sb, items in free.items():
            self.free[sb] = deque(sorted(items, key=lambda t: t[0]))
        if self.segments:
            log.info("hf3fs node %s: %d segments, %d pages found", self.node,
                     len(self.segments), len(self.live))

    def _open_existing(self, name: str, path: str) -> Segment | None:
        try:
            with open(path, "rb") as f:
                head = SegmentHeader.unpack(f.read(BLOCK))
        except OSError as e:  # EMFILE, EIO, a hung mount...: the file may be fine, keep it
            log.warning("hf3fs: cannot read segment %s (%s): its pages are not used until a "
                        "restart reads it", path, e)
            return None
        if head is None or head.node_uuid != self.uuid:
            log.warning("hf3fs: removing unreadable segment %s (crash while creating it?)", path)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        seg = self.segments[name] = Segment(name, path, head, self.uuid)
        self.used_bytes += head.file_bytes
        return seg

    def _shrink(self) -> None:
        """At start, with a smaller ``capacity`` than the segments found: retire whole segments
        (their pointers removed first, as any eviction; the files deleted after the grace)
        until the rest fits. Empty segments go first, then those whose newest page is the
        oldest (by its place in its class's LRU, which ``_load`` built in write order)."""
        if self.used_bytes <= self.capacity:
            return
        pages: dict[str, list[Slot]] = {}
        newest: dict[str, float] = {}
        for od in self.lru.values():
            for i, slot in enumerate(od.values(), 1):
                pages.setdefault(slot.seg.name, []).append(slot)
                newest[slot.seg.name] = i / len(od)
        keep_bytes = self.used_bytes
        for seg in sorted(self.segments.values(),
                          key=lambda g: (newest.get(g.name, -1.0), g.head.created_ns)):
            if keep_bytes <= self.capacity:
                break
            keep_bytes -= seg.head.file_bytes
            self._retire(seg, f"(capacity {self.capacity} bytes, the segments found hold "
                              f"{self.used_bytes})", pages.get(seg.name, []))
        self._mature_retired()  # (with no grace period: deleted now)
