"""The reference engine tells the daemon where the pages it stores hang: each store call carries
the keys of every page before its first (SGLang's ``prefix_keys``), taken from its radix tree,
through the SGLang plugin. The daemon runs in-process to read its index's ``chain``; no model is
needed (the pools are filled by nobody: only keys and links are looked at)."""

import pytest
import torch
from inproc_daemon import inproc_daemon

from hicached.engine.hicache import HiCache
from hicached.engine.pools import KVPool, StatePool
from hicached.engine.radix import HybridRadixCache
from hicached.engine.storage import HicachedStorage

PS = 4


class Harness:
    """A hybrid radix tree whose nodes a ``HiCache`` writes through to the daemon."""

    def __init__(self, endpoint):
        cpu = torch.device("cpu")
        self.kv = KVPool("mha", 32, PS, 2, 2, 8, 8, torch.float32, cpu)
        self.states = StatePool(8, 2, (2, 4), (3, 4), torch.float32, cpu)
        self.storage = HicachedStorage(endpoint, "engine-chains", self.kv, None, self.states)
        self.ns = self.storage.plugin.namespace.namespace
        self.tree = HybridRadixCache(PS, self.kv.allocator, self.states.allocator, hybrid=True)
        self.hicache = HiCache(self.tree, self.storage, "write_through", 1,
                               self.kv.allocator.alloc, lambda: self.states.allocator.alloc(1)[0],
                               self.kv.allocator.free, lambda s: self.states.allocator.free([s]))
        self.tokens: list[int] = []
        self.hashes: list[str] = []

    def extend(self, name, num_pages):
        """Insert the sequence so far plus ``num_pages`` pages keyed ``<name>0``...: a node
        (the tree frees the pages given for what it holds already)."""
        self.tokens += [len(self.tokens) + i for i in range(num_pages * PS)]
        self.hashes += [f"{name}{i}" for i in range(num_pages)]
        pages = self.kv.allocator.alloc(len(self.hashes))
        state = self.states.allocator.alloc(1)[0]
        return self.tree.insert(self.tokens, pages, self.hashes, state).node


@pytest.fixture
def harness(tmp_path):
    with inproc_daemon(tmp_path) as d:
        h = Harness(d.endpoint)
        h.chain = d.chain
        yield h
        h.storage.close()


def test_a_node_is_stored_after_the_pages_of_its_ancestors(harness):
    h = harness
    a = h.extend("a", 3)
    h.hicache.backup(a)  # a root node: depth 0
    assert [h.chain(h.ns, k) for k in ("a0", "a1", "a2")] == [(None, 0), ("a0", 1), ("a1", 2)]
    b = h.extend("b", 2)
    h.hicache.backup(b)  # only b is unstored: it hangs after a's last page
    assert [h.chain(h.ns, k) for k in ("b0", "b1")] == [("a2", 3), ("b0", 4)]
    assert (h.hicache.stored_pages, h.hicache.stored_states) == (5, 2)
    assert h.storage.errors == 0


def test_states_alone_go_one_call_each_with_their_own_prefix(harness):
    """Nodes whose KV an earlier call stored (a call that said nothing of its chain) and whose
    states are unstored: a state's key is its node's last page's, so each state is its own
    chain of one key; in one call the daemon would take y1 for x1's child."""
    h = harness
    x = h.extend("x", 2)
    y = h.extend("y", 2)
    assert h.storage.store(h.hashes, x.pages + y.pages, [], [])[0]
    for n in (x, y):
        n.kv_stored = True
    assert h.chain(h.ns, "y0") == ("x1", -1)
    h.hicache.backup(y)
    assert [h.chain(h.ns, k) for k in ("x1", "y1")] == [("x0", 1), ("y0", 3)]
    assert h.hicache.stored_states == 2
