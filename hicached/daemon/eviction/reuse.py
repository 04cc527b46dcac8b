"""Which new pages are seldom read again: classes of what a store sees, learned as it goes.

Issue 48's "visible" analysis on Mooncake's traces (``tools/trace_features.py``): when a call
stores new keys, three things a store sees say much of whether they will be read again: how
many keys the call stores (``new``), how long since the key they hang from was used before
(``gap``: in page uses, so a replay's speed changes nothing; none for a new root), and each
key's depth. Per class (the three, bucketed) this module counts the KV pages stored and those
read at least once since (a class not seen yet counts as read: ``(reads + 1) / (stored + 2)``);
a new page whose class reads again less often than ``THETA`` is *demoted*: the policy queues it
as if it were used ``DEMOTE_TICKS`` page uses earlier, and ranks demoted candidates before the
others, so it goes before any page that is not (LRU's insertion at the LRU end, for the classes
that earned it; among demoted pages, their order of use), until it is read. In the simulation
(``trace_features.py``'s rule, the gap in page uses) a fixed ``THETA`` of 0.05 on these three
features gains 1.36x / 1.05x / 1.02x LRU at 2 / 5 / 10 % of conversation's working set
(attention-only) and never falls more than 0.004 below on either trace; through real daemons it
falls up to 4 % below on the synthetic trace, so it is the ``demote`` policy, not the default.

``ReuseClasses`` is owned by a ``HybridPolicy`` (``hybrid.py``; ``demote.py`` gives it one),
which tells it what the index told the policy; ``NoReuse`` is the Null one (``hybrid``,
``prefix``). Arrays indexed by page record (``grow``) and key record (``grow_keys``); nothing of
the index is mutated.
"""

from __future__ import annotations

import numpy as np

from hicached.daemon.columns import grown

THETA = 0.05  # a class read again less often than this is demoted
DEMOTE_TICKS = 1 << 40  # a demoted page is queued as if used that many page uses earlier
GAP_TICKS = np.array([64, 512, 4096, 16384, 65536], np.int64)  # page uses: the gap's buckets
_DEPTHS, _GAPS, _NEWS = 10, len(GAP_TICKS) + 2, 10  # buckets of each feature
CLASSES = _NEWS * _GAPS * _DEPTHS


def _log2b(n: np.ndarray) -> np.ndarray:
    """0 for n <= 0, else the bit length of n, at most 9 (int64 in, int64 out)."""
    n = np.maximum(n, 0)
    out = np.zeros(n.shape, np.int64)
    nz = n > 0
    out[nz] = np.minimum(9, np.floor(np.log2(n[nz])).astype(np.int64) + 1)
    return out


class ReuseClasses:
    """The demotion rule (module docstring). ``stored`` / ``read`` / ``removed`` as the index
    tells the policy; ``demoted`` per page record. O(pages of the call), numpy."""

    #: whether ``stored`` / ``read`` learn anything (``NoReuse``: no, and nothing is ever
    #: demoted: its owner may skip building their arguments)
    learns = True

    def __init__(self, theta: float = THETA):
        self.theta = float(theta)
        self._pcls = np.zeros(0, np.int16)  # page -> its class + 1 until first read (0: none)
        self._pdem = np.zeros(0, np.bool_)  # page -> demoted (until read or removed)
        self._kuse = np.zeros(0, np.int64)  # key -> tick of its last use
        self._kprev = np.zeros(0, np.int64)  # key -> tick of the use before (the gap's start)
        self.stored_pages = np.zeros(CLASSES, np.int64)
        self.read_pages = np.zeros(CLASSES, np.int64)
        self.demoted_pages = 0  # pages demoted so far (stats, tests)

    def grow(self, n: int) -> None:
        """Page records now number ``n``."""
        self._pcls = grown(self._pcls, n, np.int16)
        self._pdem = grown(self._pdem, n, np.bool_)

    def grow_keys(self, n: int) -> None:
        """Key records now number ``n``."""
        self._kuse = grown(self._kuse, n, np.int64)
        self._kprev = grown(self._kprev, n, np.int64)

    def demoted(self, p: int) -> bool:
        """Whether page record ``p`` is queued as used at tick 0."""
        return bool(self._pdem[p])

    def frequency(self) -> np.ndarray:
        """Per class, its read-again frequency learned so far (float64, ``CLASSES``)."""
        return (self.read_pages + 1) / (self.stored_pages + 2)

    def stored(self, ps: np.ndarray, krecs: np.ndarray, new: np.ndarray, states: np.ndarray,
               depth: np.ndarray, parent: int, tick: int) -> None:
        """A call committed pages ``ps`` (int64) of keys ``krecs``; ``new``: per page, whether
        its key had no page before the call; ``states``: per page, a trailing pool's;
        ``depth``: per page, its key's depth (-1: unknown); ``parent``: the key record the
        call's first new key hangs from (-1: a root, or not in L2); ``tick``: now. The new
        keys' KV pages count in their class; every page of a new key whose class is below
        ``theta`` is demoted."""
        self._kuse[krecs] = tick
        self._kprev[krecs[new]] = tick
        if not new.any():
            return
        ps, krecs, states, depth = ps[new], krecs[new], states[new], depth[new]
        n_new = len(np.unique(krecs))
        if parent >= 0:
            g = tick - int(self._kprev[parent])
            gap = 1 + int(np.searchsorted(GAP_TICKS, g, side="right"))
        else:
            gap = 0
        base = (int(_log2b(np.array([n_new]))[0]) * _GAPS + gap) * _DEPTHS
        cls = base + _log2b(depth.astype(np.int64))
        kv = ~states
        np.add.at(self.stored_pages, cls[kv], 1)
        self._pcls[ps[kv]] = cls[kv] + 1
        dem = self.frequency()[cls] < self.theta
        if dem.any():
            self._pdem[ps[dem]] = True
            self.demoted_pages += int(np.count_nonzero(dem))

    def stored_one(self, p: int, k: int, new: bool, state: bool, depth: int, parent: int,
                   tick: int) -> None:
        """``stored`` of a call of one page (scalars: no numpy on the one-page path)."""
        self._kuse[k] = tick
        if not new:
            return
        self._kprev[k] = tick
        gap = 0 if parent < 0 else 1 + int(np.searchsorted(
            GAP_TICKS, tick - int(self._kprev[parent]), side="right"))
        c = (1 * _GAPS + gap) * _DEPTHS + (min(9, depth.bit_length()) if depth > 0 else 0)
        if not state:
            self.stored_pages[c] += 1
            self._pcls[p] = c + 1
        if (self.read_pages[c] + 1) / (self.stored_pages[c] + 2) < self.theta:
            self._pdem[p] = True
            self.demoted_pages += 1

    def read_one(self, p: int, k: int, tick: int) -> None:
        """``read`` of one page (scalars)."""
        c = int(self._pcls[p])
        if c:
            self.read_pages[c - 1] += 1
            self._pcls[p] = 0
        self._pdem[p] = False
        if self._kuse[k] != tick:
            self._kprev[k] = self._kuse[k]
            self._kuse[k] = tick

    def read(self, ps: np.ndarray, krecs: np.ndarray, tick: int) -> None:
        """Pages ``ps`` (int64) of keys ``krecs`` were used (a get, a touch) at ``tick``: the
        first read of a page counts in its class; none of them is demoted any more."""
        first = self._pcls[ps] > 0
        if first.any():
            once = np.unique(ps[first])  # (a page may come twice in a call)
            np.add.at(self.read_pages, self._pcls[once].astype(np.int64) - 1, 1)
            self._pcls[once] = 0
        self._pdem[ps] = False
        keys = np.unique(krecs)
        moved = self._kuse[keys] != tick
        keys = keys[moved]
        self._kprev[keys] = self._kuse[keys]
        self._kuse[keys] = tick

    def removed(self, p: int) -> None:
        """Page record ``p`` left L2 (its record may be reused)."""
        self._pcls[p] = 0
        self._pdem[p] = False


class NoReuse(ReuseClasses):
    """The Null rule: nothing is demoted, nothing counted (``prefix``)."""

    learns = False

    def grow(self, n: int) -> None:
        self._pdem = grown(self._pdem, n, np.bool_)

    def grow_keys(self, n: int) -> None:
        pass

    def stored(self, ps, krecs, new, states, depth, parent, tick) -> None:
        pass

    def read(self, ps, krecs, tick) -> None:
        pass

    def stored_one(self, p, k, new, state, depth, parent, tick) -> None:
        pass

    def read_one(self, p, k, tick) -> None:
        pass

    def removed(self, p: int) -> None:
        pass
