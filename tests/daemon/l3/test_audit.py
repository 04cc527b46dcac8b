"""The audit of L3 copies (``daemon/l3/audit.py``): a store that evicts pages without telling the
daemon (Mooncake, another 3FS node) must not make the daemon lose the pages L2 evicts next.
Here the store is the real file backend with room for 2 pages and its ``take_evicted`` silenced;
``test_mooncake.py`` has a real daemon on a real ``mooncake_master`` whose pages another client
removes."""

import pytest
from l3_doubles import RecordingBackend, commit_pages, wait_jobs

from hicached.backends.file import file_bytes
from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.slabs import SlabAllocator

PAGE = 4096
TABLE = ("ns", "kv")


class SilentStore(RecordingBackend):
    """The file L3, evicting as it does but telling nobody (as Mooncake evicts)."""

    def take_evicted(self):
        super().take_evicted()
        return []


@pytest.fixture
def silent(tmp_path, arena):
    workers = IOWorkers()
    index = PageIndex(SlabAllocator(arena.size_bytes, 64 * PAGE))
    backend = SilentStore(str(tmp_path / "l3"), capacity=2 * file_bytes("a", PAGE), min_free=0)
    backend.open(arena)
    tier = L3Tier(index, workers, backend, audit_s=5.0)
    yield index, workers, backend, tier
    workers.close()
    backend.close()


def run_audit(tier, workers, now):
    asked = tier.auditor.audit(now)
    wait_jobs(workers, tier)
    return asked


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_pages_the_store_evicted_silently_are_written_again_or_dirty(silent, arena, policy):
    index, workers, backend, tier = silent
    tier.write_policy = policy
    first = commit_pages(index, arena, ["a", "b"], fill=1)
    assert tier.writes.write(first) == 2
    wait_jobs(workers, tier)
    c = commit_pages(index, arena, ["c"], fill=5)
    assert tier.writes.write(c) == 1
    wait_jobs(workers, tier)
    assert backend.exists("ns", "kv", ["a", "b", "c"]) == [False, True, True]
    a, b = index.get(TABLE, "a"), index.get(TABLE, "b")
    assert a.in_l3 and tier.is_known(TABLE, "a")  # the daemon was not told
    index.touch(b)  # b is hot in L2, a the next to go
    b.hits = 5
    a.hits = 5 if policy == "write_through_selective" else 0
    assert run_audit(tier, workers, 100.0) == 3  # the oldest pages known to be in L3
    assert tier.counters["l3_copies_lost"] == 1
    if policy == "write_back":  # dirty again: pinned, written when L2 needs its room
        assert not a.in_l3 and a in tier.writes.dirty and a.pins == 1
        assert not tier.is_known(TABLE, "a")
        assert backend.exists("ns", "kv", ["a"]) == [False]
        assert tier.writes.write_back_all() == 1
        wait_jobs(workers, tier)
    # written again (the store evicts its oldest, b, to make room: the next audit sees that)
    assert a.in_l3 and tier.is_known(TABLE, "a") and backend.exists("ns", "kv", ["a"]) == [True]
    assert run_audit(tier, workers, 200.0) == 3
    assert tier.counters["l3_copies_lost"] == 2
    assert b.in_l3 == (policy != "write_back")
    assert (b in tier.writes.dirty) == (policy == "write_back")


def test_an_audit_runs_only_when_due_and_a_failing_store_changes_nothing(silent, arena):
    index, workers, backend, tier = silent
    pages = commit_pages(index, arena, ["a", "b"], fill=1)
    tier.writes.write(pages)
    wait_jobs(workers, tier)
    assert run_audit(tier, workers, 100.0) == 2
    assert run_audit(tier, workers, 104.0) == 0  # due every audit_s (5 s)
    backend.exists_fails = True
    for e in pages:
        index.drop_one(e)  # (files still there; make the store fail to answer instead)
    pages = commit_pages(index, arena, ["a", "b"], fill=1)
    for e in pages:
        e.in_l3 = True
    assert run_audit(tier, workers, 106.0) == 2
    assert all(e.in_l3 for e in pages) and tier.counters["l3_copies_lost"] == 0
    tier.auditor.audit_s = 0  # off
    assert run_audit(tier, workers, 1000.0) == 0


def test_an_audit_looks_only_at_the_pages_l2_evicts_next(silent, arena, monkeypatch):
    """Only the first ``AUDIT_WINDOW`` unpinned pages of a class: a copy further on is not at
    risk yet, and walking a whole LRU every audit_s stalled the control loop (0.2 s for a
    million pages none of which were in L3)."""
    from hicached.daemon.l3 import audit as tier_audit
    monkeypatch.setattr(tier_audit, "AUDIT_WINDOW", 2)
    index, workers, backend, tier = silent
    a, _, c = commit_pages(index, arena, ["a", "b", "c"], fill=1)
    c.in_l3 = True  # (not written: the store is asked about c only)
    assert run_audit(tier, workers, 100.0) == 0  # a and b go first
    index.pin(a)  # pinned pages are passed over, as eviction passes over them
    assert run_audit(tier, workers, 200.0) == 1
    assert tier.counters["l3_copies_lost"] == 1  # (and written again: write_through)
    assert c.in_l3 and backend.exists("ns", "kv", ["a", "b", "c"]) == [False, False, True]
    index.unpin(a)
