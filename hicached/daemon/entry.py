"""A handle on a page record of the L2 index (``records.py``), and the records' constants."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hicached.daemon.fptable import FpTable

if TYPE_CHECKING:
    from hicached.daemon.records import Records

TableId = tuple[str, str]  # (namespace digest, pool name)
MAX_POOLS = 63  # pools a namespace may have: one bit each in an int64 presence mask
MAX_TABLES = 32767  # (namespace, pool) pairs a daemon's life may see: an int16 in each record
KEY_BYTES = 64  # a key of up to this many UTF-8 bytes is kept inline in its record (else a dict)
GROW_MIN = 1 << 12  # records added at least when the arrays grow (then an eighth more)

# page flags
COMMITTED, PENDING, IN_L3, WRITING, FROM_L3 = 1, 2, 4, 8, 16
JOURNALED = 32  # its journal record's fixed part was written when it was reserved (its check
# still 0: ``Records.journal_reserved``); its commit writes the rest (``journal_pages``)
_TOP = 1 << 63  # Python's hash (int64) + 2**63: the same bits as uint64, the top one flipped


def key_fps(keys: Sequence[str]) -> np.ndarray:
    """The key table's fingerprint of each key (uint64): ``(hash(key) + _TOP) or 1``."""
    fps = np.fromiter(map(hash, keys), np.int64, count=len(keys)).view(np.uint64)
    fps ^= np.uint64(_TOP)
    fps[fps == 0] = 1
    return fps


class Entry:
    """A handle on one page record (see the module docstring): ``ix`` (the index's ``Records``
    whose record it names), ``rec``, ``table``, ``key``, ``slot_offset`` (its slot as it was made: the
    index's own calls read it; others read ``offset``, -1 once the page is gone), ``stride``
    and ``gen`` are fixed; everything else reads through to the records. The index alone
    makes and fills handles."""

    __slots__ = ("ix", "slot_offset", "gen", "key", "rec", "stride", "table")

    def __init__(self, ix: Records, rec: int, table: TableId, key: str):
        self.ix = ix
        self.rec = rec
        self.table = table
        self.key = key
        self.slot_offset = ix.p_off[rec]
        self.stride = ix.p_stride[rec]
        self.gen = ix.p_gen[rec]

    @property
    def page_bytes(self) -> int:
        return self.ix.p_pbytes[self.rec]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Entry) and self.gen == other.gen and self.rec == other.rec
                and self.ix is other.ix)

    def __hash__(self) -> int:
        return hash(self.gen)

    @property
    def alive(self) -> bool:
        """Its page still holds its slot (committed, pending or unbound)."""
        return self.ix.p_gen[self.rec] == self.gen

    @property
    def offset(self) -> int:
        """Its slot in the arena; -1 once its page is gone."""
        return self.slot_offset if self.ix.p_gen[self.rec] == self.gen else -1

    # each read checks the generation: a handle of a page that is gone reads as gone
    @property
    def committed(self) -> bool:
        ix, r = self.ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & COMMITTED != 0

    @property
    def in_l3(self) -> bool:
        """A copy is known to be in the L3 backend."""
        ix, r = self.ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & IN_L3 != 0

    @in_l3.setter
    def in_l3(self, on: bool) -> None:
        self._set_flag(IN_L3, on)
        ix = self.ix
        if self.stride >= ix.journal_grain and ix.p_gen[self.rec] == self.gen:
            ix.journal.set_in_l3(self.slot_offset, on)  # (the successor writes what L3 lacks)

    @property
    def writing(self) -> bool:
        """An L3 write of this page is in flight."""
        ix, r = self.ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & WRITING != 0

    @writing.setter
    def writing(self, on: bool) -> None:
        self._set_flag(WRITING, on)

    @property
    def from_l3(self) -> bool:
        """Loaded from L3 and not read since (its first read is an L3 hit)."""
        ix, r = self.ix, self.rec
        return ix.p_gen[r] == self.gen and ix.p_flags[r] & FROM_L3 != 0

    @from_l3.setter
    def from_l3(self, on: bool) -> None:
        self._set_flag(FROM_L3, on)

    def _set_flag(self, flag: int, on: bool) -> None:
        ix, r = self.ix, self.rec
        if ix.p_gen[r] == self.gen:
            ix.p_flags[r] = ix.p_flags[r] | flag if on else ix.p_flags[r] & ~flag

    @property
    def pins(self) -> int:
        ix, r = self.ix, self.rec
        return ix.p_pins[r] if ix.p_gen[r] == self.gen else 0

    @property
    def last_used(self) -> int:
        ix, r = self.ix, self.rec
        return ix.p_used[r] if ix.p_gen[r] == self.gen else 0

    @property
    def hits(self) -> int:
        ix, r = self.ix, self.rec
        return ix.p_hits[r] if ix.p_gen[r] == self.gen else 0

    @hits.setter
    def hits(self, n: int) -> None:
        ix, r = self.ix, self.rec
        if ix.p_gen[r] == self.gen:
            ix.p_hits[r] = min(n, 0x7FFFFFFF)

    @property
    def owner(self) -> int:
        """Pending: the session that reserved it (0: the daemon, an L3 load)."""
        ix, r = self.ix, self.rec
        return ix.owners.get(r, 0) if ix.p_gen[r] == self.gen else 0

    @owner.setter
    def owner(self, sid: int) -> None:
        ix, r = self.ix, self.rec
        if ix.p_gen[r] == self.gen:
            ix.owners[r] = sid

    def __repr__(self) -> str:
        state = "committed" if self.committed else "pending" if self.alive else "gone"
        return f"Entry({self.table[1]}:{self.key} @{self.offset} {state} pins={self.pins})"


class _Keys:
    """One namespace's keys: fingerprint -> key record."""

    __slots__ = ("table",)

    def __init__(self):
        self.table = FpTable()
