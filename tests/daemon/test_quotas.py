"""Per-namespace L2 quotas on a real index: exact eviction order within the namespace, pinned
pages, other namespaces untouched, byte accounting, quota changes."""

from hicached.daemon.index import PageIndex
from hicached.daemon.quotas import NamespaceQuotas, NoQuotas, make_quotas
from hicached.daemon.sessions import namespace_digest
from hicached.daemon.slabs import SlabAllocator

PAGE = 256
A, B = namespace_digest("tenant-a"), namespace_digest("tenant-b")


def setup(quota_pages=4):
    index = PageIndex(SlabAllocator(64 * 1024, 4096))
    quotas = NamespaceQuotas(index, {"tenant-a": quota_pages * PAGE})
    return index, quotas


def put(index, quotas, ns, key):
    """What Controller.reserve does for one new key, then commit."""
    if not quotas.admit(ns, PAGE):
        return None
    e = index.reserve((ns, "kv"), key, PAGE, PAGE)
    index.commit(e)
    return e


def keys_of(index, ns):
    return sorted(k for (n, _), t in index.tables.items() if n == ns for k in t)


def test_own_lru_pages_go_first_and_other_namespaces_are_untouched():
    index, q = setup()
    for i in range(4):
        assert put(index, q, A, f"a{i}")
    for i in range(10):
        assert put(index, q, B, f"b{i}")  # no quota: never limited by tenant-a's
    assert index.ns_bytes == {A: 4 * PAGE, B: 10 * PAGE}
    index.touch(index.get((A, "kv"), "a0"))  # a0 is now the most recently used
    assert put(index, q, A, "a4")
    assert keys_of(index, A) == ["a0", "a2", "a3", "a4"]  # a1 was the LRU page
    assert put(index, q, A, "a5")
    assert keys_of(index, A) == ["a0", "a3", "a4", "a5"]
    assert put(index, q, A, "a6")
    assert keys_of(index, A) == ["a0", "a4", "a5", "a6"]  # a0 only after a2, a3 (touched)
    assert put(index, q, A, "a7")
    assert keys_of(index, A) == ["a4", "a5", "a6", "a7"]
    assert len(keys_of(index, B)) == 10
    assert index.ns_bytes[A] == 4 * PAGE and index.evictions == 4
    assert q.snapshot() == [{"namespace": "tenant-a", "digest": A, "used_bytes": 4 * PAGE,
                             "quota_bytes": 4 * PAGE, "evictions": 4, "rejections": 0}]


def test_pinned_pages_are_skipped_then_no_space():
    index, q = setup(quota_pages=3)
    entries = [put(index, q, A, f"a{i}") for i in range(3)]
    index.pin(entries[0])  # a lease on the oldest page
    assert put(index, q, A, "a3")
    assert keys_of(index, A) == ["a0", "a2", "a3"]  # a1 went, a0 is pinned
    index.pin(index.get((A, "kv"), "a2"))
    index.pin(index.get((A, "kv"), "a3"))
    assert put(index, q, A, "a4") is None  # everything of tenant-a is pinned
    assert q.snapshot()[0]["rejections"] == 1
    index.unpin(entries[0])
    assert put(index, q, A, "a5")  # the oldest page, free again, is first in line
    assert keys_of(index, A) == ["a2", "a3", "a5"]


def test_pending_pages_count_and_aborts_free_their_bytes():
    index, q = setup(quota_pages=2)
    assert q.admit(A, PAGE)
    e1 = index.reserve((A, "kv"), "p1", PAGE, PAGE)
    assert q.admit(A, PAGE)
    e2 = index.reserve((A, "kv"), "p2", PAGE, PAGE)
    assert index.ns_bytes[A] == 2 * PAGE
    assert not q.admit(A, PAGE)  # both pending (pinned): nothing to evict
    index.abort(e1)
    assert index.ns_bytes[A] == PAGE and q.admit(A, PAGE)
    index.commit(e2)
    assert q.admit(A, 3 * PAGE) is False  # larger than the whole quota: never evicts
    assert keys_of(index, A) == ["p2"]


def test_quota_changes_and_no_quotas():
    index, q = setup(quota_pages=4)
    for i in range(4):
        put(index, q, A, f"a{i}")
    q.set_quotas({"tenant-a": 2 * PAGE, "tenant-b": PAGE})
    assert put(index, q, A, "a4")  # a lowered quota is enforced at the next write
    assert keys_of(index, A) == ["a3", "a4"]
    assert [s["namespace"] for s in q.snapshot()] == ["tenant-a", "tenant-b"]
    assert type(make_quotas(index, {})) is NoQuotas
    assert NoQuotas().admit(A, 10**12) and NoQuotas().snapshot() == []
