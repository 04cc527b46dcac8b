"""Huge calls in slices of the control loop, so that one client's 16k-key call does not stall
every other client's small ones.

The control loop is one thread: a request it works on holds every other request back. A call of
16k pages costs it 40-80 ms (a Lease, a Commit, a Reserve), 400 ms and more when the Reserve
must evict for its slots; the other clients' calls of a few pages, a fraction of a millisecond
each, waited that long behind it. So the controller's paths for Exists, Reserve, Commit and
Lease (and the Release of a lease) are generators ("steps") that yield between chunks of
``CHUNK_KEYS`` keys, at points where the index is consistent:

  a call of at most SLICE_KEYS keys (and released pages)   run to its end at once: no pause
  a larger one                                             a ``SlicedCall``: at most
                                                           ``slice_s`` of it per turn of the
                                                           loop (one chunk once a request
                                                           waits), the other clients'
                                                           requests served between two slices

One code path for both (``drive`` runs the steps without pausing), so a sliced call answers
what the unsliced one answers, and leaves the same state, when nothing else runs between its
slices (but for the recency of a sliced commit's pages: published from the deep end of its
chain, they are recent in that order); what may run between them is another client's request,
which sees the call's keys each either before or after the call worked on them, as it would see
them before or after an unsliced call, and a key's pages of every pool together (what each call
keeps true between its slices: ``set_control.py`` and ``controller.py``). Still at once: the
decoding of a request and the encoding of its answer, and an Exists's and a Lease's share of L3
(the keys to ask the store about or to load).

A client's requests stay in order: while a call of one client (one socket identity) is sliced,
the later requests of that identity wait here (``hold``) and are handled, in order, once it is
answered. Sliced calls of several clients take turns, a slice each.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

from hicached import protocol as P
from hicached.errors import HicachedError

log = logging.getLogger(__name__)

SLICE_S = 0.001  # work of a sliced call per turn of the loop: what another request may wait
SLICE_KEYS = 1024  # a call of more keys (and released pages) than this is sliced
CHUNK_KEYS = 256  # keys between two points where a sliced call may pause (~0.5 ms of a Lease
#                   or a Commit; a Reserve starts at a quarter and fits its chunks: ``fit_chunk``)
MAX_HELD = 4096  # requests of one client waiting behind its sliced call (more: refused)
CHUNK_S = 0.001  # a chunk of a call whose keys cost unevenly (a Reserve that evicts): its aim
MIN_CHUNK_KEYS = 8
CHEAP_CHUNKS = 4  # where keys cost little (an Exists's lookups, a Release's unpins), a chunk
#                    grows to this many chunks' keys while it takes under ``CHUNK_S``

Steps = Generator[None, None, Any]


def drive(steps: Steps) -> Any:
    """Run ``steps`` to its end at once; what it returns."""
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


def fit_chunk(chunk: int, keys: int, took_s: float) -> int:
    """The keys of a call's next chunk, after ``keys`` took ``took_s``: as many as take about
    ``CHUNK_S`` at that pace, between ``MIN_CHUNK_KEYS`` and ``chunk`` (a Reserve that must
    evict pays 25 us to a few hundred a page: 128 of them would be one long pause)."""
    if took_s <= 0 or not keys:
        return chunk
    return max(min(MIN_CHUNK_KEYS, chunk), min(chunk, int(keys * CHUNK_S / took_s)))


def call_keys(msg: Any) -> int:
    """The keys a request names (every transfer's; an Exists's list)."""
    match msg:
        case P.Exists():
            return len(msg.keys) or msg.packed.count(b"\0") + bool(msg.packed)
        case P.Reserve() | P.Lease():
            return sum(len(t.keys) for t in msg.transfers)
        case P.Commit():
            return sum(len(row) for row in msg.ok)
    return 0


def key_chunks(key_lists: list[list[str]], chunk: int) -> list[list[tuple[int, Sequence[int]]]]:
    """The positions of ``key_lists`` (a call's transfers) in chunks of at most ``chunk``
    distinct keys, each chunk a list of (transfer, its positions there, ascending): a key's
    positions in every transfer fall in one chunk, the keys taken in the order they first
    come (the first transfer's, then the others')."""
    first = key_lists[0] if key_lists else []
    if all(keys is first or keys == first for keys in key_lists):  # (one list, or the same)
        n = len(first)
        return [[(p, range(lo, min(n, lo + chunk))) for p in range(len(key_lists))]
                for lo in range(0, n, chunk)]
    rank: dict[str, int] = {}
    for keys in key_lists:
        for k in keys:
            rank.setdefault(k, len(rank))
    out: list[list[tuple[int, Sequence[int]]]] = [[] for _ in range(-(-len(rank) // chunk))]
    for p, keys in enumerate(key_lists):
        at: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            at.setdefault(rank[k] // chunk, []).append(i)
        for c, positions in at.items():
            out[c].append((p, positions))
    return out


def as_answer(msg: Any, result: Any) -> Any:
    """What a sliced call's ``done`` got (an answer, or the exception its steps raised) as the
    answer to ``msg``: an exception becomes an ``Error``, as ``Daemon._handle`` makes it."""
    if isinstance(result, HicachedError):
        return P.Error(msg.req_id, result.code, str(result))
    if isinstance(result, Exception):
        return P.Error(msg.req_id, "internal", f"{type(result).__name__}: {result}")
    return result


class SlicedCall:
    """One call worked in slices: its ``steps``; ``done(result)`` gets what they returned, or
    the exception they raised; ``identity``: the client whose later requests wait for it
    (None: none wait, e.g. the late answer of a parked get)."""

    __slots__ = ("steps", "done", "identity", "what", "slices", "started")

    def __init__(self, steps: Steps, done: Callable[[Any], None], identity: bytes | None,
                 what: str, started: float):
        self.steps = steps
        self.done = done
        self.identity = identity
        self.what = what
        self.slices = 0
        self.started = started


class Slicer:
    """The sliced calls under way, and the requests held behind them. Only the control loop
    calls it; ``Daemon.serve_forever`` calls ``step`` while ``active``."""

    def __init__(self, slice_s: float = SLICE_S, slice_keys: int = SLICE_KEYS,
                 chunk_keys: int = CHUNK_KEYS, clock: Callable[[], float] = time.perf_counter,
                 waiting: Callable[[], bool] = lambda: False):
        """``waiting()``: a request waits in the socket (the daemon's): a slice ends after the
        chunk under way then, so a request waits for at most one chunk of a huge call."""
        if chunk_keys < 1 or slice_keys < chunk_keys:
            raise ValueError(f"chunk_keys {chunk_keys} must be >= 1 and <= slice_keys "
                             f"{slice_keys}")
        self.slice_s = slice_s
        self.slice_keys = slice_keys
        self.chunk_keys = chunk_keys
        self.clock = clock
        self.calls: deque[SlicedCall] = deque()
        self.busy: dict[bytes, int] = {}  # identity -> its sliced calls under way
        self.held: dict[bytes, deque] = {}  # identity -> requests waiting behind its call
        self.counters = {"sliced_calls": 0, "slices": 0, "held_requests": 0,
                         "refused_requests": 0}
        self.waiting = waiting

    @property
    def active(self) -> bool:
        return bool(self.calls)

    def chunk(self, size: int) -> int | None:
        """The chunk a call of ``size`` keys (and released pages) is worked in: None (all at
        once) when it is small."""
        return self.chunk_keys if size > self.slice_keys else None

    def start(self, steps: Steps, done: Callable[[Any], None], identity: bytes | None = None,
              what: str = "") -> None:
        """Work ``steps`` in slices from the next turn of the loop; ``done`` as in
        ``SlicedCall``."""
        self.calls.append(SlicedCall(steps, done, identity, what, self.clock()))
        self.counters["sliced_calls"] += 1
        if identity is not None:
            self.busy[identity] = self.busy.get(identity, 0) + 1

    # ------------------------------------------------------------ requests held

    def holds(self, identity: bytes) -> bool:
        """Whether requests of ``identity`` must wait (a call of its is being sliced)."""
        return identity in self.busy

    def hold(self, identity: bytes, frame: Any) -> bool:
        """Keep a request of ``identity`` until its sliced call is answered; False (not kept)
        past ``MAX_HELD`` of them: the caller refuses it."""
        q = self.held.setdefault(identity, deque())
        if len(q) >= MAX_HELD:
            self.counters["refused_requests"] += 1
            return False
        q.append(frame)
        self.counters["held_requests"] += 1
        return True

    def next_held(self, identity: bytes) -> Any | None:
        """The oldest request held for ``identity`` if it may go now (no call of its is being
        sliced), else None."""
        if identity in self.busy:
            return None
        q = self.held.get(identity)
        if not q:
            return None
        frame = q.popleft()
        if not q:
            del self.held[identity]
        return frame

    # ------------------------------------------------------------ slices

    def step(self) -> None:
        """One slice of the call whose turn it is: one chunk at least, then more until
        ``slice_s`` has passed or a request waits."""
        if not self.calls:
            return
        call = self.calls.popleft()
        call.slices += 1
        self.counters["slices"] += 1
        deadline = self.clock() + self.slice_s
        waiting = self.waiting
        try:
            while True:
                next(call.steps)
                if self.clock() >= deadline or waiting():
                    break
        except StopIteration as stop:
            self._finish(call, stop.value)
            return
        except Exception as e:  # a typed error is the caller's answer; a bug costs this call
            if not isinstance(e, HicachedError):
                log.exception("internal error in a sliced %s", call.what or "call")
            self._finish(call, e)
            return
        self.calls.append(call)  # the others' turn

    def _finish(self, call: SlicedCall, result: Any) -> None:
        if call.identity is not None:
            n = self.busy[call.identity] - 1
            if n:
                self.busy[call.identity] = n
            else:
                del self.busy[call.identity]
        try:
            call.done(result)
        except Exception:  # one caller's bug must not cost the others their answers
            log.exception("answering a sliced %s failed", call.what or "call")

    def finish_now(self) -> None:
        """Work every call under way to its end at once (shutdown)."""
        slice_s, self.slice_s = self.slice_s, float("inf")
        waiting, self.waiting = self.waiting, lambda: False
        try:
            while self.calls:
                self.step()
        finally:
            self.slice_s, self.waiting = slice_s, waiting

    def status(self) -> dict:
        """The calls under way (stats, ``hicached status``) and the counters."""
        now = self.clock()
        return {"calls": [{"what": c.what, "slices": c.slices,
                           "seconds": round(now - c.started, 3)} for c in self.calls],
                "held": sum(len(q) for q in self.held.values()), **self.counters}
