"""The engine's side of hierarchical caching: what goes to hicached, and what comes back.

Write policy (device -> daemon L2; the daemon's own policy then moves pages to L3):

    write_through            a node is stored when it enters the radix cache
    write_through_selective  ... once it has ``threshold`` hits (matches)
    write_back               ... just before the device evicts it (its KV, or only its state)

A node is always stored together with the unstored part of its path (keys are a chain: a page
is reachable only if every earlier page is), with its state and the states of its ancestors.
``kv_stored`` / ``state_stored`` on the node remember what the daemon already received.
Write-through is off the time-to-first-token path, as SGLang's backup thread is: inserts queue
their node, and the engine drains the queue (``flush_pending``) once a request has its first
token, and before it unlocks its nodes (so a queued node cannot be evicted first).

Load-back (on a request's arrival): match the device radix cache, ask hicached for the longest
prefix every pool can restore past the device's usable match, reserve device room (evicting),
load the missing KV pages and the state at the end into it, and insert them into the radix cache
as a node holding that state. The request's admission then matches it like any device hit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hicached.engine.pools import OutOfMemory
from hicached.engine.radix import HybridRadixCache, MatchResult, TreeNode
from hicached.engine.storage import Reservation, Storage

log = logging.getLogger(__name__)


class LoadBack(NamedTuple):
    """Tokens ``[from_tokens, to_tokens)`` became usable on the device thanks to hicached.
    ``read_pages`` / ``read_states``: what was read for it (the device may have held the KV of
    the first of those pages already, and lacked only a state past them)."""

    from_tokens: int
    to_tokens: int
    l3_fraction: float
    read_pages: int = 0
    read_states: int = 0


NO_LOAD = LoadBack(0, 0, 0.0)


class HiCache:
    """Write policy and load-back between one engine's radix cache and a ``Storage``."""

    def __init__(self, tree: HybridRadixCache, storage: Storage, policy: str, threshold: int,
                 alloc_pages: Callable[[int], list[int]], alloc_state: Callable[[], int],
                 free_pages: Callable[[list[int]], None], free_state: Callable[[int], None]):
        self.tree, self.storage = tree, storage
        self.policy = policy
        self.threshold = 1 if policy == "write_through" else threshold
        self.alloc_pages, self.alloc_state = alloc_pages, alloc_state
        self.free_pages, self.free_state = free_pages, free_state
        self.stored_pages = 0
        self.stored_states = 0
        self.pending: list[TreeNode] = []

    # ------------------------------------------------------------ write

    def on_insert(self, node: TreeNode) -> None:
        """A node just entered (or got a state in) the radix cache: queue its backup."""
        if self.storage.enabled and self.policy != "write_back" \
                and node.hit_count >= self.threshold:
            self.pending.append(node)

    def flush_pending(self) -> None:
        """Store the queued nodes that are still in the radix cache."""
        pending, self.pending = self.pending, []
        for node in pending:
            if node.id in self.tree.kv_lru:
                self.backup(node)

    def on_match(self, node: TreeNode) -> None:
        """A request matched (and locked) up to ``node``, hit counts already incremented:
        queue its backup once it is hot enough."""
        if self.storage.enabled and self.policy == "write_through_selective" \
                and node.hit_count >= self.threshold:
            self.pending.append(node)

    def on_evict(self, node: TreeNode, state_only: bool) -> None:
        """The device is about to free ``node``'s KV and state (or only its state)."""
        if self.storage.enabled and self.policy == "write_back":
            self.backup(node)

    def backup(self, node: TreeNode) -> None:
        """Store the unstored part of ``node``'s path: KV pages and every state on it. States
        alone go one call each: the daemon links a call's first pool's keys as consecutive
        pages (``Client.batch_set_v2``), and the states of several nodes are not."""
        path = node.path()
        kv_nodes = [n for n in path if not n.kv_stored]
        state_nodes = [n for n in path if n.state is not None and not n.state_stored]
        if kv_nodes:
            self._store(path, kv_nodes, state_nodes)
        else:
            for n in state_nodes:
                self._store(path, [], [n])

    def _store(self, path: list[TreeNode], kv_nodes: list[TreeNode],
               state_nodes: list[TreeNode]) -> None:
        """One store call, with the keys of every page before its first (SGLang's
        ``prefix_keys``): where its pages hang, for the daemon's chains. The KV pages are the
        path's unstored tail (a node is stored with its whole path), else the prefix is not
        said."""
        first = kv_nodes[0] if kv_nodes else state_nodes[0]
        at = path.index(first)
        prefix: list[str] | None = [h for n in path[:at] for h in n.hashes]
        if not kv_nodes:
            prefix += first.hashes[:-1]  # a state's key is its node's last page's
        elif path[at:] != kv_nodes:
            prefix = None
        kv_ok, state_ok = self.storage.store(
            [h for n in kv_nodes for h in n.hashes], [p for n in kv_nodes for p in n.pages],
            [n.hashes[-1] for n in state_nodes], [n.state for n in state_nodes],
            prefix_keys=prefix)
        if kv_ok:
            for n in kv_nodes:
                n.kv_stored = True
            self.stored_pages += sum(len(n.pages) for n in kv_nodes)
        if state_ok:
            for n in state_nodes:
                n.state_stored = True
            self.stored_states += len(state_nodes)

    # ------------------------------------------------------------ read

    def load_back(self, tokens: Sequence[int], keys: Sequence[str], match: MatchResult,
                  kv_only: bool = False) -> LoadBack:
        """Bring what hicached holds past ``match`` (of ``tokens``, whole pages, with page
        ``keys``) onto the device and into the radix cache. ``kv_only``: not when that is only
        a state (the device holds every KV page hicached has: the PD decode, whose prefill
        sends the state it needs)."""
        if not self.storage.enabled or not keys:
            return NO_LOAD
        ps = self.tree.page_size
        usable = len(match.pages)
        have = match.kv_len // ps
        lock = self.tree.inc_lock(match.kv_node)  # keep the device KV we build on
        try:
            asked: list[Reservation] = []

            def reserve(n: int) -> Reservation | None:
                room = self._reserve(n)
                if room is not None:
                    asked.append(room)
                return room

            fetched = self.storage.prefetch(keys, usable, have, reserve, kv_only)
            room = fetched.reservation
            if fetched.end_pages == 0:
                if asked:
                    self._release(asked[0])
                return NO_LOAD
            if asked and len(asked[0].kv_pages) > len(room.kv_pages):  # a partial prefetch
                self.free_pages(asked[0].kv_pages[len(room.kv_pages):])
            end, first = fetched.end_pages, fetched.first_page
            pages = list(match.kv_pages[:first]) + room.kv_pages
            res = self.tree.insert(tokens[: end * ps], pages, keys[:end], room.state,
                                   prev_prefix_len=first * ps)
            if res.state_exists:
                self.free_state(room.state)
            for n in res.node.path():  # every page of the path is in hicached
                n.kv_stored = True
            if room.state is not None and res.node.state == room.state:
                res.node.state_stored = True
            return LoadBack(usable * ps, end * ps, fetched.l3_fraction, len(room.kv_pages),
                            int(room.state is not None))
        finally:
            self.tree.dec_lock(lock)

    def _reserve(self, num_pages: int) -> Reservation | None:
        try:
            pages = self.alloc_pages(num_pages)
        except OutOfMemory:
            return None
        state = None
        if self.tree.hybrid:
            try:
                state = self.alloc_state()
            except OutOfMemory:
                self.free_pages(pages)
                return None
        return Reservation(pages, state)

    def _release(self, room: Reservation) -> None:
        self.free_pages(room.kv_pages)
        if room.state is not None:
            self.free_state(room.state)
