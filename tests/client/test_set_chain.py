"""A set call's chain (``parent`` / ``depth`` / ``anchor_pool``): checked on the client
(``InvalidArgument``, nothing sent), carried by its ``Reserve`` in trailing fields that a daemon
of the protocol before them reads past."""

import pytest
from inproc_daemon import inproc_daemon
from pools import kv_pool, mamba_pool, pages
from protocol_v4 import OldReserve, old_request_decoder

from hicached import Client, PoolTransfer
from hicached import protocol as P
from hicached.errors import InvalidArgument

NS = "model-a"


@pytest.fixture
def client(tmp_path):
    with inproc_daemon(tmp_path) as d, Client(d.endpoint, NS) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        c.register_mem_host_pool_v2(mamba_pool(seed=2), "mamba")
        c.daemon = d
        yield c


def sent_reserves(client):
    """Every Reserve the client sends from now on."""
    sent = []
    original = client._conn.roundtrip

    def roundtrip(msg, *a, **kw):
        if isinstance(msg, P.Reserve):
            sent.append(msg)
        return original(msg, *a, **kw)
    client._conn.roundtrip = roundtrip
    return sent


def kv(first, keys):
    return PoolTransfer("kv", pages(first, len(keys)), keys=keys)


@pytest.mark.parametrize(("kw", "words"), [
    ({"parent": ""}, "parent must be None or a key"),
    ({"parent": 7}, "parent must be None or a key"),
    ({"parent": "p" * (P.MAX_KEY_LEN + 1)}, "parent must be None or a key"),
    ({"depth": -1}, "depth must be None or an int in [0, 1099511627776]"),
    ({"depth": True}, "depth must be None or an int"),
    ({"depth": 1.0}, "depth must be None or an int"),
    ({"depth": (1 << 40) + 1}, "depth must be None or an int"),
    ({"parent": "p", "depth": 0}, "depth 0 says the first key is a root, but parent is 'p'"),
    ({"anchor_pool": "mamba"}, "anchor_pool must be None or one of the call's pools ['kv']"),
])
def test_bad_chain_arguments_raise_invalid_argument_and_send_nothing(client, kw, words):
    sent = sent_reserves(client)
    with pytest.raises(InvalidArgument) as e:
        client.batch_set_v2([kv(0, ["a"])], **kw)
    assert words in str(e.value)
    if "anchor_pool" not in kw:
        with pytest.raises(InvalidArgument, match="must be|depth 0"):
            client.batch_set_pages("kv", ["a"], [kv_pool().get_data_page(0)], **kw)
    assert sent == []
    assert client.batch_exists(["a"]) == 0


def test_the_reserve_carries_the_chain_and_an_older_daemon_reads_past_it(client):
    sent = sent_reserves(client)
    client.batch_set_v2([PoolTransfer("mamba", [1], keys=["x2"]), kv(0, ["x0", "x1", "x2"])],
                        parent="p", depth=3, anchor_pool="kv")
    client.batch_set_v1(["y0"], pages(3, 1))
    chained, plain = sent
    assert (chained.anchor_pool, chained.parent, chained.depth) == ("kv", "p", 3)
    assert (plain.anchor_pool, plain.parent, plain.depth) == ("", "", -1)  # said nothing
    for new in (chained, plain):
        old = old_request_decoder.decode(P.encode(new))
        assert isinstance(old, OldReserve)
        assert (old.req_id, old.session, old.transfers, old.ahead, old.want_ahead,
                old.release) == (new.req_id, new.session, new.transfers, new.ahead,
                                 new.want_ahead, new.release)
    assert client.daemon.chain(NS, "x2") == ("x1", 5)
    assert client.daemon.chain(NS, "y0") == (None, -1)
