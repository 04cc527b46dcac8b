"""Hybrid radix cache: KV pages at every node, a recurrent state only at some (``hybrid-radix-cache.md``).

    root ─[t0..t15](S)─[t16..t31]( )─┬─[t32..t47](S)      (S) a state slot, ( ) a tombstone
                                     └─[u32..u47](S)

* Keys are token ids in whole pages (``page_size`` P); a node's ``pages`` are KV page ids, one per
  P tokens of its edge, and ``hashes`` the matching hicached page keys. Children are keyed by
  their first page of tokens, so two edges out of a node never share a first page.
* A node's ``state`` is the state after every token from the root to the end of the node. A
  tombstone has KV but no state (a split point, or a state evicted under pressure). A match can
  only *end* on a node holding a state (the recurrent layers cannot resume elsewhere), so
  ``match_prefix`` returns the deepest stateful node and reports the KV matched past it
  (``kv_len``) and the page-aligned ``branching_len`` where a new state would be worth keeping.
* Two LRUs (oldest first): ``kv_lru`` of every node and ``state_lru`` of stateful nodes, with
  separate lock counts: ``kv_lock`` (a user of the node's KV; locks every ancestor too) and
  ``state_lock`` (a user of this node's state only). Touching a node refreshes it and then its
  ancestors behind it, so states are evicted from the root end first.
* ``evict(n)`` frees least recently used unlocked leaves (KV and state), cascading up through
  tombstones left childless; ``evict_states(n)`` frees states least recently used first, turning
  inner nodes into tombstones and evicting leaves. Leaf rule: every leaf holds a state.
* Counters: ``kv_evictable`` / ``kv_protected`` in pages, ``state_evictable`` /
  ``state_protected`` in slots; ``available + evictable + protected == total`` when idle.

For a model without recurrent layers (``hybrid=False``, e.g. DeepSeek-V3.2) every node is usable
and the state machinery is inert. Tree states are immutable snapshots: a request copies a matched
state into its own slot (copy-on-write) and only ever donates new snapshots.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hicached.engine.pools import IdAllocator


class TreeNode:
    """One edge of the tree (see the module docstring)."""

    __slots__ = (
        "children",
        "hashes",
        "hit_count",
        "id",
        "key",
        "kv_lock",
        "kv_stored",
        "pages",
        "parent",
        "state",
        "state_lock",
        "state_stored",
    )

    def __init__(self, node_id: int, key: tuple[int, ...] = (), pages: Sequence[int] = (),
                 hashes: Sequence[str] = (), parent: TreeNode | None = None,
                 state: int | None = None):
        self.id = node_id
        self.key = tuple(key)
        self.pages = list(pages)
        self.hashes = list(hashes)
        self.state = state
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.kv_lock = 0
        self.state_lock = 0
        self.hit_count = 0
        self.kv_stored = False  # this node's KV pages were written to hicached
        self.state_stored = False  # this node's state was written to hicached

    def path(self) -> list[TreeNode]:
        """Nodes from the root's child down to this node."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens={len(self.key)}, state={self.state}, "
                f"kv_lock={self.kv_lock}, state_lock={self.state_lock})")


class MatchResult(NamedTuple):
    """``pages``: KV pages of the usable prefix (ending at ``node``, which holds a state);
    ``kv_node`` / ``kv_pages`` / ``kv_len``: deepest node, pages and tokens of the raw KV match
    (through tombstones, >= usable); ``branching_len``: tokens matched past ``node``, or None."""

    pages: list[int]
    node: TreeNode
    kv_node: TreeNode
    kv_pages: list[int]
    kv_len: int
    branching_len: int | None


class Lock(NamedTuple):
    """What ``inc_lock`` locked, so ``dec_lock`` undoes exactly that."""

    node: TreeNode
    state_locked: bool


class InsertResult(NamedTuple):
    prefix_len: int  # tokens of the key that were already in the tree
    state_exists: bool  # the caller's state was not taken: free it
    node: TreeNode  # the node that ends at the inserted key


class HybridRadixCache:
    """See the module docstring. ``on_evict(node, state_only)`` runs before a node's KV (or,
    with ``state_only``, only its state) is freed: the write-back hook."""

    def __init__(self, page_size: int, kv_alloc: IdAllocator, state_alloc: IdAllocator | None,
                 *, hybrid: bool = True,
                 on_evict: Callable[[TreeNode, bool], None] | None = None):
        if hybrid and state_alloc is None:
            raise ValueError("a hybrid radix cache needs a state allocator")
        self.page_size, self.hybrid = page_size, hybrid
        self.kv_alloc, self.state_alloc = kv_alloc, state_alloc
        self.on_evict = on_evict
        self._ids = itertools.count(1)
        self.root = TreeNode(0)
        self.root.kv_lock = self.root.state_lock = 1  # never evicted, never counted
        self.kv_lru: OrderedDict[int, TreeNode] = OrderedDict()
        self.state_lru: OrderedDict[int, TreeNode] = OrderedDict()
        self.kv_evictable = self.kv_protected = 0
        self.state_evictable = self.state_protected = 0

    # ------------------------------------------------------------ helpers

    def _usable(self, node: TreeNode) -> bool:
        return node.state is not None if self.hybrid else True

    def _child_key(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Tokens of the common prefix of ``a`` and ``b``, in whole pages."""
        p, n, i = self.page_size, min(len(a), len(b)), 0
        while i + p <= n and tuple(a[i : i + p]) == tuple(b[i : i + p]):
            i += p
        return i

    def _touch(self, node: TreeNode) -> None:
        """Refresh ``node`` and its ancestors, the node most recent (ancestors evicted first)."""
        for n in node.path():
            self.kv_lru.move_to_end(n.id)
            if n.state is not None:
                self.state_lru.move_to_end(n.id)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child``'s edge after ``m`` tokens; the new parent is a tombstone."""
        pm = m // self.page_size
        mid = TreeNode(next(self._ids), child.key[:m], child.pages[:pm], child.hashes[:pm],
                       child.parent)
        mid.kv_lock, mid.hit_count, mid.kv_stored = child.kv_lock, child.hit_count, child.kv_stored
        child.parent.children[self._child_key(mid.key)] = mid
        child.key, child.pages, child.hashes = child.key[m:], child.pages[pm:], child.hashes[pm:]
        child.parent = mid
        mid.children[self._child_key(child.key)] = child
        del self.kv_lru[child.id]
        self.kv_lru[mid.id] = mid
        self.kv_lru[child.id] = child
        if child.state is not None:
            self.state_lru.move_to_end(child.id)
        return mid

    # ------------------------------------------------------------ match

    def match_prefix(self, tokens: Sequence[int], *, count_hit: bool = True) -> MatchResult:
        """Longest usable cached prefix of ``tokens`` (whole pages). Splits an edge the key
        leaves midway (so the tree changes even for a discarded match) and refreshes the LRUs
        of the usable path; ``count_hit`` adds one hit to each node of that path."""
        key = list(tokens[: len(tokens) // self.page_size * self.page_size])
        node, pages, best, best_pages = self.root, [], self.root, 0
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            if self._usable(node):
                best, best_pages = node, len(pages)
            m = self._match_len(child.key, key)
            if m < len(child.key):
                child = self._split(child, m)
                pages += child.pages
                node = child
                break
            pages += child.pages
            node, key = child, key[m:]
        if self._usable(node):
            best, best_pages = node, len(pages)
        if best is not self.root:
            self._touch(best)
            if count_hit:
                for n in best.path():
                    n.hit_count += 1
        kv_len = len(pages) * self.page_size
        branching = kv_len if len(pages) > best_pages else None
        return MatchResult(pages[:best_pages], best, node, pages, kv_len, branching)

    # ------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int], pages: Sequence[int], hashes: Sequence[str],
               state: int | None, prev_prefix_len: int = 0) -> InsertResult:
        """Insert ``tokens`` (whole pages) with KV ``pages``, page keys ``hashes`` and the state
        after the last token (hybrid: required; else None).

        Where the tree already holds a page, it keeps its own; the caller's duplicates past
        ``prev_prefix_len`` (tokens the caller already shared with the tree) are freed here.
        A state is never overwritten: ``state_exists`` tells the caller to free its own."""
        p = self.page_size
        if len(tokens) % p or len(pages) != len(tokens) // p or len(hashes) != len(pages):
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} "
                             f"pages, {len(hashes)} hashes (page_size {p})")
        if self.hybrid and state is None and tokens:
            raise ValueError("a hybrid radix cache inserts a state with every key")
        key, pages, hashes = list(tokens), list(pages), list(hashes)
        node, total = self.root, 0
        while key and self._child_key(key) in node.children:
            node = node.children[self._child_key(key)]
            self._touch(node)
            m = self._match_len(node.key, key)
            if prev_prefix_len < total + m:
                dup = pages[max(0, prev_prefix_len - total) // p : m // p]
                self.kv_alloc.free(dup)
            total += m
            key, pages, hashes = key[m:], pages[m // p :], hashes[m // p :]
            if m < len(node.key):
                node = self._split(node, m)
        if key:
            leaf = TreeNode(next(self._ids), key, pages, hashes, node, state)
            leaf.hit_count = 1
            node.children[self._child_key(key)] = leaf
            self.kv_lru[leaf.id] = leaf
            self.kv_evictable += len(pages)
            if state is not None:
                self.state_lru[leaf.id] = leaf
                self.state_evictable += 1
            return InsertResult(total, False, leaf)
        if node is not self.root and node.state is None and state is not None:
            node.state, node.state_stored = state, False
            self.state_lru[node.id] = node
            self.state_evictable += 1
            return InsertResult(total, False, node)
        return InsertResult(total, state is not None, node)

    # ------------------------------------------------------------ locks

    def inc_lock(self, node: TreeNode) -> Lock:
        """Protect ``node``'s state (if it has one) and the KV of its whole path."""
        state_locked = node is not self.root and node.state is not None
        if state_locked:
            if node.state_lock == 0:
                self.state_evictable -= 1
                self.state_protected += 1
            node.state_lock += 1
        n = node
        while n is not self.root:
            if n.kv_lock == 0:
                self.kv_evictable -= len(n.pages)
                self.kv_protected += len(n.pages)
            n.kv_lock += 1
            n = n.parent
        return Lock(node, state_locked)

    def dec_lock(self, lock: Lock) -> None:
        """Undo one ``inc_lock``."""
        node = lock.node
        if lock.state_locked:
            assert node.state_lock > 0 and node.state is not None, node
            node.state_lock -= 1
            if node.state_lock == 0:
                self.state_evictable += 1
                self.state_protected -= 1
        n = node
        while n is not self.root:
            assert n.kv_lock > 0, n
            n.kv_lock -= 1
            if n.kv_lock == 0:
                self.kv_evictable += len(n.pages)
                self.kv_protected -= len(n.pages)
            n = n.parent
        # A tombstone that lost its children (or its state) while locked is useless KV now:
        # drop it so every leaf keeps a state.
        if (self.hybrid and node is not self.root and node.parent is not None
                and node.state is None and not node.children and node.kv_lock == 0):
            self._evict_leaf(node)

    # ------------------------------------------------------------ eviction

    def _lru_leaf(self) -> TreeNode | None:
        for n in self.kv_lru.values():
            if n.kv_lock == 0 and not n.children:
                return n
        return None

    def _free_state(self, node: TreeNode) -> None:
        del self.state_lru[node.id]
        self.state_alloc.free([node.state])
        node.state, node.state_stored = None, False
        self.state_evictable -= 1

    def _remove_leaf(self, node: TreeNode) -> int:
        """Free a leaf's KV (and state) and unlink it; returns the pages freed."""
        if self.on_evict is not None:
            self.on_evict(node, False)
        if node.state is not None:
            self._free_state(node)
        del self.kv_lru[node.id]
        del node.parent.children[self._child_key(node.key)]
        self.kv_alloc.free(node.pages)
        self.kv_evictable -= len(node.pages)
        return len(node.pages)

    def _evict_leaf(self, leaf: TreeNode) -> int:
        """Evict ``leaf`` and the tombstones above it that it leaves childless."""
        freed = self._remove_leaf(leaf)
        parent = leaf.parent
        while (self.hybrid and parent is not self.root and parent.state is None
               and not parent.children and parent.kv_lock == 0):
            up = parent.parent
            freed += self._remove_leaf(parent)
            parent = up
        return freed

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` KV pages from unlocked leaves, LRU first (fewer if
        everything else is locked). Returns the pages freed."""
        freed = 0
        while freed < num_pages:
            leaf = self._lru_leaf()
            if leaf is None:
                break
            freed += self._evict_leaf(leaf)
        return freed

    def evict_states(self, num_states: int) -> int:
        """Free ``num_states`` states, LRU first: inner nodes become tombstones (KV stays),
        leaves are evicted whole. Returns the states freed."""
        freed = 0
        while freed < num_states:
            node = next((n for n in self.state_lru.values() if n.state_lock == 0), None)
            if node is None:
                break
            if node.children or node.kv_lock:
                if self.on_evict is not None:
                    self.on_evict(node, True)
                self._free_state(node)
            else:
                self._evict_leaf(node)
            freed += 1
        return freed

    # ------------------------------------------------------------ inspection

    def nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def tree_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.pages]

    def tree_states(self) -> list[int]:
        return [n.state for n in self.nodes() if n.state is not None]

    @property
    def cached_pages(self) -> int:
        return self.kv_evictable + self.kv_protected

    def sanity_check(self, *, idle: bool = True) -> None:
        """Assert the structural invariants (§4.4); ``idle``: also no locks and the leaf rule."""
        nodes = self.nodes()
        assert set(self.kv_lru) == {n.id for n in nodes}, "kv LRU != tree nodes"
        assert set(self.state_lru) == {n.id for n in nodes if n.state is not None}, \
            "state LRU != stateful nodes"
        evictable = sum(len(n.pages) for n in nodes if n.kv_lock == 0)
        protected = sum(len(n.pages) for n in nodes if n.kv_lock > 0)
        assert (evictable, protected) == (self.kv_evictable, self.kv_protected), \
            f"kv counters {(self.kv_evictable, self.kv_protected)} != {(evictable, protected)}"
        s_ev = sum(1 for n in nodes if n.state is not None and n.state_lock == 0)
        s_pr = sum(1 for n in nodes if n.state is not None and n.state_lock > 0)
        assert (s_ev, s_pr) == (self.state_evictable, self.state_protected), \
            f"state counters {(self.state_evictable, self.state_protected)} != {(s_ev, s_pr)}"
        pages = self.tree_pages()
        assert len(pages) == len(set(pages)), "a KV page is owned by two nodes"
        states = self.tree_states()
        assert len(states) == len(set(states)), "a state slot is owned by two nodes"
        for n in nodes:
            assert len(n.key) == len(n.pages) * self.page_size == len(n.hashes) * self.page_size
            assert n.parent.children.get(self._child_key(n.key)) is n, f"bad child key {n}"
            assert n.state is not None or n.state_lock == 0, f"locked tombstone state {n}"
            assert n.kv_lock >= n.state_lock, n
            assert n.kv_lock >= sum(c.kv_lock for c in n.children.values()), n
            if idle:
                assert n.kv_lock == 0 and n.state_lock == 0, f"locked while idle: {n}"
                if self.hybrid and not n.children:
                    assert n.state is not None, f"tombstone leaf {n}"
