"""The presence table: which keys L2 holds, published in shared memory so clients answer exists.

An exists of 1024 keys over the socket costs a round trip (0.1-0.2 ms here) plus the daemon's
decoding and lookups (0.2 ms). Exists only *advises* — the get that follows is checked key by key
by the daemon, under a lease — so a client can read the answer straight from memory the daemon
publishes, with no message at all. The daemon keeps one open-addressing hash table beside its arena
(``<arena>.presence``, same owner and mode): per key a 64-bit fingerprint of (namespace, key) and
the namespace's pool bitmask (``PageIndex.presence``), updated by the control loop at every commit
and removal. Clients map it read-only.

    file   | header: 8 x u64 | sessions: 4096 x u64 | slot 0: fp, mask | ... | slot capacity-1 |
           | slot tags: arena_bytes // grain x u64 |
    header  magic, capacity, heartbeat (f64, CLOCK_MONOTONIC), flags, entries, epoch, grain, tags
    session the ``seq`` of the last commit the daemon read from a session (``Commit.seq``): a
            client that sent commits without awaiting them reads its own writes once its word
            reaches its count (``Welcome.presence_session``: its word, -1 when none was free)
    fp      0 = empty; linear probing from fp & (capacity - 1); backward-shift deletion
    tag     per ``grain`` bytes of arena (``TAG_GRAIN``; 0: no tags): the generation tag
            (``Entry.gen``) of the committed page whose slot starts in that span, 0 when none.
            Written at commit, zeroed *before* the slot is freed, for slots of at least a grain
            (two such slots never start in one span). Tags are never reused, so a page read
            from (offset, tag) while ``tag`` was there before and after the copy is that page's
            committed bytes, unchanged: the client's lease-free get (``client/leaseless.py``).

The daemon is the only writer (the control loop); readers take no lock. A reader that races a
write may see a key a moment early or late, or miss one being moved by a deletion: exactly the
staleness a socket answer has by the time its get arrives, and never wrong bytes (the get is
authoritative). Readers fall back to the socket whenever the table cannot answer alone:

    heartbeat older than ``STALE_S``   the daemon is stuck or dead: the socket gives the real error
    flag OVERFLOW                      the table filled up (``presence_slots``) and misses keys
    flag CLOSED, other epoch           the daemon stopped or restarted: join the new one
    flag L3 and a key L2 lacks         only the daemon can ask L3 (and start its prefetch)
    magic of another format            a daemon or client of another version (``MAGIC``)

Fingerprints (``fingerprint``, ``fingerprint_list``: the daemon's and the clients' alike) are
XXH3-64 of the key's UTF-8 bytes, seeded with the namespace's own fingerprint. Two keys sharing
one is a 2^-64 event whose worst case is an exists "yes" that the get turns into a miss. The
format's ``MAGIC`` names the function: a table written with another one is never read.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import time
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from hicached.arena import create_mapped, release_mapped
from hicached.errors import ArenaError

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"HCPRES02", "little")  # 02: XXH3 fingerprints
HEADER_WORDS = 8
SESSION_WORDS = 4096  # sessions with a commit word; later ones read their writes via the socket
TABLE_WORD = HEADER_WORDS + SESSION_WORDS
H_MAGIC, H_CAPACITY, H_HEARTBEAT, H_FLAGS, H_ENTRIES, H_EPOCH, H_GRAIN, H_TAGS = range(8)
F_L3, F_OVERFLOW, F_CLOSED = 1, 2, 4
MAX_LOAD = 0.6  # past this share of slots in use the table stops taking keys (OVERFLOW)
STALE_S = 1.0  # a heartbeat older than this: readers ask the daemon instead
MIN_SLOTS, MAX_SLOTS = 1 << 14, 1 << 26  # 256 KiB .. 1 GiB of slots (locked shared memory)
# Default sizing (``default_slots``): one key per this many bytes of arena. The arena takes pages
# down to one 64 B slot (``slabs.ALIGN``), but a table for those would cost up to 83% of the
# arena. A key's pages (all pools of one token page) hold at least one KV page, all layers: 12
# KiB per token already for a 0.5B model, so at 4 KiB an arena full of the smallest real pages
# still fits (a million of them in a 4 GiB arena), for 0.65-1.3% of the arena (power-of-2
# rounding). Smaller pages: set ``presence_slots``.
KEY_BYTES = 4096
LOOKUP_SCALAR = 64  # ``PresenceView.lookup``: batches up to this probe key by key
LOOKUP_WINDOW = 8  # ``PresenceView.lookup``: slots read at once from each key's home (128 B)
SET_TAIL = 32  # ``set_many``: keys still probing after a round that go one by one
TAG_GRAIN = 64 * 1024  # arena bytes per slot tag: pages this large or larger get a tag
# Readers rely on the daemon's stores becoming visible in program order, and causally (x86): a
# mask before its fp, a session word after the commits it acknowledges, a tag zeroed before any
# writer learns of the slot. Elsewhere (ARM) clients do not use the table at all
# (``SharedExists.open``): every exists and get goes through the socket.
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def default_slots(arena_bytes: int) -> int:
    """Slots for an arena: room for one key per ``KEY_BYTES`` of arena at ``MAX_LOAD``, a power
    of 2 within [``MIN_SLOTS``, ``MAX_SLOTS``] (the table file: ``table_bytes``)."""
    want = int(arena_bytes // KEY_BYTES / MAX_LOAD) + 1
    return min(MAX_SLOTS, max(MIN_SLOTS, 1 << (want - 1).bit_length()))


def table_bytes(slots: int, arena_bytes: int, grain: int = TAG_GRAIN) -> int:
    """Bytes of the table file (``PresenceTable.nbytes``): header and session words, 16 B per
    slot (fp, mask), 8 B per ``grain`` of arena for the slot tags (``grain`` 0: none)."""
    tags = arena_bytes // grain if arena_bytes >= grain > 0 else 0
    return (TABLE_WORD + 2 * slots + tags) * 8


def fingerprint(seed: int, key: str) -> int:
    """The 64-bit fingerprint (never 0 or 1) of ``key`` under ``seed``: XXH3-64 of its UTF-8
    bytes; ``fingerprint_list`` of many."""
    h = xxhash.xxh3_64_intdigest(key.encode(), seed)
    return h if h > 1 else h + 2


def namespace_seed(ns: str) -> int:
    """The fingerprint seed of a namespace (digest): its keys' fingerprints differ from any
    other namespace's."""
    return fingerprint(0x5EED, "ns:" + ns)


def fingerprint_list(seed: int, keys: Sequence[str]) -> list[int] | None:
    """``fingerprint(seed, k)`` of every key (~0.15 us a key), or None when a key is not a
    str (the daemon's typed error, or the client's if it cannot be sent)."""
    h = xxhash.xxh3_64_intdigest
    try:
        fps = [h(k.encode(), seed) for k in keys]
    except (AttributeError, UnicodeEncodeError):
        return None
    if fps and min(fps) < 2:  # 0 (empty) and 1 are never fingerprints: a 2^-63 event
        fps = [x if x > 1 else x + 2 for x in fps]
    return fps


def fingerprints(seed: int, keys: Sequence[str]) -> np.ndarray | None:
    """``fingerprint_list`` as a uint64 array."""
    fps = fingerprint_list(seed, keys)
    return None if fps is None else np.array(fps, np.uint64)


class PresenceTable:
    """The daemon's side: created empty, written only by the control loop (``set`` / ``remove``),
    with ``beat`` every turn of the loop. ``epoch`` tells this daemon's table from a successor's
    at the same path."""

    def __init__(self, path: str, slots: int, epoch: int, mode: int = 0o600,
                 arena_bytes: int = 0, grain: int = 0):
        if slots < 2 or slots & (slots - 1):
            raise ValueError(f"presence slots must be a power of 2, got {slots}")
        if grain < 0 or grain & (grain - 1):
            raise ValueError(f"tag grain must be 0 or a power of 2, got {grain}")
        self.path, self.slots, self.epoch = path, slots, epoch
        self.grain = grain if arena_bytes >= grain > 0 else 0
        self.tag_count = arena_bytes // self.grain if self.grain else 0
        self._tags_at = TABLE_WORD + 2 * slots
        self.nbytes = table_bytes(slots, arena_bytes, self.grain)
        self._buf = create_mapped(path, self.nbytes, mode, "presence table")
        self._w = memoryview(self._buf).cast("Q")  # slot s: fp at TABLE_WORD + 2s, then mask
        # the tags (kept up to date until the daemon exits, even after ``close``: readers check
        # the flags after their copies, and a slot is freed only after its tag is zeroed)
        self._t = self._w[self._tags_at:] if self.tag_count else None
        self._hb = memoryview(self._buf)[H_HEARTBEAT * 8:H_HEARTBEAT * 8 + 8].cast("d")
        self._mask = slots - 1
        self._limit = int(slots * MAX_LOAD)
        self.entries = 0
        self.flags = 0
        self._free_sessions = list(range(SESSION_WORDS - 1, -1, -1))
        w = self._w
        w[H_CAPACITY], w[H_EPOCH] = slots, epoch
        w[H_GRAIN], w[H_TAGS] = self.grain, self.tag_count
        self.beat(time.monotonic())
        w[H_MAGIC] = MAGIC  # last: a reader seeing the magic sees the rest

    @property
    def overflowed(self) -> bool:
        return bool(self.flags & F_OVERFLOW)

    def _find(self, fp: int) -> int:
        """Word index of ``fp``'s slot, or of the empty slot ending its probe."""
        w, m = self._w, self._mask
        s = fp & m
        while True:
            at = TABLE_WORD + 2 * s
            cur = w[at]
            if cur == fp or cur == 0:
                return at
            s = (s + 1) & m

    def set(self, fp: int, mask: int) -> None:
        """Publish ``fp`` with pool bitmask ``mask`` (> 0)."""
        if self.flags & (F_OVERFLOW | F_CLOSED):
            return  # readers no longer trust the table: nothing to keep up
        if not self._put(fp, mask):
            self._set_flag(F_OVERFLOW)
            log.warning("presence table full (%d keys in %d slots): clients ask the daemon over "
                        "the socket for every exists until L2 holds fewer keys again; raise "
                        "presence_slots (16 B a slot) above %d", self.entries, self.slots,
                        self.slots)

    def set_many(self, fps: np.ndarray, masks: np.ndarray) -> None:
        """``set`` of each (fp, mask) in turn (uint64 / int64 arrays; a commit's keys), leaving
        the same bytes: every key's slot is found at once (as ``_find``, in numpy rounds), then
        all masks are written and then the new keys' fps (a reader that finds an fp finds its
        mask). When two new keys would take one empty slot (or come twice), or the table would
        fill, they go one by one instead: only then can the order of the puts matter."""
        n = len(fps)
        if self.flags & (F_OVERFLOW | F_CLOSED) or not n:
            return
        words = np.frombuffer(self._buf, np.uint64, 2 * self.slots, TABLE_WORD * 8)
        fps = np.asarray(fps, np.uint64)
        wmask = 2 * self.slots - 1
        word = (fps << np.uint64(1)).astype(np.intp) & wmask  # each key's home slot's fp word
        at = np.empty(n, np.intp)
        pos, want = np.arange(n), fps
        while True:  # each round: the keys still probing look at their next slot
            cur = words.take(word)
            done = cur == want
            done |= cur == 0
            at[pos[done]] = word[done]
            more = ~done
            pos = pos[more]
            if pos.size <= SET_TAIL:  # the long probe runs' thin tail: one by one
                break
            want, word = want[more], word[more]
            word += 2
            word &= wmask
        for i in pos.tolist():
            at[i] = self._find(int(fps[i])) - TABLE_WORD
        new = words.take(at) == 0
        added = int(new.sum())
        if (self.entries + added > self._limit or len(set(at.tolist())) != n):
            for fp, mask in zip(fps.tolist(), np.asarray(masks).tolist(), strict=True):
                self.set(fp, mask)
            return
        words[at + 1] = np.asarray(masks, np.int64).view(np.uint64)
        words[at[new]] = fps[new]
        self.entries += added
        self._w[H_ENTRIES] = self.entries

    def _put(self, fp: int, mask: int) -> bool:
        w = self._w
        at = self._find(fp)
        if w[at] == fp:
            w[at + 1] = mask
            return True
        if self.entries >= self._limit:
            return False
        w[at + 1] = mask  # the mask first: a reader that finds the fp finds its mask
        w[at] = fp
        self.entries += 1
        w[H_ENTRIES] = self.entries
        return True

    def rebuild(self, items: Iterable[tuple[int, int]]) -> bool:
        """Refill a full table from scratch with ``(fp, mask)`` items (``PageIndex.republish``),
        readers ignoring it meanwhile (OVERFLOW stays up until the end); whether they fit."""
        if self._w is None:
            return False
        np.frombuffer(self._buf, np.uint64)[TABLE_WORD:self._tags_at] = 0  # (not the tags)
        self.entries = 0
        for fp, mask in items:
            if not self._put(fp, mask):
                return False
        self._w[H_ENTRIES] = self.entries
        self._set_flag(F_OVERFLOW, False)
        log.info("presence table rebuilt with %d keys: clients answer exists again", self.entries)
        return True

    def remove(self, fp: int) -> None:
        """Forget ``fp`` (backward-shift deletion: no tombstones, probes stay short)."""
        if self.flags & (F_OVERFLOW | F_CLOSED):
            return
        w, m = self._w, self._mask
        hole = self._find(fp)
        if w[hole] != fp:
            return
        # A slot's fp is zeroed before another mask goes in: a reader never finds an fp beside
        # another key's mask (it may miss a key while it moves: staleness, as in the docstring).
        w[hole] = 0
        s = (hole - TABLE_WORD) >> 1
        j = s
        while True:
            j = (j + 1) & m
            at = TABLE_WORD + 2 * j
            cur = w[at]
            if cur == 0:
                break
            home = cur & m
            # move slot j back into the hole unless its home lies cyclically in (hole, j]
            if (j > s and (home <= s or home > j)) or (j < s and home <= s and home > j):
                w[hole + 1] = w[at + 1]
                w[hole] = cur
                w[at] = 0
                hole, s = at, j
        self.entries -= 1
        w[H_ENTRIES] = self.entries

    def publish_tag(self, offset: int, stride: int, tag: int) -> None:
        """The page of generation ``tag`` is committed in the slot at ``offset``."""
        if self._t is not None and stride >= self.grain:
            self._t[offset // self.grain] = tag

    def clear_tag(self, offset: int, stride: int) -> None:
        """The page in the slot at ``offset`` is leaving it (before the slot is freed)."""
        if self._t is not None and stride >= self.grain:
            self._t[offset // self.grain] = 0

    def clear_tags(self, offsets: np.ndarray, strides: np.ndarray) -> None:
        """``clear_tag`` of each (int64 arrays: an eviction's pages, ``Evictor``)."""
        if self._t is not None:
            tagged = strides >= self.grain
            if tagged.any():
                np.asarray(self._t)[offsets[tagged] // self.grain] = 0

    def take_session(self) -> int:
        """A free session word, zeroed (-1: none left)."""
        if not self._free_sessions or self._w is None:
            return -1
        i = self._free_sessions.pop()
        self._w[HEADER_WORDS + i] = 0
        return i

    def free_session(self, i: int) -> None:
        if i >= 0:
            self._free_sessions.append(i)

    def ack(self, i: int, seq: int) -> None:
        """Session word ``i``: its commits up to ``seq`` are read (and published)."""
        if i >= 0 and 0 < seq < 1 << 64 and self._w is not None:
            self._w[HEADER_WORDS + i] = seq

    def stats(self) -> dict:
        return {"slots": self.slots, "keys": self.entries, "full": self.overflowed,
                "sessions": SESSION_WORDS - len(self._free_sessions),
                "tag_grain": self.grain}

    def set_l3(self, attached: bool) -> None:
        if bool(self.flags & F_L3) != attached:
            self._set_flag(F_L3, attached)

    def _set_flag(self, flag: int, on: bool = True) -> None:
        self.flags = self.flags | flag if on else self.flags & ~flag
        if self._w is not None:
            self._w[H_FLAGS] = self.flags

    def beat(self, now: float, l3_attached: bool | None = None) -> None:
        """The loop is alive at ``now`` (and whether an L3 backend is attached, if given)."""
        if l3_attached is not None:
            self.set_l3(l3_attached)
        if self._w is not None:
            self._hb[0] = now

    def close(self) -> None:
        """Tell readers the daemon is gone and remove the file; every later change is ignored
        (commits read while draining). Safe to call twice."""
        if self._w is None:
            return
        self._set_flag(F_CLOSED)
        self._w = None
        release_mapped(self.path)


def close_left(path: str) -> bool:
    """Mark the table a previous daemon left at ``path`` closed (flag CLOSED), as its own
    ``close`` would have: its clients stop answering from it, and stop trusting the slot tags
    they read there, before a successor touches a slot (``daemon/adoption.py``). Whether a
    table of this format was there."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < HEADER_WORDS * 8:
            return False
        buf = mmap.mmap(fd, HEADER_WORDS * 8, flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    w = memoryview(buf).cast("Q")
    try:
        if w[H_MAGIC] != MAGIC:
            return False
        w[H_FLAGS] = w[H_FLAGS] | F_CLOSED
        return True
    finally:
        w.release()
        buf.close()


class PresenceView:
    """A client's read-only map of the daemon's table (``lookup``), for one namespace."""

    def __init__(self, path: str, slots: int, epoch: int, seed: int, session: int = -1):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ArenaError(f"cannot open presence table {path}: {e}") from e
        try:
            base = (TABLE_WORD + 2 * slots) * 8
            nbytes = os.fstat(fd).st_size
            if nbytes < base or nbytes % 8:
                raise ArenaError(f"presence table {path} is {nbytes} bytes, not {base} or more")
            buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        words = np.frombuffer(buf, np.uint64)
        self.header = words[:HEADER_WORDS]
        # slot tags (the daemon's magic is written last: the header is complete by now)
        self.grain, count = int(self.header[H_GRAIN]), int(self.header[H_TAGS])
        if base + count * 8 != nbytes or (self.grain == 0) != (count == 0):
            raise ArenaError(f"presence table {path}: {count} tags do not fit its "
                             f"{nbytes} bytes")
        self.tags = words[base // 8:]
        # the same words for single reads: a memoryview item costs ~50 ns, a numpy one ~1 us
        # (and a get's checks run right after a large copy, with the CPU caches cold)
        self._w = memoryview(buf).cast("Q")
        self._tags_at = base // 8
        self.heartbeat = np.frombuffer(buf, np.float64, 1, H_HEARTBEAT * 8)
        self._hb = memoryview(buf)[H_HEARTBEAT * 8:H_HEARTBEAT * 8 + 8].cast("d")
        self.table = words[TABLE_WORD:base // 8].reshape(slots, 2)
        self._words = words[TABLE_WORD:base // 8]  # slot s: fp at 2s, mask at 2s + 1
        self.slots, self.epoch, self.seed = slots, epoch, seed
        self._session = words[HEADER_WORDS + session:][:1] if 0 <= session < SESSION_WORDS else None

    def usable(self) -> int | None:
        """The table's flags when it can answer now, else None (ask the daemon)."""
        h = self.header
        flags = int(h[H_FLAGS])
        if (flags & (F_OVERFLOW | F_CLOSED) or int(h[H_MAGIC]) != MAGIC
                or int(h[H_EPOCH]) != self.epoch
                or abs(time.monotonic() - float(self.heartbeat[0])) > STALE_S):
            return None
        return flags

    def alive(self) -> bool:
        """Whether the daemon keeps the table now (``usable`` less the OVERFLOW and L3 flags:
        what the slot tags need)."""
        w = self._w
        return (not w[H_FLAGS] & F_CLOSED and w[H_MAGIC] == MAGIC and w[H_EPOCH] == self.epoch
                and abs(time.monotonic() - self._hb[0]) <= STALE_S)

    def tag_words(self) -> tuple[memoryview, int, int, int]:
        """(words, index of the first tag, grain, arena bytes the tags cover): the tag of the
        slot at ``offset`` (``0 <= offset < covered``) is ``words[first + offset // grain]``."""
        return self._w, self._tags_at, self.grain, self.tags.size * self.grain

    def tag_of(self, offset: int) -> int:
        """The tag published for the slot at ``offset`` (0: none; -1: outside the arena)."""
        words, first, grain, covered = self.tag_words()
        return words[first + offset // grain] if 0 <= offset < covered else -1

    def read_up_to(self, seq: int) -> bool:
        """Whether the daemon read this session's commits up to ``seq``."""
        return self._session is not None and int(self._session[0]) >= seq

    def lookup(self, keys: Sequence[str]) -> np.ndarray | None:
        """Per key its pool bitmask (int64, as ``PageIndex.presence``), or None when a key has
        no fingerprint (not a str), or a slot changed under the reading (the fp read again
        after its mask differs: ask the daemon). Batches of up to ``LOOKUP_SCALAR`` keys probe
        one by one (a scalar probe ~0.2 us). Larger ones read ``LOOKUP_WINDOW`` slots from each
        key's home slot in one gather: a probe ends at its fp or at an empty slot, so the first
        of either in the window answers the key; the few keys whose window holds neither go on
        one by one. One gather costs the same at any load, where rounds of one slot each
        (vectorised probing) took ~3 rounds more at a half-full table: at a million keys this
        is ~1.1 x the lookup at 10k, from ~1.6 x."""
        fps = fingerprint_list(self.seed, keys)
        if fps is None:
            return None
        n, m = len(fps), self.slots - 1
        if n <= LOOKUP_SCALAR:
            out = [0] * n
            return (np.array(out, np.uint64).view(np.int64)
                    if self._probe(fps, [fp & m for fp in fps], out) else None)
        words = self._words
        want = np.array(fps, np.uint64)
        home = (want & np.uint64(m)).astype(np.intp)
        width = min(LOOKUP_WINDOW, self.slots)
        slot = home[:, None] + np.arange(width)
        slot &= m
        cur = words.take(slot << 1)  # (n, width): the window's fps
        hit = cur == want[:, None]
        stop = hit | (cur == 0)
        first = stop.argmax(axis=1)  # the first fp or empty slot (0 when neither: see below)
        rows = np.arange(n)
        at = slot[rows, first]
        found = hit[rows, first]
        out = np.where(found, words.take((at << 1) + 1), 0).view(np.int64)
        if not (words.take(at[found] << 1) == want[found]).all():
            return None  # a slot changed under the reading
        left = (~stop[rows, first]).nonzero()[0]  # no fp and no empty slot in the window
        if left.size:
            tail = left.tolist()
            masks = [0] * len(tail)
            if not self._probe([fps[i] for i in tail], ((home[left] + width) & m).tolist(),
                               masks):
                return None
            out[tail] = np.array(masks, np.uint64).view(np.int64)
        return out

    def _probe(self, fps: list[int], slots: list[int], out: list[int]) -> bool:
        """``out[i]``: the mask of ``fps[i]``, probing from slot ``slots[i]`` (0 when absent);
        False when a slot changed under the reading, or no empty slot ends a probe."""
        w, m, limit = self._w, self.slots - 1, self.slots
        for i, (fp, s) in enumerate(zip(fps, slots)):
            for _ in range(limit):
                at = TABLE_WORD + 2 * s
                cur = w[at]
                if cur == fp:
                    out[i] = w[at + 1]
                    if w[at] != fp:
                        return False
                    break
                if not cur:
                    break
                s = (s + 1) & m
            else:
                return False
        return True
