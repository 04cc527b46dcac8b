"""A hash table from 64-bit fingerprints to int64 values in one numpy array: no object per entry.

The page index keys its pages by fingerprint (``presence.fingerprint``) and keeps a million of
them; a dict of Python ints costs ~100 B and two objects per entry, and a batch lookup of 1024
keys walks them one by one. Here every entry is two uint64 words in one (capacity, 2) array, so a
probe reads one cache line, and ``get_many`` probes a whole batch in a few numpy passes whose cost
does not grow with the table (one gather per key and round; rounds stay few at load <= 0.5).

    array   | slot 0: fp, value | slot 1: fp, value | ... | slot capacity-1: fp, value |
    word    |   0        1      |   2        3      | ... | 2c-2        2c-1           |
    fp      0 = empty slot (fingerprints are never 0); linear probing from fp & (capacity - 1)
    value   int64 >= 0, stored as uint64; meaningless in an empty slot

Deletion shifts the later members of a probe chain back (``remove``): no tombstones, so probes
stay as short as the load allows however many keys come and go. The table doubles (a vectorised
rehash) when an insert would take the load past ``MAX_LOAD`` and never shrinks: the index's page
count is bounded by the arena, and after a flush it fills again, so memory freed by shrinking
would soon be taken back (at most 32 B per slot, 64 MiB for two million slots).

The scalar calls (``get``, ``put``, ``remove``) run in the control loop's Python loops, so they
read and write through a flat memoryview of the array: indexing one costs ~40 ns and yields a
Python int, three times cheaper than indexing the array.
"""

from __future__ import annotations

import numpy as np

from hicached.daemon.columns import zeros

MAX_LOAD = 0.5  # past this share of slots in use the table doubles
MIN_CAPACITY = 8
TAIL = 16  # get_many: keys still probing after a round that go one by one (tuned: 8-32)


class FpTable:
    """fp (int in [1, 2**64)) -> value (int in [0, 2**63)). Single-threaded: no call may run
    while another does (the control loop owns it)."""

    __slots__ = ("_arr", "_len", "_limit", "_mask", "_min_capacity", "_w", "_wmask")

    def __init__(self, capacity: int = 1024):
        if capacity < MIN_CAPACITY or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of 2 >= {MIN_CAPACITY}, got {capacity}")
        self._min_capacity = capacity
        self._len = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        """A fresh empty array of ``capacity`` slots and the views on it."""
        self._arr = zeros((capacity, 2), np.uint64)
        self._w = memoryview(self._arr).cast("B").cast("Q")  # word 2s: slot s's fp, 2s+1: value
        self._mask = capacity - 1
        self._wmask = 2 * capacity - 1  # word index of a slot's fp, advanced by 2, wraps with it
        self._limit = int(capacity * MAX_LOAD)

    def __len__(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        """Slots (a power of 2)."""
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        """Bytes of the array (16 per slot)."""
        return self._arr.nbytes

    # ------------------------------------------------------------ scalar

    def get(self, fp: int) -> int:
        """The value of ``fp``, or -1 when absent."""
        w, wm = self._w, self._wmask
        i = (fp << 1) & wm
        while True:
            cur = w[i]
            if cur == fp:
                return w[i + 1] if fp else -1
            if not cur:
                return -1
            i = (i + 2) & wm

    def put(self, fp: int, value: int) -> None:
        """Insert ``fp`` with ``value``, or replace the value it has (may double the table)."""
        w, wm = self._w, self._wmask
        i = (fp << 1) & wm
        while True:
            cur = w[i]
            if cur == fp:
                if not fp:
                    raise ValueError("fingerprint 0 marks an empty slot: it cannot be a key")
                w[i + 1] = value  # (OverflowError for a value outside [0, 2**64))
                return
            if not cur:
                break
            i = (i + 2) & wm
        if value < 0:
            raise ValueError(f"values must be >= 0, got {value}")
        if self._len >= self._limit:
            self._rehash(2 * self.capacity)
            w, wm = self._w, self._wmask
            i = (fp << 1) & wm
            while w[i]:
                i = (i + 2) & wm
        w[i + 1] = value
        w[i] = fp
        self._len += 1

    def remove(self, fp: int) -> int:
        """Forget ``fp``; its value, or -1 when absent (backward-shift deletion)."""
        w, wm = self._w, self._wmask
        hole = (fp << 1) & wm
        while True:
            cur = w[hole]
            if cur == fp:
                if not fp:
                    return -1
                break
            if not cur:
                return -1
            hole = (hole + 2) & wm
        value = w[hole + 1]
        w[hole] = 0
        j = hole
        while True:
            j = (j + 2) & wm
            cur = w[j]
            if not cur:
                break
            home = (cur << 1) & wm
            # move slot j back into the hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and hole >= home > j):
                w[hole] = cur
                w[hole + 1] = w[j + 1]
                w[j] = 0
                hole = j
        self._len -= 1
        return value

    # ------------------------------------------------------------ vectorised

    def get_many(self, fps: np.ndarray) -> np.ndarray:
        """Per fp (uint64 array, shape (n,)) its value, int64 with -1 where absent.

        All keys probe together: each round gathers the slot rows of the keys still unresolved
        (one cache line per key), settles hits and empty slots, and advances the rest. Each
        round costs ~15 numpy calls whatever its size, and linear probing leaves a thin tail of
        long chains, so the last ``TAIL`` keys are looked up one by one instead."""
        fps = np.asarray(fps, np.uint64).reshape(-1)
        out = np.full(fps.size, -1, np.int64)
        if not fps.all():  # fp 0 would "hit" the empty slot ending its probe
            keep = fps != 0
            out[keep] = self.get_many(fps[keep])
            return out
        arr, mask = self._arr, self._mask
        slot = (fps & np.uint64(mask)).astype(np.intp)
        pos = np.arange(fps.size)  # positions of the keys still probing
        want = fps
        while True:
            rows = arr.take(slot, 0)  # (m, 2) fp, value (arr[slot] is 8x slower)
            cur = rows[:, 0]
            hit = cur == want
            out[pos[hit]] = rows[:, 1][hit]
            more = cur != 0
            more ^= hit  # (a hit is never an empty slot)
            pos = pos[more]
            if pos.size <= TAIL:
                break
            want = want[more]
            slot = slot[more]
            slot += 1
            slot &= mask
        if pos.size:
            get = self.get
            for p, fp in zip(pos.tolist(), fps[pos].tolist(), strict=True):
                out[p] = get(fp)
        return out

    def put_many(self, fps: np.ndarray, values: np.ndarray) -> None:
        """Insert ``fps`` (uint64, none 0, none in the table, no two alike) with ``values``
        (int64 >= 0), leaving what ``put`` of each in turn leaves but where the table grows: it
        grows first, once, to the capacity those puts end at (a key may then sit elsewhere in
        its probe run, which no lookup can tell). Each key's first empty slot is found at once,
        in numpy rounds as ``get_many``; when two keys would take one slot (the later one, put
        after, probes on) they go one by one."""
        n = len(fps)
        if not n:
            return
        capacity = self.capacity
        while self._len + n - 1 >= int(capacity * MAX_LOAD):  # the load before the last put
            capacity *= 2
        if capacity != self.capacity:
            self._rehash(capacity)
        words, wm = self._arr.reshape(-1), self._wmask
        word = (fps << np.uint64(1)).astype(np.intp) & wm  # each key's home slot's fp word
        at = np.empty(n, np.intp)
        pos = np.arange(n)
        while True:
            empty = words.take(word) == 0
            at[pos[empty]] = word[empty]
            more = ~empty
            pos = pos[more]
            if pos.size <= TAIL:
                break
            word = word[more]
            word += 2
            word &= wm
        w = self._w
        for p, fp in zip(pos.tolist(), fps[pos].tolist(), strict=True):
            i = (fp << 1) & wm
            while w[i]:
                i = (i + 2) & wm
            at[p] = i
        if len(set(at.tolist())) == n:
            words[at + 1] = values.view(np.uint64)
            words[at] = fps
        else:
            for fp, value in zip(fps.tolist(), values.tolist(), strict=True):
                i = (fp << 1) & wm
                while w[i]:
                    i = (i + 2) & wm
                w[i + 1] = value
                w[i] = fp
        self._len += n

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(fps uint64, values int64) of the occupied slots, in slot order (rebuilds, tests)."""
        used = self._arr[:, 0] != 0
        rows = self._arr[used]
        return rows[:, 0].copy(), rows[:, 1].view(np.int64).copy()

    def clear(self) -> None:
        """Drop every entry and go back to the initial capacity."""
        self._w.release()
        self._len = 0
        self._alloc(self._min_capacity)

    # ------------------------------------------------------------ growth

    def _rehash(self, capacity: int) -> None:
        """Move every entry into a fresh array of ``capacity`` slots, vectorised.

        Sorted by home slot, the k-th entry of a linear-probing table without wrap-around sits at
        ``max(home[k], pos[k-1] + 1)`` = ``k + cummax(home - k)[k]``; the few entries that run
        past the last slot are then inserted one by one from their home (wrapping to slot 0)."""
        fps, values = self.items()
        self._w.release()
        self._alloc(capacity)
        home = (fps & np.uint64(self._mask)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        fps, values, home = fps[order], values[order], home[order]
        k = np.arange(fps.size, dtype=np.int64)
        pos = np.maximum.accumulate(home - k) + k
        fits = pos <= self._mask
        arr = self._arr
        arr[pos[fits], 0] = fps[fits]
        arr[pos[fits], 1] = values[fits].view(np.uint64)
        w, wm = self._w, self._wmask
        for fp, value in zip(fps[~fits].tolist(), values[~fits].tolist(), strict=True):
            i = (fp << 1) & wm
            while w[i]:
                i = (i + 2) & wm
            w[i + 1] = value
            w[i] = fp
