"""Answer first, keep the books after (``Controller.later`` / ``keep_books``): a run of reserves,
commits, gets and releases whose bookkeeping waits for ``keep_books`` (as the daemon runs it,
after each answer) gives the same answers and leaves, after each call, exactly the state of
the run that keeps its books at once; the pages a lease serves are pinned before its answer.
And the columns the index's records live in (``columns.py``)."""

import random

import numpy as np
import pytest

from hicached import protocol as P
from hicached.daemon.columns import MAPPED_MIN, grown, zeros
from hicached.daemon.controller import Controller
from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.leases import LeaseTable
from hicached.daemon.sessions import Session, namespace_digest
from hicached.daemon.slabs import SlabAllocator
from hicached.presence import PresenceTable
from tests.daemon.test_index_batch import snapshot


def books_run(tmp_path, deferred: bool, policy: str) -> tuple[list, list]:
    """A seeded run through ``Controller``: sets (chains with parents, keys present, set-ahead
    slots asked for or not, evictions), gets of stored and missing keys, releases. With
    ``deferred`` the controller queues its books, kept after each call. The answers, and the
    state after each call."""
    shared = PresenceTable(str(tmp_path / f"b{deferred}{policy}"), 2048, 1)
    ix = PageIndex(SlabAllocator(48 * 4096, 4096), policy=make_policy(policy), presence=shared)
    ix.records.gen = 0
    workers = IOWorkers()
    ctl = Controller(ix, LeaseTable(ix, 60.0, 60.0), L3Tier(ix, workers), lambda: 0.0,
                     ahead_session_bytes=8 * 256, ahead_total_bytes=1 << 20,
                     books=[] if deferred else None)
    sessions = [Session(i + 1, name, namespace_digest(name), 1, name)
                for i, name in enumerate(("a", "b"))]
    for s in sessions:
        ctl.sessions[s.id] = s
        ctl.register_pool(s, "kv", 256)
        ctl.register_pool(s, "mamba", 512)
    rng = random.Random(5)
    stored: list[str] = []
    leases: list[tuple[Session, int]] = []
    answers, states, queued = [], [], []

    def done(answer) -> None:
        if deferred:
            queued.extend(fn.__name__ for fn, _ in ctl.books)
            ctl.keep_books()
        answers.append(answer)
        states.append(snapshot(ix, shared))

    for step in range(80):
        s = rng.choice(sessions)
        if stored and rng.random() < 0.4:  # a get: stored keys (some evicted since), a miss
            keys = rng.sample(stored, min(len(stored), rng.choice([3, 16]))) + ["never"]
            got = ctl.lease(s, P.Lease(step, s.id, [P.PoolKeys("kv", keys)]), None)
            if got.lease_id:
                leased = [e for e in ctl.leases.leases[got.lease_id].entries]
                assert all(e.pins > 0 for e in leased)  # pinned before the answer
                leases.append((s, got.lease_id))
            done((got.lease_id != 0, got.offsets, got.tags))
            continue
        if leases and rng.random() < 0.5:
            s2, lid = leases.pop(rng.randrange(len(leases)))
            ctl.release(s2, [lid])
            done(lid)
        n = rng.choice([3, 16, 40])
        keys = [f"{rng.getrandbits(256):064x}" for _ in range(n)]
        if stored and rng.random() < 0.3:
            keys[1:1] = rng.sample(stored, min(4, len(stored)))  # present
        transfers = [P.PoolKeys("kv", keys)]
        if rng.random() < 0.3:
            transfers.append(P.PoolKeys("mamba", keys[-1:]))
        parent = rng.choice(stored) if stored and rng.random() < 0.5 else ""
        msg = P.Reserve(step, s.id, transfers, want_ahead=rng.choice([[], [], [2]]),
                        trailing=["mamba"], parent=parent, depth=rng.randrange(1, 9) if parent
                        else -1)
        r = ctl.sets.reserve(s, msg)
        done((r.reservation_id != 0, r.offsets, r.tags, r.ahead))
        ok = [[off >= 0 for off in row] for row in r.offsets]
        c = ctl.sets.commit(s, P.Commit(0, s.id, r.reservation_id, ok))
        done(c.stored)
        stored += keys
    assert ix.evictions
    if deferred:  # the books that waited for the answers
        assert {"read_many", "link"} <= set(queued), set(queued)
    workers.close()
    shared.close()
    return answers, states


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_books_kept_after_the_answer_leave_the_state_of_books_kept_at_once(tmp_path, policy):
    now = books_run(tmp_path, False, policy)
    after = books_run(tmp_path, True, policy)
    assert now[0] == after[0]
    assert len(now[1]) == len(after[1])
    for i, (a, b) in enumerate(zip(now[1], after[1], strict=True)):
        diff = [k for k in a if a[k] != b[k]]
        assert not diff, (i, diff)


def test_later_runs_at_once_without_books_and_in_order_with_them(tmp_path):
    ix = PageIndex(SlabAllocator(4 * 4096, 4096))
    at_once = Controller(ix, LeaseTable(ix, 60.0, 60.0), L3Tier(ix, IOWorkers()), lambda: 0.0)
    seen = []
    at_once.later(seen.append, 1)
    assert seen == [1]
    ctl = Controller(ix, LeaseTable(ix, 60.0, 60.0), L3Tier(ix, IOWorkers()), lambda: 0.0,
                     books=[])
    ctl.later(seen.append, 2)
    ctl.later(lambda: ctl.later(seen.append, 4))  # a step that queues another
    ctl.later(seen.append, 3)
    assert seen == [1]
    ctl.keep_books()
    assert seen == [1, 2, 3, 4] and ctl.books == []


def test_a_failing_step_is_logged_and_the_others_run(tmp_path, caplog):
    ix = PageIndex(SlabAllocator(4 * 4096, 4096))
    ctl = Controller(ix, LeaseTable(ix, 60.0, 60.0), L3Tier(ix, IOWorkers()), lambda: 0.0,
                     books=[])
    seen = []
    ctl.later(lambda: 1 / 0)
    ctl.later(seen.append, 2)
    ctl.keep_books()
    assert seen == [2] and ctl.books == []
    assert "keeping the books" in caplog.text


@pytest.mark.parametrize("n", [1, MAPPED_MIN // 8 - 1, MAPPED_MIN // 8, 3 * MAPPED_MIN])
def test_columns_are_zeroed_writable_and_keep_their_items_when_grown(n):
    a = zeros(n, np.int64)
    assert a.dtype == np.int64 and a.shape == (n,) and a.flags.c_contiguous
    assert a.flags.writeable and not a.any()
    a[:] = np.arange(n)
    view = memoryview(a)  # the index reads and writes them through memoryviews
    b = grown(view, 2 * n + 5, np.int64)
    assert b.tolist() == list(range(n)) + [0] * (n + 5)
    assert grown((), 3, np.uint8).tolist() == [0, 0, 0]
    rows = zeros((n, 2), np.uint64)  # (the key table's shape)
    assert rows.shape == (n, 2) and not rows.any()
