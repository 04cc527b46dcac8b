"""The SGLang plugin's calls that take keys, given one ``str`` or ``bytes`` instead of a list:
``InvalidArgument`` naming the argument (a caller's bug is not a miss: the I/O methods answer
misses for a daemon that is down, not for arguments no daemon could serve), on a real daemon
holding pages under the single-character keys a split would ask for."""

import pytest
from sglang_env import idx, indexer_pool, kv_pool

from hicached.errors import InvalidArgument


@pytest.fixture
def backend(sg, plugin, daemon):
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=5), "indexer": indexer_pool(seed=6)})
    hs = sg.hs
    assert b.batch_set_v2([hs.PoolTransfer(name=hs.PoolName.INDEXER, host_indices=idx(0, 3),
                                           keys=["a", "b", "c"])]) == {"indexer": [True] * 3}
    assert b.batch_set_v1(["a", "b", "c"], idx(0, 3)) == [True] * 3
    assert b.batch_exists(["a", "b", "c"]) == 3
    return b


@pytest.mark.parametrize("one", ["abc", b"abc"], ids=["str", "bytes"])
def test_every_plugin_call_that_takes_keys_refuses_one_key(sg, backend, one):
    hs = sg.hs
    page = backend.mem_pool_host.get_dummy_flat_data_page()

    def pt(pool, keys, **kw):
        return hs.PoolTransfer(name=pool, keys=keys, **kw)

    calls = [
        (lambda: backend.batch_exists(one), "keys"),
        (lambda: backend.batch_exists_v2(one, []), "keys"),
        (lambda: backend.batch_exists_v2(["a"], [pt(hs.PoolName.INDEXER, one)]),
         "pool 'indexer': keys"),
        (lambda: backend.batch_get_v1(one, idx(0, 3)), "keys"),
        (lambda: backend.batch_set_v1(one, idx(0, 3)), "keys"),
        (lambda: backend.batch_get(one, [page] * 3), "keys"),
        (lambda: backend.batch_set(one, [page] * 3), "keys"),
        (lambda: backend.batch_get_v2([pt(hs.PoolName.KV, one, host_indices=idx(0, 3))]),
         "pool 'kv': keys"),
        (lambda: backend.batch_set_v2([pt(hs.PoolName.INDEXER, one, host_indices=idx(0, 3))]),
         "pool 'indexer': keys"),
    ]
    for call, named in calls:
        with pytest.raises(InvalidArgument) as e:
            call()
        assert str(e.value).startswith(f"{named} must be a sequence of keys (a list of str), "
                                       f"got one {type(one).__name__} {one!r}"), str(e.value)
    counters = backend.get_stats().counters
    assert counters["errors"] == 0 and counters["unavailable"] == 0  # refused, not a miss
    # the daemon still holds exactly what the fixture stored: nothing was written under a split
    assert backend.batch_exists(["x", "y", "z"]) == 0
    assert backend.batch_exists(["a", "b", "c"]) == 3
    assert backend.batch_exists(["abc"]) == 0  # the one key, asked the right way: a miss
