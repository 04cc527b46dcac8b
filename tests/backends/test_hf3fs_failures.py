"""The 3FS backend when things fail: pointers left dangling (a failed eviction, a segment
deleted or cut under them) heal after one miss; a segment that cannot be created or opened, a
vanished root, the generation counter's end and a failed attach degrade to misses or eviction."""

import os

import pytest
from test_hf3fs import capacity_for, fill, make, same

P = 4096


def test_a_pointer_left_by_a_failed_eviction_is_repaired_after_one_miss(arena, tmp_path,
                                                                        backends, monkeypatch):
    """Eviction could not remove a pointer (a transient EIO): its slot is not reused while the
    pointer may remain, and it is reused once the pointer is removed. A pointer that names a
    slot holding another page (here: a segment deleted under it) is a miss once, then missing
    to exists and stored again by a put, on every node."""
    import hicached.backends.hf3fs.records as sp
    a = make(tmp_path, arena, node="A", capacity=capacity_for(1), grace_s=0)
    b = make(tmp_path, arena, node="B")
    backends += [a, b]
    fill(arena, 0, P, 1)
    fill(arena, P, P, 2)
    assert a.batch_put("ns", "kv", ["k"], [0], P) == [True]
    real, calls = sp.read_pointer, []

    def flaky(path):
        calls.append(path)
        if len(calls) <= 2:  # the eviction and its first retry
            raise OSError(5, "Input/output error")
        return real(path)

    monkeypatch.setattr(sp, "read_pointer", flaky)
    assert a.batch_put("ns", "kv", ["other"], [P], P) == [False]  # k's slot is not reused
    assert a.batch_put("ns", "kv", ["other"], [P], P) == [True]  # removed now: slot reused
    assert len(calls) == 3  # failed, failed at the retry, removed at the next retry
    assert a.exists("ns", "kv", ["k"]) == [False] and b.exists("ns", "kv", ["k"]) == [False]

    fill(arena, 2 * P, P, 3)
    assert b.batch_put("ns", "kv", ["m"], [2 * P], P) == [True]
    os.unlink(next(iter(b.space.segments.values())).path)  # B's segment gone, its pointer kept
    assert a.exists("ns", "kv", ["m"]) == [True]  # the record is there
    assert a.batch_get("ns", "kv", ["m"], [4 * P], P) == [False]  # and names nothing
    assert a.exists("ns", "kv", ["m"]) == [False] and a.stats()["dead_pointers"] == 1
    assert a.batch_put("ns", "kv", ["m"], [2 * P], P) == [True]  # stored again (A's slot)
    assert a.batch_get("ns", "kv", ["m"], [5 * P], P) == [True] and same(arena, 5 * P, 2 * P)
    b.keys.clear()
    assert b.batch_get("ns", "kv", ["m"], [6 * P], P) == [True] and same(arena, 6 * P, 2 * P)


def test_own_pages_of_a_cut_segment_are_evicted_after_one_miss(arena, tmp_path, backends):
    a = make(tmp_path, arena, node="A")
    backends.append(a)
    fill(arena, 0, P, 7)
    assert a.batch_put("ns", "kv", ["k"], [0], P) == [True]
    seg = next(iter(a.space.segments.values()))
    os.truncate(seg.path, seg.head.slot_off(0))  # the slot is past the end now
    assert a.batch_get("ns", "kv", ["k"], [P], P) == [False]
    assert a.exists("ns", "kv", ["k"]) == [False]
    assert a.batch_put("ns", "kv", ["k"], [0], P) == [True]
    assert a.batch_get("ns", "kv", ["k"], [2 * P], P) == [True] and same(arena, 2 * P, 0)


def test_a_segment_that_cannot_be_created_means_eviction_not_failures(arena, tmp_path,
                                                                       backends, monkeypatch):
    import errno

    import hicached.backends.hf3fs.space as sp
    seg = capacity_for(4)
    a = make(tmp_path, arena, node="A", capacity=10 * seg, segment_bytes=seg, grace_s=0)
    backends.append(a)
    assert a.batch_put("ns", "kv", [f"k{i}" for i in range(4)], [0, P, 2 * P, 3 * P], P) == \
        [True] * 4

    def quota(fd, n):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(sp.os, "ftruncate", quota)
    assert [a.batch_put("ns", "kv", [f"n{i}"], [0], P)[0] for i in range(6)] == [True] * 6
    st = a.stats()
    assert st["pages"] == 4 and st["evictions"] == 6 and st["segments"] == 1


def test_generations_go_on_in_a_new_epoch_after_2_to_the_32_writes(arena, tmp_path, backends):
    a = make(tmp_path, arena, node="A", capacity=capacity_for(8), grace_s=0)
    backends.append(a)
    epoch = a.space.epoch
    a.space._counter = (1 << 32) - 2
    for i in range(4):
        fill(arena, 0, P, i)
        assert a.batch_put("ns", "kv", [f"k{i}"], [0], P) == [True]
        assert a.batch_get("ns", "kv", [f"k{i}"], [P], P) == [True] and same(arena, P, 0)
    assert a.space.epoch == epoch + 1 and a.stats()["put_failures"] == 0


def test_a_segment_that_cannot_be_opened_at_restart_is_kept(arena, tmp_path, backends,
                                                            monkeypatch):
    a = make(tmp_path, arena, node="A", capacity=capacity_for(2) * 8,
             segment_bytes=capacity_for(2))
    keys = [f"k{i}" for i in range(4)]
    assert a.batch_put("ns", "kv", keys, [0, P, 2 * P, 3 * P], P) == [True] * 4
    segdir = a.space.dir
    a.close()
    real_open, failed = open, []

    def emfile(path, *args, **kw):
        if str(path).endswith(".seg") and not failed:
            failed.append(path)
            raise OSError(24, "Too many open files")
        return real_open(path, *args, **kw)

    monkeypatch.setattr("builtins.open", emfile)
    a = make(tmp_path, arena, node="A", capacity=capacity_for(2) * 8,
             segment_bytes=capacity_for(2))
    monkeypatch.setattr("builtins.open", real_open)
    segs = [f for f in os.listdir(segdir) if f.endswith(".seg")]
    assert failed and len(segs) == 2 and a.stats()["pages"] == 2
    a.close()
    a = make(tmp_path, arena, node="A", capacity=capacity_for(2) * 8,
             segment_bytes=capacity_for(2))
    backends.append(a)
    assert a.stats()["pages"] == 4
    assert a.batch_get("ns", "kv", keys, [4 * P, 5 * P, 6 * P, 7 * P], P) == [True] * 4


def test_a_vanished_root_gives_misses_then_works_again(arena, tmp_path, backends):
    import shutil
    root = tmp_path / "root"
    a = make(root, arena, node="A")
    a.wipe_check_s = 0
    backends.append(a)
    fill(arena, 0, P, 5)
    assert a.batch_put("ns", "kv", ["k"], [0], P) == [True]
    shutil.rmtree(root)
    assert a.batch_get("ns", "kv", ["k"], [P], P) == [False]
    assert a.exists("ns", "kv", ["k"]) == [False]
    assert a.batch_put("ns", "kv", ["k"], [0], P) == [True]  # started afresh
    assert a.batch_get("ns", "kv", ["k"], [P], P) == [True] and same(arena, P, 0)


def test_a_failed_attach_leaves_the_node_free(arena, tmp_path, monkeypatch, backends):
    import hicached.backends.hf3fs.space as sp
    a = make(tmp_path, arena, node="A")
    a.close()

    def eio(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sp.NodeSpace, "_load", eio)
    with pytest.raises(OSError):
        make(tmp_path, arena, node="A", lock_wait_s=0.2)
    monkeypatch.undo()
    backends.append(make(tmp_path, arena, node="A", lock_wait_s=0.2))  # the lock was released


def test_a_key_another_node_evicted_is_stored_again_by_a_put(arena, tmp_path, backends):
    """``exists`` trusts a found key for ``remote_ttl_s`` (documented); a get that misses it
    forgets it at once, and a put looks at the record itself instead of skipping it."""
    a = make(tmp_path, arena, node="A", capacity=capacity_for(1), grace_s=0)
    b = make(tmp_path, arena, node="B")
    backends += [a, b]
    fill(arena, 0, P, 1)
    fill(arena, P, P, 2)
    for k, via_get in (("k1", True), ("k2", False)):
        assert a.batch_put("ns", "kv", [k], [0], P) == [True]
        assert b.exists("ns", "kv", [k]) == [True]  # B remembers it for remote_ttl_s
        assert a.batch_put("ns", "kv", [k + "-evictor"], [P], P) == [True]  # A evicts k
        assert b.exists("ns", "kv", [k]) == [True]  # the window: still "stored" here
        if via_get:
            assert b.batch_get("ns", "kv", [k], [4 * P], P) == [False]
            assert b.exists("ns", "kv", [k]) == [False]  # forgotten at the miss
        puts = b.stats()["puts"]
        assert b.batch_put("ns", "kv", [k], [0], P) == [True]
        assert b.stats()["puts"] == puts + 1  # written, not skipped on the cached answer
        fill(arena, 4 * P, P, 0)
        assert b.batch_get("ns", "kv", [k], [4 * P], P) == [True] and same(arena, 4 * P, 0)
        assert a.batch_get("ns", "kv", [k], [5 * P], P) == [True] and same(arena, 5 * P, 0)
