"""Copies that overlap a round trip: speculative gets (``PageRecall``) and set-ahead slots
(``SetAhead``), the client side of both.

Speculative gets: the client remembers where the daemon placed or found each page, with the
slot's generation tag (``Reserved.tags`` / ``Leased.tags``). A get copies pages from there while
its ``Lease`` request travels; the answer names every page's (offset, tag), and a tag is unique to
one page's stay in one slot, so a copy from the same (offset, tag) read that page's final bytes
(the slot held them from when this client learnt it until the lease pinned it); any other page is
copied again from its leased slot (``Client._load``). A flush of L2 through the client voids
every guess (``PageRecall.clear``): the pages left their slots.

The guessed pages are copied in one go. Copying in chunks, so as to stop when the answer is in
or late (a late answer means pages loading from L3 into new slots, so stale guesses), was
measured side by side on the 2-vCPU VM: L2 hits got 4-5 % slower than one copy (and than no
speculation), and cold L3 gets of stale guesses still lost to no speculation at all.

Set-ahead slots: a ``batch_set`` copies while its reservation travels.

A set is reserve -> copy -> commit, and the copy cannot start before the daemon names the slots,
so each set would cost a round trip plus the copy. With set-ahead the daemon's answer to a
``Reserve`` also grants the client free slots for its *next* set (``Reserved.ahead``, held for it
by ``leases.AheadSlots``). That next set sends its ``Reserve`` naming, per key, the set-ahead slot
it copies the key's page into (``Reserve.ahead``) and makes the copies while the request is on its
way. The daemon binds each named slot to its key when the key is new (``Reserved.bound``); a key
that was already stored or in flight leaves its slot a set-ahead slot, and any key that did not
get its named slot is copied again into the slot the answer gives it. So a set costs about one
copy.

Safety: a slot is written only while this client holds it. The daemon frees unused set-ahead
slots ``reservation_ttl_s`` after the answer that listed them, so slots granted more than half
that long ago are not used (as ``Client._store`` does for reservations); a handshake (daemon
restarted) voids them, and only one set at a time may use them: a second thread's set meanwhile
neither names nor renews any (two sets naming the same slot would write into each other's page).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

from hicached.client.flatpages import TensorPages
from hicached.kernels.pageio import PageIO

log = logging.getLogger(__name__)

_TAG_MASK = (1 << 64) - 1  # PageRecall packs offset << 64 | tag (tags are < 2**57)


class PageRecall:
    """Where this client last saw pages: (pool, key) -> (offset, tag), at most ``limit`` entries
    (the oldest eighth is forgotten past it; 0: never speculate), for pools of pages of at least
    ``min_page_bytes``.

    Stored as ``"pool\0key" -> offset << 64 | tag``: strings and ints are objects the garbage
    collector does not track, so tens of thousands of long-lived entries add nothing to the
    engine's GC passes (tuples would: every full collection walks them, and their allocation
    triggers those collections, each a pause of tens of ms in a process with torch loaded)."""

    def __init__(self, limit: int, min_page_bytes: int):
        self._where: dict[str, int] = {}
        self.limit = limit
        self.min_page_bytes = min_page_bytes

    def __len__(self) -> int:
        return len(self._where)

    def clear(self) -> None:
        self._where.clear()

    def seen(self, name: str, key: str) -> tuple[int, int] | None:
        """(offset, tag) where ``key`` of pool ``name`` was last seen, or None."""
        loc = self._where.get(f"{name}\0{key}")
        return None if loc is None else (loc >> 64, loc & _TAG_MASK)

    def known(self, name: str, keys: Sequence[str]) -> list[tuple[int, int, int]]:
        """(position in ``keys``, offset, tag) of every key of pool ``name`` whose page this
        client saw."""
        where, prefix = self._where, name + "\0"
        return [(j, loc >> 64, loc & _TAG_MASK) for j, key in enumerate(keys)
                if (loc := where.get(prefix + key)) is not None]

    def note(self, name: str, key: str, offset: int, tag: int) -> None:
        self._where[f"{name}\0{key}"] = offset << 64 | tag

    def uses(self, io: PageIO) -> bool:
        return (self.limit > 0 and io.page_bytes >= self.min_page_bytes
                and not isinstance(io, TensorPages))  # those promise to leave misses untouched

    def learn(self, name: str, io: PageIO, keys: Sequence[str], offsets: Sequence[int],
              tags: Sequence[int]) -> None:
        """Remember where the daemon placed or found the pages of ``keys`` (an answer's offsets
        and tags; a key without a slot is forgotten)."""
        if not tags or not self.uses(io):
            return
        where, prefix = self._where, name + "\0"
        for key, off, tag in zip(keys, offsets, tags):
            if off >= 0 and tag:
                where[prefix + key] = off << 64 | tag
            else:
                where.pop(prefix + key, None)
        if len(where) > self.limit:
            for k in list(itertools.islice(where, len(where) - self.limit * 7 // 8)):
                del where[k]

    def guess(self, todo: Sequence[tuple[str, PageIO, list[int]]],
              keys_of: dict[str, list[str]], starts_of: dict[str, list[int]], arena: Any):
        """Where the pages of ``todo`` were seen: per pool {position: (offset, tag)}, and a
        function that copies them from there (run while the lease request is on its way; it
        never raises: a pool whose copy failed is dropped from the guesses, so copied again)."""
        guesses: dict[str, dict[int, tuple[int, int]]] = {}
        jobs = []
        for name, io, idx in todo:
            if not self.uses(io):
                continue
            where, keys, prefix = self._where, keys_of[name], name + "\0"
            g = {j: (loc >> 64, loc & _TAG_MASK) for j, i in enumerate(idx)
                 if (loc := where.get(prefix + keys[i])) is not None}
            if g:
                guesses[name] = g
                jobs.append((name, io, [starts_of[name][idx[j]] for j in g],
                             [off for off, _ in g.values()]))
        if not jobs:
            return guesses, None

        def copy() -> None:
            for name, io, starts, offsets in jobs:
                try:
                    io.from_arena(starts, arena.tensor, offsets)
                except (ValueError, RuntimeError, TypeError, IndexError) as e:  # copy it later
                    log.debug("speculative copy of pool %r failed: %s", name, e)
                    guesses.pop(name, None)
        return guesses, copy


class Claim:
    """What one set names in its ``Reserve``: per transfer the slots its first keys are copied
    into (``ahead``) and how many slots to hold afterwards (``want``)."""

    def __init__(self, owner: SetAhead, epoch: int, sent: float):
        self.owner = owner
        self.epoch = epoch
        self.sent = sent
        self.ahead: list[list[int]] = []
        self.want: list[int] = []
        self.jobs: list[tuple[int, PageIO, list[int], list[int]]] = []  # (transfer, io, ...)
        self.failed: set[int] = set()  # transfers whose copy failed: copied again after

    def copy(self, arena: Any) -> None:
        """Copy the named pages into their set-ahead slots (run while the ``Reserve`` travels:
        never raises; a failed pool is copied again into its reserved slots afterwards)."""
        for p, io, starts, offsets in self.jobs:
            try:
                io.to_arena(starts, arena.tensor, offsets)
            except (ValueError, RuntimeError, TypeError, IndexError) as e:
                log.debug("set-ahead copy of transfer %d failed: %s", p, e)
                self.failed.add(p)

    def settle(self, names: Sequence[str], granted: Sequence[Sequence[int]], epoch: int) -> None:
        """Take the slots the answer lists (unless a handshake came between) and let the next
        set use them."""
        try:
            if epoch == self.epoch:
                for name, offsets in zip(names, granted):
                    self.owner.slots[name] = (list(offsets), self.sent, epoch)
        finally:
            self.owner.busy.release()


class SetAhead:
    """Per client: the set-ahead slots it holds, per pool (offsets, when the request that listed
    them was sent, the handshake epoch). ``max_bytes``: per pool, what it asks to hold at most."""

    def __init__(self, max_bytes: int, min_page_bytes: int):
        self.max_bytes = max_bytes
        self.min_page_bytes = min_page_bytes
        self.slots: dict[str, tuple[list[int], float, int]] = {}
        self.busy = threading.Lock()

    def void(self) -> None:
        """A new handshake: slots of the earlier session are not this session's."""
        self.slots.clear()

    def uses(self, io: PageIO) -> bool:
        return self.max_bytes > 0 and io.page_bytes >= self.min_page_bytes

    def claim(self, plan: Sequence[tuple[str, PageIO, list[str], list[int]]], epoch: int,
              sent: float, ttl_s: float) -> Claim | None:
        """The claim of a set about to send its ``Reserve``, or None (set-ahead off for its
        pools, or another set is using the slots). A claim must be ``settle``d."""
        if not any(self.uses(io) for _, io, _, _ in plan) or not self.busy.acquire(False):
            return None
        c = Claim(self, epoch, sent)
        for p, (name, io, keys, starts) in enumerate(plan):
            held = self.slots.pop(name, None)
            row: list[int] = []
            if not self.uses(io):
                c.want.append(0)
            else:
                cap = max(1, self.max_bytes // io.page_bytes)
                c.want.append(min(cap, max(len(keys), len(held[0]) if held else 0)))
                if held and held[2] == epoch and sent - held[1] < ttl_s / 2:
                    n = min(len(keys), len(held[0]))
                    row = held[0][:n]
                    if n:
                        c.jobs.append((p, io, starts[:n], row))
            c.ahead.append(row)
        return c
