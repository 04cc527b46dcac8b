"""Hit semantics: intersection of restorable endpoints (ARCHITECTURE.md)."""

import random

import numpy as np
import pytest

from hicached.hits import (
    intersect_endpoints,
    intersect_endpoints_array,
    leading_run,
    leading_run_array,
    restorable_endpoints,
    trailing_mask,
)

T, F = True, False


def test_leading_run():
    assert leading_run([]) == 0
    assert leading_run([T, T, F, T]) == 2
    assert leading_run([T, T, T]) == 3


def test_all_pages_endpoints_stop_at_first_hole():
    assert restorable_endpoints([T, T, F, T], "all_pages", 1, 4) == [1, 2]


def test_trailing_window_one_lists_every_present_page():
    assert restorable_endpoints([F, T, F, T, F], "trailing_pages", 1, 5) == [2, 4]


def test_trailing_window_needs_n_consecutive_pages():
    # window 2: L restorable iff pages L-2, L-1 exist; L=1 only needs page 0
    assert restorable_endpoints([T, F, T, T, T], "trailing_pages", 2, 5) == [1, 4, 5]


def test_limit_cuts_endpoints():
    assert restorable_endpoints([T, T, T, T], "trailing_pages", 1, 2) == [1, 2]


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown hit policy"):
        restorable_endpoints([T], "sometimes", 1, 1)


def test_docstring_example_intersection_not_min():
    kv_pages = 5
    mamba = [F, T, F, T, F]
    indexer = [T, T, T, T, F]
    final, hits, restorable = intersect_endpoints(
        kv_pages, [("mamba", "trailing_pages", 1, mamba), ("indexer", "all_pages", 1, indexer)]
    )
    assert restorable == [2, 4]
    assert final == 4
    assert hits == {"mamba": 4, "indexer": 4}


def test_trailing_hole_at_min_of_prefixes():
    # min-of-prefixes would say 3 (indexer prefix 3), but mamba cannot restore 3
    final, _, restorable = intersect_endpoints(
        4, [("mamba", "trailing_pages", 1, [F, T, F, T]), ("indexer", "all_pages", 1, [T, T, T, F])]
    )
    assert restorable == [2]
    assert final == 2


def test_no_common_endpoint():
    final, hits, restorable = intersect_endpoints(3, [("mamba", "trailing_pages", 1, [F, F, F])])
    assert (final, hits, restorable) == (0, {}, [])


def test_no_extra_pools():
    assert intersect_endpoints(3, []) == (3, {}, [1, 2, 3])
    assert intersect_endpoints(0, []) == (0, {}, [])


# ---------------------------------------------------------------- numpy twins = the reference


def test_array_twins_match_the_reference_on_random_inputs():
    rng = random.Random(11)
    for _ in range(3000):
        n = rng.randrange(0, 12)
        kv_pages = rng.randrange(0, n + 1)
        density = rng.random()
        pools = []
        for i in range(rng.randrange(0, 4)):
            exists = [rng.random() < density for _ in range(n)]
            policy = rng.choice(["all_pages", "trailing_pages"])
            pools.append((f"p{i}", policy, rng.randrange(0, 5), exists))
        arrays = [(name, pol, w, np.array(ex, bool)) for name, pol, w, ex in pools]
        want = intersect_endpoints(kv_pages, pools)
        got = intersect_endpoints_array(kv_pages, arrays)
        assert got == want and list(got[1]) == list(want[1]), (kv_pages, pools)
        assert all(type(x) is int for x in [got[0], *got[1].values(), *got[2]])
        for _, _, w, ex in pools:
            a = np.array(ex, bool)
            assert leading_run_array(a) == leading_run(ex)
            ends = trailing_mask(a, w)
            assert (ends.nonzero()[0] + 1).tolist() == restorable_endpoints(
                ex, "trailing_pages", w, n)


def test_array_twin_rejects_unknown_policy():
    with pytest.raises(ValueError, match="unknown hit policy"):
        intersect_endpoints_array(0, [("x", "sometimes", 1, np.zeros(0, bool))])
