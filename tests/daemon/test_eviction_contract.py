"""The eviction policy contract (``hicached/daemon/eviction/interface.py``), for every registered
policy and for ``Fifo``, a policy this module defines and names as ``module:Class`` through the
registry, as an out-of-tree policy is named: run in real daemons (in process, on an ipc://
socket, a real client), under memory pressure. Each must: make the room a set needs, never
evict a pinned page, leave no orphan when it promises none (``orphan_free``), and never let a
get read another page's bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from conftest import DaemonProc
from inproc_daemon import inproc_daemon
from pools import kv_pool, kv_tokens, pages

from hicached import Client, PoolTransfer
from hicached.daemon.entry import COMMITTED
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.eviction.registry import EVICTIONS, make_policy, policy_factory
from hicached.daemon.sessions import namespace_digest

NS = "model-a"
ROUNDS, CHAIN = 8, 12  # 96 pages of 1 KiB set, in chains of 12, into an arena of 64


class Fifo(EvictionPolicy):
    """First in, first out per size class: a page's place is its commit; use changes nothing.
    No chains, no slab reclaim: the least a policy must do."""

    name = "fifo"

    def __init__(self):
        self._queues: dict[int, dict[int, None]] = {}  # stride -> page records, oldest first

    def inserted(self, p: int) -> None:
        self._queues.setdefault(self.ix.p_stride[p], {})[p] = None

    def touched(self, p: int) -> None:
        pass

    def removed(self, p: int) -> None:
        del self._queues[self.ix.p_stride[p]][p]

    def order(self, stride: int) -> Iterator[int]:
        return iter(list(self._queues.get(stride, ())))

    def strides(self) -> list[int]:
        return list(self._queues)

    def make_room(self, stride: int) -> list[int]:
        return [p for p in self.unpinned(stride)][:1]  # the oldest unpinned page, or none


FIFO = f"{__name__}:Fifo"
POLICIES = [*EVICTIONS, FIFO]


def test_the_registry_names_every_policy_and_loads_one_from_outside():
    assert EVICTIONS == ("lru", "prefix", "hybrid", "demote")
    assert [make_policy(n).name for n in POLICIES] == ["lru", "prefix", "hybrid", "demote", "fifo"]
    assert policy_factory(FIFO) is Fifo
    assert (make_policy("hybrid", 2.0).alpha, make_policy("prefix", 2.0).alpha) == (2.0, 0.0)
    with pytest.raises(ValueError,
                       match="eviction: 'mru' is not one of lru, prefix, hybrid, demote"):
        make_policy("mru")
    with pytest.raises(ValueError, match="eviction: 'no_such_mod:X' cannot be loaded"):
        make_policy("no_such_mod:X")
    with pytest.raises(TypeError, match="eviction: 'pytest:raises' is not an EvictionPolicy"):
        make_policy("pytest:raises")


def fill(c, start=0, stop=ROUNDS):
    """Set chains ``start`` to ``stop`` of ``CHAIN`` pages each (chain r: pool pages r * CHAIN
    on, keys ``c<r>-<i>``); every set must get room for all its pages. Returns once the
    daemon has read every commit."""
    keys = []
    for r in range(start, stop):
        chain = [f"c{r}-{i}" for i in range(CHAIN)]
        got = c.batch_set_v2([PoolTransfer("kv", pages(r * CHAIN, CHAIN), keys=chain)], depth=0)
        assert got["kv"] == [True] * CHAIN, (r, got)
        keys += chain
    c.wait_committed()  # (a set sends its commit without waiting): read in process after it
    return keys


def check_bytes(endpoint, src, keys):
    """Every key a get (a second client, into a pool of its own) finds reads exactly the bytes
    set for it (its page of ``src``); returns how many it found."""
    dst = kv_pool(num_pages=len(keys))
    with Client(endpoint, NS) as c:
        c.register_mem_host_pool_v2(dst, "kv")
        got = c.batch_get_v2([PoolTransfer("kv", pages(0, len(keys)), keys=keys)])["kv"]
    for i, (key, hit) in enumerate(zip(keys, got)):
        if hit:
            j = int(key[1:].split("-")[0]) * CHAIN + int(key.split("-")[1])
            assert torch.equal(kv_tokens(dst, i, 1), kv_tokens(src, j, 1)), key
    return sum(got)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_frees_the_room_sets_need_and_gets_read_the_right_bytes(tmp_path, policy):
    with inproc_daemon(tmp_path, eviction=policy, l2_size=64 << 10, slab_size=16 << 10,
                       l3_backend="none", evict_ahead=0) as d, Client(d.endpoint, NS) as c:
        src = kv_pool(num_pages=ROUNDS * CHAIN, seed=7)
        c.register_mem_host_pool_v2(src, "kv")
        keys = fill(c)
        ix = d.daemon.index
        assert d.daemon.call(lambda: (len(ix), ix.evictions)) == (64, ROUNDS * CHAIN - 64)
        assert check_bytes(d.endpoint, src, keys) == 64
        assert c.batch_exists(keys[-CHAIN:]) == CHAIN  # the last set is whole
        st = c.stats()
        assert st["eviction"] == make_policy(policy).name
        if make_policy(policy).orphan_free:
            assert st["l2_orphan_bytes"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_never_evicts_a_pinned_page(tmp_path, policy):
    """The first chain's pages pinned (as a lease pins them) while 7 more chains are set into
    an arena of 64 pages: they all stay, byte for byte, and the other sets still get room."""
    with inproc_daemon(tmp_path, eviction=policy, l2_size=64 << 10, slab_size=16 << 10,
                       l3_backend="none", evict_ahead=0) as d, Client(d.endpoint, NS) as c:
        src = kv_pool(num_pages=ROUNDS * CHAIN, seed=8)
        c.register_mem_host_pool_v2(src, "kv")
        first = fill(c, 0, 1)
        ix, table = d.daemon.index, (namespace_digest(NS), "kv")
        held = d.daemon.call(lambda: ix.get_many(table, first))
        d.daemon.call(lambda: ix.pin_many(held))
        keys = first + fill(c, 1)
        r = ix.records
        assert d.daemon.call(lambda: [bool(r.p_flags[e.rec] & COMMITTED) and r.p_gen[e.rec]
                                      == e.gen for e in held]) == [True] * CHAIN
        assert c.batch_exists(first) == CHAIN
        assert check_bytes(d.endpoint, src, keys) == 64
        d.daemon.call(lambda: ix.unpin_many(held))
        if make_policy(policy).orphan_free:
            assert c.stats()["l2_orphan_bytes"] == 0


def test_hicached_serve_takes_an_out_of_tree_policy_by_its_module_name(tmp_path):
    """``hicached serve --eviction module:Class``: the daemon process loads this module's
    ``Fifo`` (its folder on the path) and evicts by it."""
    d = DaemonProc(tmp_path, l2_size="64KiB", slab_size="16KiB",
                   extra=["--eviction", FIFO, "--l3-backend", "none"])
    d.env["PYTHONPATH"] = os.pathsep.join((os.path.dirname(__file__), d.env["PYTHONPATH"]))
    try:
        d.start()
        with d.client(NS) as c:
            src = kv_pool(num_pages=ROUNDS * CHAIN, seed=9)
            c.register_mem_host_pool_v2(src, "kv")
            keys = fill(c)
            assert c.batch_exists(keys[:CHAIN]) == 0  # first in, first out
            assert check_bytes(d.endpoint, src, keys) == 64
            assert c.stats()["eviction"] == "fifo"
    finally:
        d.cleanup()
