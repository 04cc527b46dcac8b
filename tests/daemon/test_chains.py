"""The chains pages belong to (issue 24): ``PageIndex.link`` / ``chain``, and what a ``Reserve``
says of them over the wire, from new clients and from old ones that say nothing (a struct
without the trailing fields, as an older client encodes it)."""

import os

import msgspec
import pytest
from conftest import raw_socket
from inproc_daemon import inproc_daemon
from pools import kv_pool, mamba_pool, pages
from protocol_v4 import OldReserve

from hicached import Client, PoolTransfer
from hicached import protocol as P
from hicached.daemon.index import PageIndex
from hicached.daemon.slabs import SlabAllocator
from hicached.errors import InvalidTransfer, ProtocolError

NS = "model-a"


@pytest.fixture
def daemon(tmp_path):
    with inproc_daemon(tmp_path) as d:
        yield d


# ---------------------------------------------------------------- the index (link / chain)


def index_with(keys, pool="kv", commit=True):
    index = PageIndex(SlabAllocator(1 << 20, 1 << 16))
    entries = [index.reserve(("ns", pool), k, 4096, 4096) for k in keys]
    if commit:
        index.commit_many(entries)
    return index, entries


def test_link_chains_the_keys_after_the_parent_with_their_depths():
    index, _ = index_with(["root", "a", "b", "c"])
    index.link("ns", ["a", "b", "c"], "root", 5)
    assert [index.chain("ns", k) for k in "abc"] == [("root", 5), ("a", 6), ("b", 7)]
    index.link("ns", ["b", "c"], None, -1)  # the newest wins: b a root of unknown depth now
    assert [index.chain("ns", k) for k in "abc"] == [("root", 5), (None, -1), ("b", -1)]
    index.link("ns", ["a"], None, 0)  # a root at depth 0
    assert index.chain("ns", "a") == (None, 0)
    assert index.chain("other-ns", "a") == (None, -1)  # by (namespace, key)
    assert index.chain("ns", "never") == (None, -1)


def test_only_held_keys_are_linked_and_a_key_that_left_l2_has_no_chain():
    index, (a, b) = index_with(["a", "b"], pool="mamba@tp1of2", commit=False)  # pending
    index.link("ns", ["a", "b", "x"], "p", 1)  # x: held by no pool; nor is p
    # a parent L2 does not hold is kept as its fingerprint: named once L2 holds it
    assert (index.chain("ns", "a"), index.chain("ns", "b")) == ((None, 1), ("a", 2))
    index.commit(index.reserve(("ns", "kv"), "p", 4096, 4096))
    assert index.chain("ns", "a") == ("p", 1)
    assert index.chain("ns", "x") == (None, -1)
    index.commit(a)
    index.abort(b)
    assert (index.chain("ns", "a"), index.chain("ns", "b")) == (("p", 1), (None, -1))
    index.drop_one(a)
    assert index.chain("ns", "a") == (None, -1)


# ---------------------------------------------------------------- over the wire: new clients


def test_parent_and_depth_arrive_and_calls_without_them_are_roots_of_unknown_depth(daemon):
    kv = kv_pool(seed=1)
    with Client(daemon.endpoint, NS) as c:
        c.register_mem_host_pool_v2(kv, "kv")
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 3), keys=["k0", "k1", "k2"])],
                              parent="p", depth=7)["kv"] == [True] * 3
        assert [daemon.chain(NS, k) for k in ("k0", "k1", "k2")] == [
            (None, 7), ("k0", 8), ("k1", 9)]  # p: a parent L2 does not hold
        assert c.batch_set_v2([PoolTransfer("kv", pages(3, 2), keys=["r0", "r1"])])["kv"]
        assert [daemon.chain(NS, k) for k in ("r0", "r1")] == [(None, -1), ("r0", -1)]
        c.batch_set_v1(["s0"], pages(5, 1), depth=0)
        c.batch_set_pages("kv", ["t0"], [kv.get_data_page(6 * 4)], parent="s0", depth=1)
        c.batch_set_pages("kv", ["u0"], [kv.get_data_page(7 * 4)], parent="t0")
        assert [daemon.chain(NS, k) for k in ("s0", "t0", "u0")] == [
            (None, 0), ("s0", 1), ("t0", -1)]
        assert daemon.chain("model-b", "k0") == (None, -1)
        c.flush("l2")
        assert daemon.chain(NS, "k0") == (None, -1)  # left L2: no chain any more


def test_links_are_kept_by_namespace_and_key_across_pools_and_calls(daemon):
    """An MLA model's non-writer rank sends only its own rank-tagged Mamba pool: its call's
    anchor is that pool, and its links are the same (namespace, key)'s as the writer's."""
    with Client(daemon.endpoint, NS) as writer, Client(daemon.endpoint, NS) as rank1:
        writer.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        rank1.register_mem_host_pool_v2(mamba_pool(seed=2), "mamba@tp1of2")
        assert rank1.batch_set_v2([PoolTransfer("mamba@tp1of2", [3], keys=["c2"])],
                                  parent="c1", depth=2)["mamba@tp1of2"] == [True]
        assert daemon.chain(NS, "c2") == (None, 2)  # c1 is not in L2 yet: not named
        writer.batch_set_v2([PoolTransfer("kv", pages(0, 3), keys=["c0", "c1", "c2"])],
                            depth=0)  # c2 is linked again: the newest wins
        assert [daemon.chain(NS, k) for k in ("c0", "c1", "c2")] == [
            (None, 0), ("c0", 1), ("c1", 2)]


def test_anchor_pool_names_the_transfer_whose_keys_are_the_chain(daemon):
    with Client(daemon.endpoint, NS) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
        c.register_mem_host_pool_v2(mamba_pool(seed=2), "mamba")
        c.batch_set_v2([PoolTransfer("mamba", [0], keys=["m2"]),
                        PoolTransfer("kv", pages(0, 3), keys=["m0", "m1", "m2"])],
                       parent="root", depth=4, anchor_pool="kv")
        assert [daemon.chain(NS, k) for k in ("m0", "m1", "m2")] == [
            (None, 4), ("m0", 5), ("m1", 6)]  # root: not in L2


# ---------------------------------------------------------------- over the wire: raw frames


def ask(sock, msg):
    sock.send(msg if isinstance(msg, bytes) else P.encode(msg))
    return P.answer_decoder.decode(sock.recv())


def raw_session(sock, page_bytes):
    """A handshake and a registered kv pool on a bare socket; the session id."""
    welcome = ask(sock, P.Hello(1, P.PROTOCOL_VERSION, NS, os.getpid()))
    assert isinstance(welcome, P.Welcome), welcome
    assert isinstance(ask(sock, P.RegisterPool(2, welcome.session, "kv", page_bytes)),
                      P.Registered)
    return welcome.session


def test_an_old_clients_reserve_is_served_and_its_keys_are_roots(daemon):
    page_bytes = kv_pool().page_bytes
    with raw_socket(daemon.endpoint) as s:
        session = raw_session(s, page_bytes)
        old = msgspec.msgpack.encode(OldReserve(3, session, [P.PoolKeys("kv", ["o0", "o1"])]))
        assert len(msgspec.msgpack.decode(old)) == 7  # no trailing fields at all
        res = ask(s, old)
        assert isinstance(res, P.Reserved) and all(off >= 0 for off in res.offsets[0])
        assert isinstance(ask(s, P.Commit(4, session, res.reservation_id, [[True, True]])),
                          P.Committed)
    assert [daemon.chain(NS, k) for k in ("o0", "o1")] == [(None, -1), ("o0", -1)]


def test_bad_chain_fields_get_typed_errors_and_store_nothing(daemon):
    page_bytes = kv_pool().page_bytes
    with raw_socket(daemon.endpoint) as s:
        session = raw_session(s, page_bytes)
        t = [P.PoolKeys("kv", ["b0"])]
        for msg, code, words in (
                (P.Reserve(5, session, t, depth=-2), ProtocolError.code, ">= -1"),
                (P.Reserve(6, session, t, depth=1 << 41), ProtocolError.code, "<="),
                (P.Reserve(7, session, t, parent="p", depth=0), ProtocolError.code, "root"),
                (P.Reserve(8, session, t, parent="p" * (P.MAX_KEY_LEN + 1)),
                 InvalidTransfer.code, "parent key is longer"),
                (P.Reserve(9, session, t, anchor_pool="mamba"), InvalidTransfer.code,
                 "anchor pool 'mamba' is not one of the call's pools ['kv']")):
            ans = ask(s, msg)
            assert isinstance(ans, P.Error) and ans.code == code, ans
            assert ans.req_id == msg.req_id and words in ans.message, ans
        res = ask(s, P.Reserve(10, session, t))  # nothing was reserved: b0 is free
        assert res.offsets[0][0] >= 0
        s.send(P.encode(P.Bye(0, session)))  # its reservation ends with it
