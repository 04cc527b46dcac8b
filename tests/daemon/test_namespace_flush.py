"""A flush of one namespace (``Flush.namespace``, ``Client.flush(namespace=...)``): a real daemon
whose two namespaces hold pages under the same keys, in L2 and in the file L3. The namespace
flushed loses its pages in both tiers; the other keeps them, hit from L2 and (once L2 is
flushed) from L3. A flush naming no namespace still empties the node; an L3 backend that cannot
find one namespace's pages (3FS) refuses the flush before anything is dropped."""

import os

import pytest
import torch
from conftest import wait_until
from inproc_daemon import inproc_daemon
from pools import kv_pool, kv_tokens, pages

from hicached import Client, PoolTransfer
from hicached import protocol as P
from hicached.daemon.sessions import namespace_digest
from hicached.errors import BackendError, InvalidArgument, VersionMismatch

A, B = "model-a|tp0of1", "model-b|tp0of1"
KEYS = [f"k{i}" for i in range(6)]  # the same keys in both namespaces


def store(d, ns, seed):
    """A client of ``ns`` holding KEYS (seeded bytes) in L2 and, written through, in L3."""
    c = Client(d.endpoint, ns)
    src = kv_pool(seed=seed)
    c.register_mem_host_pool_v2(src, "kv")
    assert c.batch_set_v1(KEYS, pages(0, 6)) == [True] * 6
    c.wait_stored([PoolTransfer("kv", keys=KEYS)])
    c.src = src
    return c


def l2_pages(d):
    """L2 pages per namespace digest, as the daemon's index counts them."""
    out = {}
    for (ns, _), n in d.daemon.call(d.daemon.index.counts).items():
        out[ns] = out.get(ns, 0) + n
    return {ns: n for ns, n in out.items() if n}


def l3_files(root, ns):
    """Page files of namespace ``ns`` under the file backend's root."""
    top = os.path.join(root, namespace_digest(ns))
    return sum(len(files) for _, _, files in os.walk(top))


def reads_back(c, first_page):
    """Whether every KEY loads, byte-equal to what ``c`` stored."""
    c.register_mem_host_pool_v2(dst := kv_pool(), "kv")
    try:
        ok = c.batch_get_v1(KEYS, pages(first_page, 6)) == [True] * 6
        return ok and torch.equal(kv_tokens(dst, first_page, 6), kv_tokens(c.src, 0, 6))
    finally:
        c.register_mem_host_pool_v2(c.src, "kv")


@pytest.fixture
def node(tmp_path):
    with inproc_daemon(tmp_path) as d:
        a, b = store(d, A, seed=1), store(d, B, seed=2)
        d.root = d.daemon.tier.backend.root
        assert l2_pages(d) == {namespace_digest(A): 6, namespace_digest(B): 6}
        assert l3_files(d.root, A) == l3_files(d.root, B) == 6
        yield d, a, b
        a.close()
        b.close()


def test_a_namespace_flush_of_every_tier_leaves_the_other_namespace_in_l2_and_l3(node):
    d, a, b = node
    a.flush("all", namespace=A)
    assert l2_pages(d) == {namespace_digest(B): 6}
    assert (l3_files(d.root, A), l3_files(d.root, B)) == (0, 6)
    assert a.batch_exists(KEYS) == 0  # in neither tier
    assert b.batch_exists(KEYS) == 6 and reads_back(b, 10)  # from L2
    b.flush("l2")  # the node's L2: B's pages now come from L3 only
    assert l2_pages(d) == {}
    assert b.batch_exists(KEYS) == 6 and reads_back(b, 20)
    assert d.daemon.call(lambda: d.daemon.tier.counters["l3_loads"]) == 6
    assert a.batch_exists(KEYS) == 0


def test_a_namespace_flush_of_l2_keeps_its_l3_copies_and_the_other_namespace(node):
    d, a, b = node
    a.flush("l2", namespace=A)
    assert l2_pages(d) == {namespace_digest(B): 6}
    assert (l3_files(d.root, A), l3_files(d.root, B)) == (6, 6)
    assert a.batch_exists(KEYS) == 6 and reads_back(a, 10)  # loaded back from L3


def test_a_namespace_flush_of_l3_keeps_every_l2_page(node):
    d, a, b = node
    a.flush("l3", namespace=A)
    assert (l3_files(d.root, A), l3_files(d.root, B)) == (0, 6)
    assert l2_pages(d) == {namespace_digest(A): 6, namespace_digest(B): 6}
    # the tier forgot A's copies only: a write of A's pages is sent again, B's are not
    tier = d.daemon.tier
    assert d.daemon.call(lambda: [e.in_l3 for e in tier.index.entries()].count(True)) == 6
    assert d.daemon.call(lambda: {t[0] for t in tier.known_in_l3._tables}) == {
        namespace_digest(B)}


def test_a_flush_naming_no_namespace_empties_the_node(node):
    d, a, b = node
    a.flush("all")
    assert l2_pages(d) == {}
    assert (l3_files(d.root, A), l3_files(d.root, B)) == (0, 0)
    assert a.batch_exists(KEYS) == b.batch_exists(KEYS) == 0


def test_a_namespace_nobody_stored_under_drops_nothing(node):
    d, a, b = node
    a.flush("all", namespace="never-used")
    assert l2_pages(d) == {namespace_digest(A): 6, namespace_digest(B): 6}
    assert (l3_files(d.root, A), l3_files(d.root, B)) == (6, 6)


def test_the_client_checks_the_namespace_and_the_daemons_support(node):
    d, a, b = node
    for bad in ("", 7, b"model-a"):
        with pytest.raises(InvalidArgument, match="namespace must be None"):
            a.flush("all", namespace=bad)
    # what an older daemon's Welcome says (no flush_namespace): it would read past the field
    # and flush the whole node, so the client sends nothing
    a._conn.flushes_namespaces = False
    with pytest.raises(VersionMismatch, match="older than namespace flushes"):
        a.flush("all", namespace=A)
    assert l2_pages(d) == {namespace_digest(A): 6, namespace_digest(B): 6}


def test_an_older_clients_flush_is_a_flush_of_the_node(node):
    """A Flush without the trailing namespace, as an older client sends it."""
    import zmq
    from protocol_v4 import OldFlush

    d, a, b = node
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.connect(d.endpoint)
        s.send(P.encode(OldFlush(5, "l2")))
        assert s.poll(10_000)
        assert P.answer_decoder.decode(s.recv()) == P.Ok(5)
    finally:
        s.close(linger=0)
        ctx.term()
    assert l2_pages(d) == {}


def test_an_l3_that_cannot_find_a_namespaces_pages_refuses_before_dropping_any(tmp_path):
    opts = {"root": str(tmp_path / "mnt"), "node": "n1", "io": "posix"}
    with inproc_daemon(tmp_path, l3_backend="hf3fs", l3_options=opts) as d:
        a, b = store(d, A, seed=1), store(d, B, seed=2)
        try:
            for tier in ("all", "l3"):
                with pytest.raises(BackendError, match=r"L3 backend hf3fs cannot find one "
                                   r"namespace's pages to clear them: nothing was flushed"):
                    a.flush(tier, namespace=A)
            assert l2_pages(d) == {namespace_digest(A): 6, namespace_digest(B): 6}
            a.flush("l2", namespace=A)  # the L2 part alone works with any backend
            assert l2_pages(d) == {namespace_digest(B): 6}
            assert a.batch_exists(KEYS) == 6  # from 3FS, which kept them
            assert wait_until(lambda: reads_back(a, 10))
        finally:
            a.close()
            b.close()
