"""Speculative get copies: a client copies pages from slots it saw before while the lease request
is on its way, and keeps a copy only when the answer names the same (offset, tag).

Real daemons on ipc:// sockets; slots are made to change hands (flush, other writers, a daemon
restart) so every stale guess must be caught by its tag. The daemons publish no slot tags
(``--no-shared-gets``): with them, known pages are read with no lease at all (test_leaseless.py)
and speculation is not used."""

import pytest
import torch
from conftest import wait_until

from hicached import HostPool, PoolTransfer
from hicached.daemon.index import PageIndex
from hicached.daemon.slabs import SlabAllocator

TOKENS = 16  # tokens per page; 16 * 4 layers * 512 * 4 bytes = 128 KiB pages (speculated)


@pytest.fixture
def daemon(make_daemon):
    """L2 only: a flushed page is gone, not reloaded from the embedded L3 directory."""
    return make_daemon(extra=["--l3-backend", "none", "--no-shared-gets"])


def pool(seed=None, num_pages=8):
    p = HostPool.allocate_mla(num_pages, TOKENS, layers=4, kv_dim=512, dtype=torch.float32)
    if seed is not None:
        p.kv_buffer.copy_(torch.randn(p.kv_buffer.shape,
                                      generator=torch.Generator().manual_seed(seed)))
    return p


def page(p, i):
    return p.kv_buffer[i * TOKENS:(i + 1) * TOKENS]


def tokens(i, n=1):
    return torch.arange(i * TOKENS, (i + n) * TOKENS)


def put(client, host, keys, first_page=0):
    client.register_mem_host_pool_v2(host, "kv")
    res = client.batch_set_v2([PoolTransfer("kv", tokens(first_page, len(keys)), keys=keys)])
    assert all(res["kv"]), res
    client.ping()  # the fire-and-forget commit has landed


def get(client, host, keys):
    client.register_mem_host_pool_v2(host, "kv")
    return client.batch_get_v2([PoolTransfer("kv", tokens(0, len(keys)), keys=keys)])["kv"]


def count_copies(io):
    """The arena offsets of each ``io.from_arena`` call from now on (the calls still copy)."""
    copied = []
    real = io.from_arena

    def counting(starts, arena, offsets):
        copied.append(list(offsets))
        real(starts, arena, offsets)

    io.from_arena = counting
    return copied


def test_stale_guess_is_copied_again_from_the_leased_slot(daemon):
    a1, b, a2 = pool(seed=1), pool(seed=2), pool(seed=3)
    with daemon.client() as c1, daemon.client() as c2:
        put(c1, a1, ["A"])
        first = c1._recall.seen("kv", "A")
        c1.flush("l2")
        put(c2, b, ["B"])  # B takes A's old slot (lowest free), with a new tag
        put(c2, a2, ["A"], first_page=1)  # A again, elsewhere, other bytes
        with c2:
            pass
        dst = pool()
        assert get(c1, dst, ["A"]) == [True]
        assert torch.equal(page(dst, 0), page(a2, 1)), "copied from the stale slot"
        assert c1._recall.seen("kv", "A") != first  # learnt the new place
        dst.kv_buffer.zero_()
        assert get(c1, dst, ["A"]) == [True]  # now the guess is right
        assert torch.equal(page(dst, 0), page(a2, 1))


def test_flushed_page_is_a_miss_even_though_it_was_guessed(daemon):
    src = pool(seed=4)
    with daemon.client() as c:
        put(c, src, ["P0", "P1"])
        assert c._recall.seen("kv", "P0") is not None
        c.flush("l2")
        dst = pool()
        assert get(c, dst, ["P0", "P1"]) == [False, False]
        assert c._recall.seen("kv", "P0") is None  # a miss forgets the place


def test_guesses_of_a_restarted_daemon_are_void(make_daemon):
    d = make_daemon(extra=["--l3-backend", "none", "--no-shared-gets"])
    a, b = pool(seed=5), pool(seed=6)
    with d.client() as c1:
        put(c1, a, ["A"])
        guess = c1._recall.seen("kv", "A")
        d.stop()
        d.start()
        with d.client() as c2:
            put(c2, b, ["A"])  # same key, same first slot of a fresh arena, other bytes
        dst = pool()
        assert get(c1, dst, ["A"]) == [True]  # c1 joins the new daemon on the way
        assert torch.equal(page(dst, 0), page(b, 0))
        assert c1._recall.seen("kv", "A")[0] == guess[0]  # same offset ...
        assert c1._recall.seen("kv", "A")[1] != guess[1]  # ... another tag


def test_speculation_can_be_turned_off(daemon):
    src = pool(seed=7)
    with daemon.client(remember_pages=0) as c:
        put(c, src, ["X"])
        assert len(c._recall) == 0
        dst = pool()
        assert get(c, dst, ["X"]) == [True]
        assert torch.equal(page(dst, 0), page(src, 0))


def test_small_pages_are_not_remembered(daemon):
    small = HostPool.allocate_mla(4, 1, layers=1, kv_dim=32, dtype=torch.float32)  # 128 bytes
    with daemon.client() as c:
        c.register_mem_host_pool_v2(small, "kv")
        assert all(c.batch_set_v2([PoolTransfer("kv", torch.arange(2), keys=["s0", "s1"])])["kv"])
        assert len(c._recall) == 0


def test_remembered_places_are_bounded(daemon):
    src = pool(seed=8, num_pages=8)
    with daemon.client(remember_pages=4) as c:
        put(c, src, [f"K{i}" for i in range(8)])
        assert 0 < len(c._recall) <= 4
        assert c._recall.seen("kv", "K7") is not None  # the newest are kept


def test_slot_tags_are_unique_and_differ_between_daemons():
    def tags(index):
        entries = [index.reserve(("ns", "kv"), f"k{i}", 64, 64) for i in range(50)]
        return [e.gen for e in entries]

    one = tags(PageIndex(SlabAllocator(1 << 20, 1 << 16)))
    two = tags(PageIndex(SlabAllocator(1 << 20, 1 << 16)))
    assert len(set(one)) == 50 and all(one)
    assert not set(one) & set(two)


def test_same_offset_with_another_tag_is_copied_again(daemon):
    """The slot may have changed hands *during* the speculative copy (evicted, rewritten and
    leased again at the same offset): only the tag tells. Counted copies show the recopy."""
    src = pool(seed=9)
    with daemon.client() as c:
        put(c, src, ["T"])
        off, tag = c._recall.seen("kv", "T")
        dst = pool()
        c.register_mem_host_pool_v2(dst, "kv")
        copied = count_copies(c._pools.io("kv"))
        keys = ["T"]
        assert c.batch_get_v2([PoolTransfer("kv", tokens(0), keys=keys)])["kv"] == [True]
        assert copied == [[off]]  # right guess: one copy, made while the lease was on its way
        copied.clear()
        c._recall.note("kv", "T", off, tag + 1)  # same slot, another page's tag
        assert c.batch_get_v2([PoolTransfer("kv", tokens(0), keys=keys)])["kv"] == [True]
        assert copied == [[off], [off]]  # the guess, then again from the leased slot
        assert torch.equal(page(dst, 0), page(src, 0))


# ---------------------------------------------------------------- flushes void the guesses


def test_a_flush_through_the_client_voids_its_guesses(make_daemon, tmp_path):
    """A flushed page comes back from L3 into another slot: copying the old slots while the
    load runs would only compete with it, so the client's own flush forgets them."""
    import json

    d = make_daemon(extra=["--no-shared-gets", "--l3-backend", "l3_doubles:SlowFileBackend",
                           "--l3-options",
                           json.dumps({"root": str(tmp_path / "l3"), "get_delay_s": 0.2}),
                           "--no-prefetch"])
    src, dst = pool(seed=6), pool()
    keys = [f"L{i}" for i in range(8)]
    with d.client() as c:
        put(c, src, keys)
        assert get(c, dst, keys) == [True] * 8  # learns the slots
        assert len(c._recall) == 8
        assert wait_until(lambda: c.stats()["l3_writes"] == 8)
        c.flush("l2")
        assert len(c._recall) == 0
        copied = count_copies(c._pools.io("kv"))
        dst.kv_buffer.zero_()
        assert c.batch_get_v2([PoolTransfer("kv", tokens(0, 8), keys=keys)])["kv"] == [True] * 8
        assert len(copied) == 1 and len(copied[0]) == 8  # one copy each, from the new slots
        assert torch.equal(dst.kv_buffer, src.kv_buffer)
        assert len(c._recall) == 8
        c.flush("l3")  # L2 keeps its pages: so do the guesses
        assert len(c._recall) == 8
