"""FpTable (daemon/fptable.py) against a plain dict: puts, removes, gets, growth, batches."""

import random

import numpy as np
import pytest

from hicached.daemon.fptable import FpTable


def check_same(t: FpTable, ref: dict[int, int], probes: list[int]) -> None:
    """``t`` holds exactly ``ref``: length, items, scalar and batch gets (present and absent)."""
    assert len(t) == len(ref)
    fps, values = t.items()
    assert dict(zip(fps.tolist(), values.tolist(), strict=True)) == ref
    assert fps.dtype == np.uint64 and values.dtype == np.int64
    keys = list(ref) + probes
    want = [ref.get(k, -1) for k in keys]
    assert [t.get(k) for k in keys] == want
    got = t.get_many(np.array(keys, np.uint64))
    assert got.dtype == np.int64 and got.tolist() == want


def test_empty_table():
    t = FpTable(8)
    assert len(t) == 0 and t.capacity == 8 and t.nbytes == 8 * 16
    assert t.get(5) == -1 and t.remove(5) == -1
    assert t.get_many(np.zeros(0, np.uint64)).size == 0
    assert t.get_many(np.array([5, 0], np.uint64)).tolist() == [-1, -1]
    fps, values = t.items()
    assert fps.size == 0 and values.size == 0


@pytest.mark.parametrize("capacity", [0, 4, 12, 1000])
def test_capacity_must_be_a_power_of_2(capacity):
    with pytest.raises(ValueError, match="power of 2"):
        FpTable(capacity)


def test_put_replaces_and_rejects_bad_input():
    t = FpTable(8)
    t.put(3, 10)
    t.put(3, 11)
    assert len(t) == 1 and t.get(3) == 11
    t.put(2**64 - 1, 2**63 - 1)  # the largest fp and value
    assert t.get(2**64 - 1) == 2**63 - 1
    with pytest.raises(ValueError, match="empty slot"):
        t.put(0, 1)
    with pytest.raises(ValueError, match=">= 0"):
        t.put(4, -1)
    assert len(t) == 2 and t.get(0) == -1 and t.remove(0) == -1


def test_grows_at_half_load_and_never_shrinks():
    t = FpTable(16)
    for fp in range(1, 9):
        t.put(fp, fp)
    assert t.capacity == 16  # 8 of 16: the limit, not past it
    t.put(9, 9)
    assert t.capacity == 32 and len(t) == 9
    for fp in range(1, 10):
        assert t.remove(fp) == fp
    assert t.capacity == 32 and len(t) == 0
    t.clear()
    assert t.capacity == 16


def test_collision_chains_wrap_and_shift_back():
    """fps sharing their low bits probe one chain; one starting at the last slot wraps to 0."""
    t = FpTable(16)
    chain = [15 + (i << 20) for i in range(6)]  # home 15, slots 15, 0, 1, 2, 3, 4
    for i, fp in enumerate(chain):
        t.put(fp, i)
    t.put(1 + (1 << 30), 100)  # home 1 (taken): lands after the chain, at slot 5
    w = t._arr[:, 0].tolist()
    assert [w[15]] + w[:6] == chain + [1 + (1 << 30)]
    assert t.remove(chain[1]) == 1  # the rest shifts back, the stranger to its home
    w = t._arr[:, 0].tolist()
    assert [w[15]] + w[:5] == [chain[0]] + chain[2:] + [1 + (1 << 30)] and w[5] == 0
    check_same(t, {fp: i for i, fp in enumerate(chain) if i != 1} | {1 + (1 << 30): 100},
               [chain[1], 15, 1])


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_a_dict(seed):
    rng = random.Random(seed)
    t = FpTable(8)
    ref: dict[int, int] = {}
    # few distinct low bits (long shared chains) and full 64-bit fps, values up to 2**62
    low = [rng.randrange(1, 64) for _ in range(8)]
    pool = ([lo + (rng.getrandbits(40) << 8) for lo in low for _ in range(40)]
            + [rng.getrandbits(64) | 1 for _ in range(600)])
    for step in range(6000):
        fp = rng.choice(pool)
        op = rng.random()
        if op < 0.5:
            value = rng.choice((0, rng.randrange(2**62), 2**62))
            t.put(fp, value)
            ref[fp] = value
        elif op < 0.85:
            assert t.remove(fp) == ref.pop(fp, -1)
        else:
            assert t.get(fp) == ref.get(fp, -1)
        if step % 500 == 0:
            check_same(t, ref, rng.sample(pool, 50))
    check_same(t, ref, pool)
    assert len(t) <= t.capacity // 2


def test_get_many_on_a_large_table_equals_per_key_get():
    rng = np.random.default_rng(7)
    t = FpTable()
    fps = np.unique(rng.integers(1, 2**64 - 1, 50_000, dtype=np.uint64, endpoint=True))
    for i, fp in enumerate(fps.tolist()):
        t.put(fp, i * 3)
    assert t.capacity == 1 << 17 and len(t) == fps.size
    for fp in fps[::7].tolist():
        t.remove(fp)
    q = np.concatenate([rng.choice(fps, 3000), rng.integers(1, 2**63, 1000, dtype=np.uint64)])
    assert t.get_many(q).tolist() == [t.get(fp) for fp in q.tolist()]
    ref = {fp: i * 3 for i, fp in enumerate(fps.tolist()) if i % 7}
    fps_now, values = t.items()
    assert dict(zip(fps_now.tolist(), values.tolist(), strict=True)) == ref


def test_rehash_wraps_chains_that_run_past_the_last_slot():
    t = FpTable(8)
    for fp in (7, 15, 23, 31):  # all home 7 of 8
        t.put(fp, fp * 10)
    t.put(1, 10)  # past half load: 16 slots, homes 7, 15, 7, 15: 31 wraps to slot 0
    assert t.capacity == 16
    w = t._arr[:, 0].tolist()
    assert (w[7], w[8], w[15], w[0], w[1]) == (23, 7, 15, 31, 1)  # (moved in slot order)
    check_same(t, {7: 70, 15: 150, 23: 230, 31: 310, 1: 10}, [39, 47, 2])
