"""The put and get of the 3FS backend (``Hf3fsBackend``, a mixin: its space, key caches, fd table,
I/O and counters are ``backend.py``'s), in batches of at most ``_chunk()`` pages.

Write (one node, its writer thread), per batch:
  1. skip keys stored already (own slots; another node's pointer record, looked at afresh);
  2. allocate slots (``NodeSpace``: free slot, new segment, or LRU eviction at ``capacity``);
  3. ``slots.write_slots``: hash each page, head stamps, then page bytes + trail stamps;
  4. per slot, its directory entry, then the pointer (temp file + rename: ``_publish``).
  A batch written into a segment deleted under it (another node's clear) publishes nothing.
Read (any node, its reader thread), per batch:
  1. resolve kh -> pointer (own slots from memory, others' from a cache or the record);
  2. ``slots.read_pointed``: page bytes straight into the arena, stamps and hashes checked;
  3. a page that failed under a cached pointer is tried once more under the record read
     again (it may have been replaced); one that failed under a pointer read just now
     names a dead slot (``_dead``): ``exists`` says missing, and a put stores it again.
"""

from __future__ import annotations

import logging
import os
import time

from hicached.backends.hf3fs.format import Pointer, Stamp, key_hash, safe_name, slot_bytes_for
from hicached.backends.hf3fs.records import publish_pointer, read_pointer
from hicached.backends.hf3fs.slots import read_pointed, write_slots
from hicached.backends.hf3fs.space import Slot
from hicached.backends.integrity import identity_seed
from hicached.errors import ConfigError

log = logging.getLogger("hicached.backends.hf3fs.backend")


class Hf3fsTransfers:
    """``batch_put`` / ``batch_get`` of ``Hf3fsBackend``; see the module docstring."""

    def batch_put(self, ns, pool, keys, offsets, page_bytes):
        out = [False] * len(keys)
        if self._closed:
            return out
        with self._write_lock:
            try:
                self._check_wiped()
                self._evict_bad_own()
                self.space.maintain()
            except (OSError, ConfigError) as e:  # (a vanished root): misses, until it can
                self._note("put", e, len(keys))  # start again
                return out
            step = self._chunk()
            for start in range(0, len(keys), step):
                end = start + step
                try:
                    out[start:end] = self._put_chunk(ns, pool, keys[start:end],
                                                     offsets[start:end], page_bytes)
                except Exception as e:  # a failing store is a miss, never an exception
                    log.exception("hf3fs put of %d pages failed", len(keys[start:end]))
                    self._note("put", e, len(keys[start:end]))
        return out

    def _chunk(self) -> int:
        """Pages per I/O batch: ``batch_entries``, and no more than half the fd table (a batch
        holds the fds of its segments open until it is done, and a reader's and the writer's
        batches run at once), so any number of segments works within any fd limit."""
        return max(1, min(self.entries, self.fds.max_open // 2))

    def _check_wiped(self) -> None:
        """Start empty if another node's ``clear`` deleted our segments (rate limited; the
        write lock is taken only then, so loads never wait behind writes here)."""
        now = time.monotonic()
        if now - self._wipe_checked < self.wipe_check_s:
            return
        self._wipe_checked = now
        if self.space.wiped():
            with self._write_lock:
                if self.space.wiped():
                    log.warning("hf3fs: segments of node %s were deleted (clear by another "
                                "node?); starting empty", self.space.node)
                    self._reset()

    def _put_chunk(self, ns, pool, keys, offsets, page_bytes) -> list[bool]:
        out = [False] * len(keys)
        ns_name, pool_name = safe_name(ns), safe_name(pool)
        now = time.monotonic()
        todo: list[tuple[int, bytes]] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            kh = key_hash(ns, pool, key)
            if kh in seen or self._own(kh, ns, pool, key) is not None:
                out[i] = True
                continue
            seen.add(kh)
            # another node's key: its record is looked at even if ``exists`` found it a moment
            # ago (``keys.found``): that node may have evicted it since, and a put skipped on
            # the strength of the cache would lose the page (one stat, on the writer thread)
            if not self.keys.absent(kh, now) and self._has_record(ns, pool, kh):
                if not self.keys.found(kh, now):  # (keep a pointer a get cached)
                    self.keys.remember(kh, None, now)  # another node stored it
                out[i] = True
                continue
            todo.append((i, kh))
        if not todo:
            return out
        sb = slot_bytes_for(page_bytes)
        places = self.space.allocate(sb, len(todo))
        self.counters["no_space"] += len(todo) - len(places)
        items = [(i, Slot(seg, idx, self.space.next_gen(), page_bytes, kh, ns_name, pool_name,
                          0.0, (ns, pool, keys[i]))) for (seg, idx), (i, kh) in zip(places, todo)]
        pending = dict(enumerate(items))  # slots to give back if anything below raises
        handles, deleted = {}, []
        try:
            try:
                for _, s in items:
                    if s.seg.key not in handles:
                        handles[s.seg.key] = self.fds.acquire(s.seg.key, s.seg.path, True)
                ok = write_slots(self.io, self.arena, [
                    (handles[s.seg.key].fd, s.seg.head.slot_off(s.index), offsets[i],
                     Stamp(s.index, s.gen, s.page_bytes, s.kh, s.seg.tag, 0),
                     identity_seed(ns, pool, keys[i], page_bytes)) for i, s in items])
                deleted = [h for h in handles.values() if os.fstat(h.fd).st_nlink == 0]
                if deleted:  # written into a deleted segment (another node's clear): never
                    ok = [False] * len(items)  # publish a pointer to it; start afresh
            finally:
                for h in handles.values():
                    self.fds.release(h)
            for n, ((i, s), good) in enumerate(zip(items, ok)):
                del pending[n]
                if good:
                    out[i] = self._publish(ns, pool, s)
                else:
                    self.space.release(s.seg, s.index)
            stored = sum(out[i] for i, _ in items)
            self.counters["puts"] += stored
            self.counters["put_failures"] += len(items) - stored
        finally:
            for _, s in pending.values():
                self.space.release(s.seg, s.index)
        if deleted:
            log.warning("hf3fs: a segment of node %s was deleted under it (a clear by another "
                        "node?); starting empty", self.space.node)
            self._reset()
            return out
        self.space.top_up(sb)
        return out

    def _has_record(self, ns: str, pool: str, kh: bytes) -> bool:
        """A live pointer record for ``kh``; one that cannot be read counts as none (the
        page is written again: a second copy, never a lost one)."""
        try:
            return self.keys.has_record(kh, self._ptr_path(ns, pool, kh))
        except OSError:
            return False

    def _publish(self, ns: str, pool: str, s: Slot) -> bool:
        """Directory entry, then the pointer (step 4); on failure the slot goes back."""
        try:
            self.space.commit(s)
        except OSError as e:
            self._note("put", e, 0)  # counted with the batch
            self.space.release(s.seg, s.index)
            return False
        try:
            publish_pointer(self._ptr_path(ns, pool, s.kh), s.pointer(self.space.uuid),
                            self.file_mode)
        except OSError as e:
            self._note("put", e, 0)
            self.space.evict([s])
            return False
        self.keys.stored(s.kh)
        return True

    def batch_get(self, ns, pool, keys, offsets, page_bytes):
        out = [False] * len(keys)
        if self._closed:
            return out
        try:
            self._check_wiped()
        except (OSError, ConfigError) as e:
            self._note("get", e)
            return out
        with self._get_lock:  # one user of the "get" lane's scratch and ring at a time
            step = self._chunk()
            for start in range(0, len(keys), step):
                end = start + step
                try:
                    out[start:end] = self._get_chunk(ns, pool, keys[start:end],
                                                     offsets[start:end], page_bytes)
                except Exception as e:
                    log.exception("hf3fs get of %d pages failed", len(keys[start:end]))
                    self._note("get", e)
        self.counters["gets"] += len(keys)
        self.counters["get_hits"] += sum(out)
        return out

    def _get_chunk(self, ns, pool, keys, offsets, page_bytes) -> list[bool]:
        out = [False] * len(keys)
        now = time.monotonic()
        todo: list[tuple[int, Pointer, bool]] = []  # (index, pointer, pointer read just now)
        own: dict[int, Slot] = {}
        for i, key in enumerate(keys):
            kh = key_hash(ns, pool, key)
            slot = self._own(kh, ns, pool, key)
            if slot is not None:
                own[i] = slot
                todo.append((i, slot.pointer(self.space.uuid), True))
                continue
            cached = self.keys.pointer(kh, now)
            if cached is not None:
                todo.append((i, cached, False))
                continue
            ptr = self._load_pointer(ns, pool, kh, now)
            if ptr is not None:
                todo.append((i, ptr, True))
        ok, dead = self._read_checked(ns, pool, keys, todo, offsets, page_bytes)
        retry = []
        for n, ((i, ptr, fresh), good) in enumerate(zip(todo, ok)):
            out[i] = good
            if good:
                continue
            if not fresh:  # a cached pointer may be stale: read the record again
                new = self._load_pointer(ns, pool, ptr.key_hash, now)
                if new is not None and new != ptr:
                    retry.append((i, new, True))
                elif new == ptr and n in dead:
                    self._dead(ptr, own.get(i), now)
            elif n in dead:
                self._dead(ptr, own.get(i), now)
        ok, dead = self._read_checked(ns, pool, keys, retry, offsets, page_bytes)
        for n, ((i, ptr, _), good) in enumerate(zip(retry, ok)):
            out[i] = good
            if n in dead:
                self._dead(ptr, None, now)
        self.space.touch([slot for i, slot in own.items() if out[i]])
        self.counters["remote_hits"] += sum(out[i] for i, p, _ in todo
                                            if p.node_uuid != self.space.uuid)
        return out

    def _load_pointer(self, ns: str, pool: str, kh: bytes, now: float) -> Pointer | None:
        try:
            ptr = read_pointer(self._ptr_path(ns, pool, kh))
        except OSError as e:
            self._note("read", e)
            return None
        if ptr is None or ptr.key_hash != kh or self.keys.is_dead(kh, ptr):
            self.keys.forget(kh, now)  # (a dead record names no page: not read again)
            return None
        self.keys.remember(kh, ptr, now)
        return ptr

    def _dead(self, ptr: Pointer, own: Slot | None, now: float) -> None:
        """``ptr``, just read, names a slot that no longer holds its page (a pointer left by
        a failed eviction, a segment deleted or cut short under it): ``exists`` says missing
        while the record stays the same, and a put stores the key again. One of this node's
        own slots is evicted by the writer thread (``_evict_bad_own``)."""
        self.counters["dead_pointers"] += 1
        self.keys.dead(ptr.key_hash, ptr, now)
        if own is not None and self.space.forget_live(own):
            with self._bad_lock:
                self._bad_own.append(own)

    def _evict_bad_own(self) -> None:
        """Evict own slots a read found broken (writer thread)."""
        with self._bad_lock:
            bad, self._bad_own = self._bad_own, []
        if bad:
            self.space.evict(bad)

    def _read_checked(self, ns, pool, keys, todo: list[tuple[int, Pointer, bool]], offsets,
                      page_bytes) -> tuple[list[bool], set[int]]:
        """``read_pointed`` of the pointers of ``todo`` = [(key index, pointer, fresh)], each
        checked under its key's identity; copies that do not verify are counted."""
        ok, fails = read_pointed(
            self.io, self.arena, self.fds, self.root, self.space.uuid,
            [(ptr, offsets[i], identity_seed(ns, pool, keys[i], page_bytes))
             for i, ptr, _ in todo], page_bytes, self.counters)
        for n in fails.corrupt:
            self.integrity.failed(ns, pool, keys[todo[n][0]], "page bytes do not match the "
                                  "hash in their stamps: changed, or another key's page")
        self.integrity.unchecked_copies(len(fails.unchecked))
        return ok, set(fails.dead)
