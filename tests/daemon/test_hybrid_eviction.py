"""The hybrid cache controller's eviction (issue 25, ``hicached/daemon/eviction/hybrid.py``):
exact orders on small arenas, the dependants that go with a page on every path that frees
pages, and the orphan bound under random workloads."""

import random

import pytest

from hicached.daemon.eviction.hybrid import HybridPolicy
from hicached.daemon.eviction.lru import LruPolicy
from hicached.daemon.eviction.registry import make_policy
from hicached.daemon.index import IN_L3, PageIndex
from hicached.daemon.orphans import orphans
from hicached.daemon.quotas import NamespaceQuotas
from hicached.daemon.slabs import SlabAllocator

KV, STATE = 64, 512  # slot strides: a slab of 1 KiB holds 16 KV pages or 2 states


def make(slabs, policy="prefix", slab=1024, alpha=1.0, busy=None):
    return PageIndex(SlabAllocator(slabs * slab, slab), policy=make_policy(policy, alpha),
                     busy=busy)


def store(ix, keys, parent=None, depth=-1, states=(), ns="ns", anchor="kv"):
    """One call: KV pages of ``keys`` (a chain under ``parent``) and states of the keys in
    ``states``, reserved, linked and committed as the controller does; the keys stored."""
    entries, done = [], []
    guard = ix.get((ns, anchor), parent) if parent is not None else None
    if guard is not None:  # the controller keeps the call's parent for the call
        ix.pin(guard)
    for k in keys:
        e = ix.reserve((ns, anchor), k, KV, KV)
        if e is not None:
            entries.append(e)
            done.append(k)
    for k in states:
        ix.mark_trailing((ns, "mamba"))
        e = ix.reserve((ns, "mamba"), k, STATE, STATE)
        if e is not None:
            entries.append(e)
    ix.link(ns, list(keys), parent, depth)
    ix.commit_many(entries)
    if guard is not None:
        ix.unpin(guard)
    return done


def held(ix, pool="kv", ns="ns"):
    return sorted(ix.tables.get((ns, pool), ()))


def chain(name, n):
    return [f"{name}{i:02d}" for i in range(n)]


# ---------------------------------------------------------------- exact orders


def test_lru_empties_a_chain_from_its_head_and_prefix_from_its_leaf():
    """The issue's first finding, on one slab of 16 KV pages: chain A (10), then chain B (10).
    LRU evicts A's head, leaving 6 pages no hit can reach; prefix evicts A's tail."""
    a, b = chain("a", 10), chain("b", 10)
    lru = make(1, "lru")
    store(lru, a)
    store(lru, b)
    assert held(lru) == sorted(a[4:] + b)  # a00..a03 gone: every hit on A is 0
    ix = make(1, "prefix")
    store(ix, a)
    store(ix, b)
    assert held(ix) == sorted(a[:6] + b)  # a06..a09 gone: A still hits 6 pages
    assert orphans(ix.records) == (0, 0)
    assert orphans(lru.records)[0] == 6  # every page of A left behind


def test_a_branching_tree_loses_leaves_first_and_never_the_shared_stem():
    ix = make(1, "prefix")
    stem = chain("s", 4)
    store(ix, stem)
    store(ix, chain("x", 4), parent="s03", depth=4)
    store(ix, chain("y", 4), parent="s03", depth=4)  # 12 pages
    store(ix, chain("z", 8))  # 4 more than the slab has: the oldest leaf branch goes first
    assert held(ix) == sorted(stem + chain("y", 4) + chain("z", 8))
    store(ix, chain("w", 4))  # next: y's branch (the stem is not a leaf while y hangs on it)
    assert held(ix) == sorted(stem + chain("z", 8) + chain("w", 4))
    assert orphans(ix.records) == (0, 0)


def test_a_chain_continued_across_calls_goes_from_the_deep_end_of_the_newest_call():
    ix = make(1, "prefix")
    first, second = chain("c", 6), chain("d", 6)
    store(ix, first)
    store(ix, second, parent="c05", depth=6)  # a conversation's second turn
    store(ix, chain("e", 8))  # 4 over: d's tail goes, then (still needing room) nothing of c
    assert held(ix) == sorted(first + second[:2] + chain("e", 8))
    assert orphans(ix.records) == (0, 0)


def test_calls_with_no_parent_are_roots_and_still_go_leaf_first_within_the_call():
    ix = make(1, "prefix")
    store(ix, chain("a", 8))
    store(ix, chain("b", 8))  # b00 names no parent: another root
    store(ix, chain("c", 4))
    assert held(ix) == sorted(chain("a", 4) + chain("b", 8) + chain("c", 4))


def test_a_state_goes_with_the_kv_page_it_needs_and_its_dependants_with_it():
    ix = make(4, "prefix")
    keys = chain("k", 8)
    store(ix, keys, states=["k03", "k07"])
    assert held(ix, "mamba") == ["k03", "k07"]
    # a flush slice (or a quota) takes k02's KV page: k03..k07 and both states depend on it,
    # and k00, k01 then lead to no state (no hit can end on them): all 10 go
    assert ix.drop_one(ix.get(("ns", "kv"), "k02")) == 10
    assert held(ix) == [] and held(ix, "mamba") == []
    store(ix, chain("k", 8), states=["k01", "k07"])
    assert ix.drop_one(ix.get(("ns", "kv"), "k04")) == 7  # k04..k07, the state, k03 and k02
    assert held(ix) == ["k00", "k01"] and held(ix, "mamba") == ["k01"]
    assert orphans(ix.records) == (0, 0)


def test_a_state_leaving_a_leaf_takes_the_kv_pages_no_hit_can_use_any_more():
    ix = make(4, "prefix")
    store(ix, chain("k", 8), states=["k03", "k07"])
    assert ix.drop_one(ix.get(("ns", "mamba"), "k07")) == 5  # the state, k07..k04's KV pages
    assert held(ix) == chain("k", 4) and held(ix, "mamba") == ["k03"]
    assert ix.drop_one(ix.get(("ns", "mamba"), "k03")) == 5  # now nothing is left to hit
    assert held(ix) == []


def test_a_page_with_an_l3_copy_takes_nothing_with_it():
    ix = make(4, "prefix")
    store(ix, chain("k", 6), states=["k05"])
    e = ix.get(("ns", "kv"), "k02")
    e.in_l3 = True
    assert ix.drop_one(e) == 1  # k03.. stay restorable through L3
    assert len(held(ix)) == 5 and held(ix, "mamba") == ["k05"]
    assert orphans(ix.records, l3=True) == (0, 0)


def test_state_less_tails_are_evicted_before_states_and_the_value_keeps_long_prefixes():
    """hybrid: a long shared prefix's state (many KV pages per state byte) outlives a short
    conversation tail used as recently; prefix (LRU among leaves) would take the prefix."""
    for policy, gone in (("prefix", "long"), ("hybrid", "tail")):
        ix = make(3, policy, alpha=2.0)  # 3 slabs: 2 of KV (32 pages), 1 of states (2)
        store(ix, chain("L", 24), states=["L23"])  # a long prefix and its state: first
        store(ix, chain("T", 2), states=["T01"])  # a short tail, later
        store(ix, chain("n", 4), states=["n03"])  # needs a state slot: one of the two goes
        states = held(ix, "mamba")
        assert "n03" in states and len(states) == 2
        assert ("L23" not in states) == (gone == "long"), (policy, states)
        assert orphans(ix.records) == (0, 0), policy


@pytest.mark.parametrize("policy", ["prefix", "hybrid"])
def test_a_mid_chain_state_goes_alone_before_a_leaf_or_a_branch_point(policy):
    """A conversation's earlier turn left a state mid-chain (its next turn extends it): a hit
    ends there only if that very prefix is asked again. It goes first, alone (nothing depends
    on it); a state where the chain branches, and the leaves, stay."""
    ix = make(2, policy)  # 1 slab of 16 KV pages, 1 of 2 states
    store(ix, chain("t", 4), states=["t03"])  # turn 1
    store(ix, chain("u", 4), parent="t03", depth=4, states=["u03"])  # turn 2 extends it
    ix.touch_many([ix.get(("ns", "mamba"), "u03")])
    store(ix, chain("n", 4), states=["n03"])  # needs a state slot
    assert held(ix, "mamba") == ["n03", "u03"]
    assert len(held(ix)) == 12 and orphans(ix.records) == (0, 0)  # every KV page stays
    if policy == "prefix":
        return  # (leaves and mid-chain states in LRU order: the oldest, the branch, goes)
    ix = make(3, policy)  # 1 slab of KV, 2 of 2 states
    store(ix, chain("s", 4), states=["s03"])  # a shared prefix, then two branches on it
    store(ix, chain("a", 2), parent="s03", depth=4, states=["a01"])
    store(ix, chain("b", 2), parent="s03", depth=4, states=["b01"])
    store(ix, chain("n", 2), states=["n01"])
    store(ix, chain("m", 2), states=["m01"])  # a fifth state: a leaf goes, not the branch
    assert "s03" in held(ix, "mamba") and len(held(ix, "mamba")) == 4
    assert orphans(ix.records) == (0, 0)


def test_a_kv_class_reclaims_a_slab_of_states_with_their_dependants():
    ix = make(2, "prefix")
    store(ix, chain("k", 8), states=["k01", "k07"])  # slab 0: 8 KV pages, slab 1: 2 states
    store(ix, chain("m", 8))  # fills slab 0 (16 KV)
    assert ix.alloc.free_slab_count == 0
    store(ix, chain("n", 8))  # 8 more KV: the state slab is the oldest other-class slab?
    assert orphans(ix.records) == (0, 0)
    for key in held(ix, "mamba"):  # every state left still has its whole KV prefix
        assert all(k in held(ix) for k in chain("k", int(key[1:]) + 1))


def test_a_namespace_quota_evicts_its_own_chains_leaf_first():
    ix = make(4, "prefix")
    quotas = NamespaceQuotas(ix, {"q": 16 * KV})
    quotas._limits = {"q": ("q", 16 * KV)}  # the digest of "q" is "q" here (raw namespace)
    quotas._counts["q"] = {"evictions": 0, "rejections": 0}
    store(ix, chain("a", 12), ns="q")
    for k in chain("b", 8):
        assert quotas.admit("q", KV)
        store(ix, [k], parent=None if k == "b00" else f"b{int(k[1:]) - 1:02d}", ns="q")
    assert held(ix, ns="q") == sorted(chain("a", 8) + chain("b", 8))
    assert orphans(ix.records) == (0, 0)


def test_reload_of_alpha_and_names():
    assert type(make_policy("lru")) is LruPolicy
    assert (make_policy("prefix").name, make_policy("hybrid", 2.0).alpha) == ("prefix", 2.0)
    with pytest.raises(ValueError,
                       match="eviction: 'mru' is not one of lru, prefix, hybrid, demote"):
        make_policy("mru")


def test_a_cycle_in_links_is_refused_not_followed():
    ix = make(1, "prefix")
    store(ix, ["a", "b"])
    ix.link("ns", ["b", "a"], None, -1)  # a under b: b hangs under a, so a would be its own
    assert ix.drop_one(ix.get(("ns", "kv"), "a")) >= 1  # terminates
    assert isinstance(ix.policy, HybridPolicy)


# ---------------------------------------------------------------- the orphan bound


@pytest.mark.parametrize("seed", range(12))
def test_random_hybrid_workloads_keep_no_orphans(seed):
    """Conversations, branches, documents with states, under pressure (and flush slices,
    quotas of nothing, leases that pin pages for a while): after every call, no orphan page.
    Odd seeds run as a daemon does, with a reclaimer: the rest of a split segment and the
    tails go in idle turns of a few pages (the pages going are not orphans), and the orphans
    are counted as a stats call counts them."""
    rng = random.Random(seed)
    ix = make(12, rng.choice(["prefix", "hybrid"]), busy=(lambda: False) if seed % 2 else None)
    idle = ix.reclaimer
    roots: list[list[str]] = []
    pinned = []
    for step in range(300):
        seq = []
        if roots and rng.random() < 0.6:  # extend or branch what an exists finds of one
            base, kv = rng.choice(roots), set(held(ix))
            hit = next((i for i, k in enumerate(base) if k not in kv), len(base))
            if hit:
                seq = base[:rng.randrange(1, hit + 1)]
                ix.touch_many([ix.get(("ns", "kv"), k) for k in seq])  # its get
        new = [f"s{step}p{i}" for i in range(rng.randint(1, 10))]
        states = sorted({new[-1]} | ({new[0]} if rng.random() < 0.3 else set()))
        parent = seq[-1] if seq else None
        done = store(ix, new, parent=parent, depth=len(seq) if seq else 0, states=states)
        roots.append(seq + new)
        if done and rng.random() < 0.2:  # a lease pins a page for a few calls
            e = ix.get(("ns", "kv"), rng.choice(done))
            if e is not None:
                ix.pin(e)
                pinned.append(e)
        if pinned and rng.random() < 0.3:
            ix.unpin(pinned.pop(0))
        if rng.random() < 0.05:  # a flush slice drops a random committed page
            keys = held(ix)
            if keys:
                e = ix.get(("ns", "kv"), rng.choice(keys))
                if e.pins == 0:
                    ix.drop_one(e)
        if seed % 2:  # an idle turn a request may cut short, then a stats call
            if rng.random() < 0.7:
                idle.step(pages=rng.randint(1, 4))
            idle.settle()  # (the tails due: a daemon's stats take them before counting)
        assert orphans(ix.records, leaving=idle.leaving()) == (0, 0), (seed, step)
    for e in pinned:
        ix.unpin(e)


def test_orphans_counts_what_lru_leaves_behind():
    ix = make(1, "lru")
    store(ix, chain("a", 10), states=[])
    ix.mark_trailing(("ns", "mamba"))
    assert orphans(ix.records, grace_ticks=0)[0] == 10  # no state anywhere below: nothing to hit
    ix2 = make(1, "lru")
    store(ix2, chain("a", 10))
    e = ix2.get(("ns", "kv"), "a03")
    ix2.drop_one(e)
    assert orphans(ix2.records) == (6, 6 * KV)
    assert orphans(ix2.records, l3=True) == (0, 0)  # with L3, a03 may come back from there
    assert IN_L3  # (the flag a page copied to L3 carries)


def test_a_chain_taken_from_its_leaf_leaves_no_dead_entries_to_pop():
    """Each key above an evicted leaf becomes a leaf and goes a moment later: it is queued as a
    candidate only if it is still a leaf when a heap is next read. Queued as it came, each left
    a dead entry (36 here) that later reservations popped and dropped."""
    from hicached.daemon.eviction.hybrid import _LOW

    ix = make(4, "prefix")  # 64 KV slots
    store(ix, chain("a", 60))
    store(ix, chain("b", 40))  # 36 of A's pages go, from its leaf
    assert held(ix) == sorted(chain("a", 60)[:24] + chain("b", 40))
    assert ix.evictions == 36
    heap = ix.policy._heaps[KV]
    r = ix.records
    assert {r.key_of(r.p_krec[e & _LOW]) for e in heap} >= {"a23", "b39"}  # the leaves
    assert len(heap) <= 3  # (one entry may name a page of B's that took a freed record)
    assert orphans(ix.records) == (0, 0)


def test_a_new_chain_linked_at_once_leaves_the_tree_and_the_victims_of_key_by_key():
    """``KeyTree.linked`` takes a call's new chain (32 keys or more, none linked yet) in a few
    array writes; the tree, the candidates and so every eviction must be those of linking key
    by key, also for chains that continue, rewrite or repeat earlier links."""
    rng = random.Random(11)
    fast, slow = make(24, "hybrid"), make(24, "hybrid")
    slow.policy.tree._linked_fresh = lambda recs, parent: False
    real, fresh = fast.policy.tree._linked_fresh, []
    fast.policy.tree._linked_fresh = (
        lambda recs, parent: fresh.append(real(recs, parent)) or fresh[-1])
    calls = []
    for i in range(60):
        n = rng.choice([32, 40, 48, 5])
        parent = rng.choice([None, None] + [c[rng.randrange(len(c))] for c in calls[-4:]])
        keys = chain(f"c{i}-", n) if rng.random() < 0.8 or not calls else calls[-1]
        with_state = rng.random() < 0.6
        for ix in (fast, slow):
            p = parent if parent is not None and ix.get(("ns", "kv"), parent) else None
            store(ix, keys, parent=p, depth=-1, states=[keys[-1]] if with_state else ())
        calls.append(keys)
        for name in ("up", "kid", "sib", "psib"):
            fast_col, slow_col = getattr(fast.policy.tree, name), getattr(slow.policy.tree, name)
            assert bytes(fast_col) == bytes(slow_col), (i, name)
        assert held(fast) == held(slow) and held(fast, "mamba") == held(slow, "mamba"), i
    assert fast.evictions == slow.evictions > 500  # under pressure throughout
    assert orphans(fast.records) == orphans(slow.records)
    assert 20 < fresh.count(True) < len(fresh)  # both paths taken


@pytest.mark.parametrize("policy", ["prefix", "hybrid"])
def test_the_states_one_call_stored_on_a_chain_go_from_its_deep_end(policy):
    """Issue 48's pressure pattern, small: one call stores a chain with a state every other
    page; a state's slot then goes to the chain's leaf segment and deepest state first (their
    ticks are newer only because a call's pages are counted one by one), so what is left is a
    prefix a hit restores, with every state it needs."""
    ix = make(3, policy)  # 1 slab of 16 KV pages, 2 of 2 states
    c = chain("c", 8)
    store(ix, c, states=["c01", "c03", "c05", "c07"])
    store(ix, chain("n", 2), states=["n01"])  # a fifth state: c06..c07 and their state go
    assert held(ix, "mamba") == ["c01", "c03", "c05", "n01"]
    assert held(ix) == sorted(c[:6] + ["n00", "n01"]) and orphans(ix.records) == (0, 0)
    store(ix, chain("m", 2), states=["m01"])  # then c04..c05: c01 and c03 stay
    assert held(ix, "mamba") == ["c01", "c03", "m01", "n01"]
    assert held(ix) == sorted(c[:4] + ["m00", "m01", "n00", "n01"])
    assert orphans(ix.records) == (0, 0)


# ---------------------------------------------------------------- the key tree, a part


class Heard:
    """A ``TreeListener`` that writes down what the tree told it."""

    def __init__(self):
        self.calls = []

    def key_moved(self, k):
        self.calls.append(("moved", k))

    def keys_moved(self, ks):
        self.calls.append(("moved", list(ks)))

    def parent_now(self, q):
        self.calls.append(("parent", q))

    def leaf_now(self, q):
        self.calls.append(("leaf", q))

    def state_gone_alone(self, k):
        self.calls.append(("state alone", k))


def test_a_key_tree_tells_the_listener_it_was_built_with_what_changed():
    """``KeyTree`` is a part (no policy around it here: the index runs ``lru``): linking a
    chain key by key, each key moved and its parent a parent now; freeing the leaf, its parent
    a leaf again. The tree's columns say the same."""
    from hicached.daemon.eviction.keytree import KeyTree

    ix = make(4, "lru")
    store(ix, chain("a", 3))
    r = ix.records
    a0, a1, a2 = (r.key_record("ns", k) for k in chain("a", 3))
    heard = Heard()
    tree = KeyTree(r, heard)
    tree.grow_keys(len(r.k_len))
    tree.linked([a0, a1, a2], -1)
    assert heard.calls == [("moved", a1), ("parent", a0), ("moved", a2), ("parent", a1)]
    assert [tree.up[k] - 1 for k in (a0, a1, a2)] == [-1, a0, a1]
    assert [tree.kid[k] - 1 for k in (a0, a1, a2)] == [a1, a2, -1]
    heard.calls.clear()
    tree.key_freed(a2)
    assert heard.calls == [("leaf", a1), ("moved", a2)]
    assert (tree.kid[a1], tree.up[a2]) == (0, 0)
    assert tree.doomed(r.page_of(a0, r.p_tid[r.k_head[a0]])) == [r.k_head[a1], r.k_head[a0]]
    quiet = KeyTree(r)  # the Null listener: hears it all, does nothing
    quiet.grow_keys(len(r.k_len))
    quiet.linked([a1, a0], -1)
    assert quiet.up[a0] - 1 == a1
