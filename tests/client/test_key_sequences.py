"""Keys given as one ``str`` or ``bytes`` where a sequence of keys belongs: ``InvalidArgument``
naming the argument, on every call that takes keys, before anything is sent. Iterating one
would make each character a key: ``batch_exists_v2("abc", [])`` answered 2 pages once pages
stored under 'a' and 'b' existed.

The daemon here holds pages under the single-character keys such a split would ask for, so a
call that split its argument would hit (or store) them, and the checks below would see it."""

from types import SimpleNamespace

import msgspec
import pytest
import torch
from inproc_daemon import inproc_daemon
from pools import PAGE, kv_pool, mamba_pool, pages

from hicached import Client, PoolTransfer
from hicached import protocol as P
from hicached.errors import InvalidArgument
from hicached.plugin.vllm_naming import page_keys

NS = "model-a"
ONE_KEYS = ("abc", b"abc", bytearray(b"abc"))


@pytest.fixture
def client(tmp_path):
    with inproc_daemon(tmp_path) as d, Client(d.endpoint, NS) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        c.register_mem_host_pool_v2(mamba_pool(seed=2), "mamba")
        # what a split "abc" would name: stored, so a split call would hit
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 3), keys=["a", "b", "c"]),
                               PoolTransfer("mamba", [1], keys=["c"])]) == {
            "kv": [True] * 3, "mamba": [True]}
        assert c.batch_exists(["a", "b", "c"]) == 3
        yield c


def sent(client):
    """Every request the client sends from now on (its type names)."""
    out = []
    original = client._conn.roundtrip

    def roundtrip(msg, *a, **kw):
        out.append(type(msg).__name__)
        return original(msg, *a, **kw)
    client._conn.roundtrip = roundtrip
    return out


def foreign(name, keys, host_indices=None, hit_policy="all_pages"):
    """A transfer as SGLang's own ``PoolTransfer`` (not ours: no check at construction)."""
    return SimpleNamespace(name=name, keys=keys, host_indices=host_indices,
                           hit_policy=hit_policy)


def calls(c):
    """(call, the argument its error must name) for every client call that takes keys; each
    builds its arguments from ``one``, the bad keys."""
    page = kv_pool().get_data_page(0)
    return [
        (lambda one: c.batch_exists(one), "keys"),
        (lambda one: c.batch_exists_v2(one, []), "keys"),
        (lambda one: c.batch_exists_v2(["a"], [foreign("mamba", one, None, "trailing_pages")]),
         "pool 'mamba': keys"),
        (lambda one: c.batch_get_v1(one, pages(0, 3)), "keys"),
        (lambda one: c.batch_set_v1(one, pages(0, 3)), "keys"),
        (lambda one: c.batch_get_v2([foreign("kv", one, pages(0, 3))]), "pool 'kv': keys"),
        (lambda one: c.batch_set_v2([foreign("kv", one, pages(0, 3))]), "pool 'kv': keys"),
        (lambda one: c.batch_get_pages("kv", one, [page] * 3), "keys"),
        (lambda one: c.batch_set_pages("kv", one, [page] * 3), "keys"),
        (lambda one: c.wait_stored([foreign("kv", one)]), "pool 'kv': keys"),
        (lambda one: c.prefetch(one, pages(0, 3)), "keys"),
        (lambda one: c.prefetch(["a"], pages(0, 1), [foreign("mamba", one, [1],
                                                            "trailing_pages")]),
         "pool 'mamba': keys"),
    ]


@pytest.mark.parametrize("one", ONE_KEYS, ids=["str", "bytes", "bytearray"])
def test_every_client_call_refuses_one_key_for_a_sequence_and_sends_nothing(client, one):
    log = sent(client)
    for call, named in calls(client):
        with pytest.raises(InvalidArgument) as e:
            call(one)
        msg = str(e.value)
        assert msg.startswith(f"{named} must be a sequence of keys (a list of str), got one "
                              f"{type(one).__name__} {one!r}"), msg
    assert log == []  # refused before anything went out
    # nothing was stored under a split key either: the daemon holds what the fixture stored
    assert client.batch_exists(["x", "y", "z"]) == 0
    assert client.batch_exists(["a", "b", "c"]) == 3


def test_the_same_calls_with_a_list_of_that_one_key_work(client):
    """The fix the message names: wrap the key in a list."""
    assert client.batch_exists(["abc"]) == 0
    res = client.batch_exists_v2(["abc"], [PoolTransfer("mamba", keys=["abc"],
                                                        hit_policy="trailing_pages")])
    assert res.kv_hit_pages == 0
    assert client.batch_set_v1(["abc"], pages(3, 1)) == [True]
    assert client.batch_exists(["abc"]) == 1
    dst = torch.zeros_like(kv_pool().get_data_page(0))
    assert client.batch_get_pages("kv", ["abc"], [dst]) == [True]
    assert torch.equal(dst, kv_pool(seed=1).get_data_page(3 * PAGE))


@pytest.mark.parametrize("one", ONE_KEYS, ids=["str", "bytes", "bytearray"])
def test_a_pool_transfer_refuses_one_key_at_construction(one):
    with pytest.raises(InvalidArgument) as e:
        PoolTransfer("kv", pages(0, 3), keys=one)
    assert str(e.value).startswith("PoolTransfer('kv').keys must be a sequence of keys")
    # (a list, a tuple and None stay what they were)
    assert PoolTransfer("kv", keys=("a", "b")).keys == ("a", "b")
    assert PoolTransfer("kv").keys is None


@pytest.mark.parametrize("one", ["abc", b"abc"], ids=["str", "bytes"])
def test_the_daemon_decodes_keys_only_as_a_list_of_str(one):
    """A frame built by another client with one key where the list belongs is malformed on
    the daemon side (its decoder is typed): the split happened only in the client."""
    with pytest.raises(msgspec.ValidationError, match=r"Expected `array`"):
        P.request_decoder.decode(msgspec.msgpack.encode(["exists", 1, 1, one]))
    assert P.request_decoder.decode(P.encode(P.Exists(1, 1, ["abc"]))).keys == ["abc"]


@pytest.mark.parametrize("one", [b"\x01" * 64, "ab" * 32])
def test_vllm_block_hashes_as_one_bytes_are_refused(one):
    """vLLM's ``request.block_hashes`` is a list of ``bytes``: one ``bytes`` would make every
    byte value a block hash (an int, which ``page_keys`` also takes from older vLLMs)."""
    with pytest.raises(InvalidArgument, match=r"^block_hashes must be a sequence of keys"):
        page_keys(one, 16, 16, 4)
    assert page_keys([b"\x01" * 32, b"\x02" * 32], 16, 16, 4) == ["01" * 32, "02" * 32]
