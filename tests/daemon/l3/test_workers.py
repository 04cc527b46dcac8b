"""The L3 worker threads: a put asks the store which pages it has already and sends only the
others, on the writer thread (the control loop never waits on the store), and a store that
fails the question still gets every page; lookups (an exists, a get of keys not known to be in
L3) run on the prober thread. Real file backend, real arena, real threads."""

import time

import pytest
from l3_doubles import RecordingBackend, commit_pages, wait_jobs

from hicached.arena import Arena
from hicached.backends.file import file_bytes
from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import ABSENT_TTL_S, L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.slabs import SlabAllocator

PAGE = 4096


@pytest.fixture
def setup(tmp_path, arena):
    def make(exists_fails=False, **options):
        index = PageIndex(SlabAllocator(arena.size_bytes, 64 * PAGE))
        workers = IOWorkers()
        backend = RecordingBackend(str(tmp_path / "l3"), exists_fails, **options)
        backend.open(arena)
        tier = L3Tier(index, workers, backend)
        made.append(workers)
        return index, workers, backend, tier
    made = []
    yield make
    for w in made:
        w.close()


def test_put_sends_only_what_the_store_lacks_from_the_writer_thread(setup, arena):
    index, workers, backend, tier = setup()
    first = commit_pages(index, arena, ["a", "b"], fill=1)
    assert tier.writes.write(first) == 2
    wait_jobs(workers, tier)
    assert backend.sent == ["a", "b"] and all(e.in_l3 for e in first)
    assert tier.counters["l3_writes"] == 2 and workers.bytes_done["put"] == 2 * PAGE
    # a second copy of "a" (say another daemon's L2 flushed and re-stored it) plus a new page
    index.drop(first)
    again = commit_pages(index, arena, ["a", "c"], fill=7)
    backend.sent.clear()
    assert tier.writes.write(again) == 2
    wait_jobs(workers, tier)
    assert backend.sent == ["c"]  # "a" was there already: not sent
    assert all(e.in_l3 for e in again)
    assert tier.counters["l3_writes"] == 3 and workers.bytes_done["put"] == 3 * PAGE
    assert backend.threads == {"hicached-l3-put0"}  # never asked on the caller's thread


def test_a_failing_exists_still_sends_every_page(setup, arena):
    index, workers, backend, tier = setup(exists_fails=True)
    pages = commit_pages(index, arena, ["x", "y"], fill=3)
    tier.writes.write(pages)
    wait_jobs(workers, tier)
    assert backend.sent == ["x", "y"] and all(e.in_l3 for e in pages)
    assert tier.counters["l3_writes"] == 2


@pytest.fixture
def arena(shm_path):
    a = Arena.create(shm_path, 256 * PAGE)
    yield a
    a.close()


def test_a_get_of_pages_known_in_l3_does_not_ask_the_store(setup, arena):
    index, workers, backend, tier = setup()
    pages = commit_pages(index, arena, ["k0", "k1"], fill=5)
    tier.writes.write(pages)
    wait_jobs(workers, tier)
    index.drop(pages)  # L2 flushed: only L3 has them
    backend.asked.clear()
    # one load for the known keys, one lookup (``find``) for the other
    assert len(tier.load(("ns", "kv"), ["k0", "k1", "other"], PAGE, PAGE, waiter=object())) == 2
    wait_jobs(workers, tier)
    assert backend.asked == ["other"]  # only the unknown key is asked about
    assert "hicached-l3-probe0" in backend.threads
    for i, key in enumerate(["k0", "k1"]):
        e = index.get(("ns", "kv"), key)
        assert e is not None and bool((arena.tensor[e.offset:e.offset + PAGE] == 5 + i).all())
    # a key L3 lost since (here: its file removed) is a miss, and asked about next time
    index.drop([index.get(("ns", "kv"), "k0")])
    backend.clear()
    tier.known_in_l3[(("ns", "kv"), "k0")] = None  # clear() forgets; pretend it was not seen
    tier.load(("ns", "kv"), ["k0"], PAGE, PAGE, waiter=object())
    wait_jobs(workers, tier)
    assert index.get(("ns", "kv"), "k0") is None and tier.counters["l3_load_failures"] == 1
    assert (("ns", "kv"), "k0") not in tier.known_in_l3


def collect_all(workers, tier):
    """Every (waiter, job id, follow-up job ids) the tier hands back until no job is left."""
    out = []
    deadline = time.monotonic() + 10
    while workers.in_flight and time.monotonic() < deadline:
        out.extend(tier.collect())
        time.sleep(0.01)
    assert workers.in_flight == 0
    return out


def test_probe_answers_on_the_prober_thread_and_remembers_hits(setup, arena):
    index, workers, backend, tier = setup()
    tier.writes.write(commit_pages(index, arena, ["p0", "p1"], fill=2))
    wait_jobs(workers, tier)
    tier.known_in_l3.clear()
    backend.threads.clear()
    waiter = object()
    job = tier.probe(("ns", "kv"), ["p0", "nope", "p1"], waiter)
    assert job is not None
    woken = collect_all(workers, tier)
    assert woken == [(waiter, id(job), False, set())]
    assert job.result == [True, False, True] and not job.error
    assert backend.threads == {"hicached-l3-probe0"}
    assert tier.is_known(("ns", "kv"), "p0") and not tier.is_known(("ns", "kv"), "nope")


def test_a_failing_probe_is_a_miss_counted_once_as_degraded(setup, arena):
    _, workers, backend, tier = setup(exists_fails=True)
    jobs = [tier.probe(("ns", "kv"), ["a"], object()) for _ in range(2)]
    collect_all(workers, tier)
    assert [j.result for j in jobs] == [[False], [False]]
    assert "injected" in jobs[0].error
    assert tier.counters["l3_errors"] == 2 and tier.status()["degraded"]
    backend.exists_fails = False
    tier.probe(("ns", "kv"), ["a"], object())
    collect_all(workers, tier)
    assert not tier.status()["degraded"]


def test_a_find_starts_the_loads_of_what_the_store_has(setup, arena):
    index, workers, backend, tier = setup()
    pages = commit_pages(index, arena, ["f0", "f1"], fill=9)
    tier.writes.write(pages)
    wait_jobs(workers, tier)
    index.drop(pages)
    tier.known_in_l3.clear()
    backend.asked.clear()
    waiter = object()
    (find_id,) = tier.load(("ns", "kv"), ["f0", "gone", "f1"], PAGE, PAGE, waiter=waiter)
    # a second get of the same keys joins the lookup in flight instead of asking again
    other = object()
    assert tier.load(("ns", "kv"), ["f0"], PAGE, PAGE, waiter=other, start=False) == {find_id}
    woken = collect_all(workers, tier)
    found = [(w, follow) for w, jid, _, follow in woken if jid == find_id]
    assert len(found) == 2 and found[0][1] == found[1][1] and len(found[0][1]) == 1
    (load_id,) = found[0][1]
    assert sorted(w is waiter for w, jid, loaded, _ in woken if jid == load_id and loaded) \
        == [False, True]
    for i, key in enumerate(["f0", "f1"]):
        e = index.get(("ns", "kv"), key)
        assert e is not None and bool((arena.tensor[e.offset:e.offset + PAGE] == 9 + i).all())
    assert index.get(("ns", "kv"), "gone") is None and not tier.loading
    assert backend.asked.count("f0") == 1  # asked once, by the find


def test_a_find_whose_backend_was_detached_loads_nothing(setup, arena):
    index, workers, _, tier = setup()
    tier.writes.write(commit_pages(index, arena, ["d0"], fill=1))
    wait_jobs(workers, tier)
    index.drop([index.get(("ns", "kv"), "d0")])
    tier.known_in_l3.clear()
    (find_id,) = tier.load(("ns", "kv"), ["d0"], PAGE, PAGE, waiter=object())
    tier.detach()
    woken = collect_all(workers, tier)
    assert [(jid, follow) for _, jid, _, follow in woken] == [(find_id, set())]
    assert index.get(("ns", "kv"), "d0") is None and not tier.loading


def test_keys_the_store_lacks_are_not_asked_again_for_a_while(setup, arena):
    index, workers, backend, tier = setup()
    table = ("ns", "kv")
    now = [100.0]
    tier.clock = lambda: now[0]
    tier.probe(table, ["a", "b"], object())
    collect_all(workers, tier)
    assert backend.asked == ["a", "b"]
    # within ABSENT_TTL_S an exists does not ask the store about them again
    assert tier.sort_out(table, ["a", "b", "c"])[1] == ["c"]
    # a get does: it names keys its client was told are stored (by another node, maybe)
    (find_id,) = tier.load(table, ["a"], PAGE, PAGE, waiter=object())
    assert [jid for _, jid, _, _ in collect_all(workers, tier)] == [find_id]
    assert backend.asked == ["a", "b", "a"] and index.get(table, "a") is None
    assert tier.sort_out(table, ["a"])[1] == []  # still absent: remembered again
    # a page this daemon writes is no longer thought absent
    tier.writes.write(commit_pages(index, arena, ["a"], fill=3))
    wait_jobs(workers, tier)
    assert tier.is_known(table, "a") and tier.sort_out(table, ["a", "b"]) == ({"a"}, [])
    # after the TTL the store is asked again (another node may have written it meanwhile)
    now[0] += ABSENT_TTL_S + 0.1
    assert tier.sort_out(table, ["a", "b"]) == ({"a"}, ["b"])
    # the "no" of a store that raised is not remembered
    backend.exists_fails = True
    tier.probe(table, ["b"], object())
    collect_all(workers, tier)
    assert tier.sort_out(table, ["b"])[1] == ["b"]
    # detaching forgets it all
    backend.exists_fails = False
    tier.probe(table, ["b"], object())
    collect_all(workers, tier)
    assert tier.sort_out(table, ["b"])[1] == []
    tier.detach()
    assert not tier.absent_in_l3


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_pages_the_store_evicts_are_no_longer_counted_on(setup, arena, policy):
    """A file L3 with room for 2 pages: writing a third evicts the oldest. The tier stops
    answering exists from its memory of it, and the L2 page is no longer clean: under
    write_back it is dirty again (pinned, written when L2 needs room), as L2 holds its only
    copy."""
    index, workers, backend, tier = setup(capacity=2 * file_bytes("a", PAGE), min_free=0)
    tier.write_policy = policy
    table = ("ns", "kv")
    first = commit_pages(index, arena, ["a", "b"], fill=1)
    assert tier.writes.write(first) == 2
    wait_jobs(workers, tier)
    assert tier.is_known(table, "a") and all(e.in_l3 for e in first)
    third = commit_pages(index, arena, ["c"], fill=5)
    assert tier.writes.write(third) == 1
    wait_jobs(workers, tier)
    assert backend.exists("ns", "kv", ["a", "b", "c"]) == [False, True, True]
    assert not tier.is_known(table, "a") and tier.is_known(table, "c")
    a = index.get(table, "a")
    assert not a.in_l3 and index.get(table, "b").in_l3
    if policy == "write_back":
        assert a in tier.writes.dirty and a.pins == 1
    else:
        assert a not in tier.writes.dirty and a.pins == 0
    assert backend.take_evicted() == []  # each eviction is told once
