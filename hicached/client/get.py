"""The client's get calls: pages it saw before are read with no lease, checked by the daemon's slot
tags (``leaseless.py``); the others are leased, copied out of the arena and released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from hicached import protocol as P
from hicached.client.connection import Connection
from hicached.client.exists import KV
from hicached.client.leaseless import read_known, still_there
from hicached.client.overlap import PageRecall
from hicached.client.pools import Plan, PoolTable
from hicached.errors import InvalidTransfer
from hicached.types import PoolTransfer, key_list

log = logging.getLogger(__name__)


class GetCalls:
    """``batch_get_v2``, ``batch_get_pages`` (SGLang's v0 page tensors) and ``batch_get_v1`` of
    ``Client``.

    Owns nothing but ``shared_gets`` (whether to read known pages with no lease). Mutates the
    caller's host pools (the pages it loads), ``recall`` (where pages were found) and the
    connection's pending releases; reads its plans from ``pools``. A call blocks for one lease
    round trip per batch of pages still loading from L3, at most ``timeout_s`` in all."""

    def __init__(self, conn: Connection, pools: PoolTable, recall: PageRecall,
                 shared_gets: bool):
        self._conn = conn
        self._pools = pools
        self._recall = recall
        self.shared_gets = shared_gets  # read known pages checked by their slot tags

    def batch_get_v2(self, transfers: Sequence[Any], extra_info: Any = None
                     ) -> dict[str, list[bool]]:
        """Load every pool's pages into their host pools; one bool per key."""
        return self.load(self._pools.plan(transfers))

    def batch_get_pages(self, pool_name: Any, keys: Sequence[str],
                        pages: Sequence[torch.Tensor]) -> list[bool]:
        """Fill contiguous flat page tensors (SGLang's generic v0 path): ``pages[i]`` gets the
        bytes of ``keys[i]`` of pool ``pool_name``; one bool per key (False: left untouched)."""
        name, plan = self._pools.pages_plan(pool_name, keys, pages)
        return self.load(plan)[name]

    def load(self, plan: Plan) -> dict[str, list[bool]]:
        """Load the pages of ``plan``; one bool per key of each pool (``_load_now``)."""
        conn = self._conn
        with conn.inflight:  # (see SetCalls.store)
            conn.check_open()
            return self._load_now(plan)

    def _load_now(self, plan: Plan) -> dict[str, list[bool]]:
        """Lease, copy out, release. Streamed: when pages must come from L3 the daemon answers
        as soon as the first ones are in the arena (the rest ``SLOT_LOADING``); they are copied
        while the others load, then the loading ones are asked for again (joining the loads in
        flight, starting none), until none is loading or the call's deadline passes.

        Unleased reads (``leaseless.py``): where the daemon publishes slot tags, pages whose
        slot this client learnt from an earlier set or get are copied from there with no
        request, checked by their tags; only the others are leased. A get of pages used before
        then sends nothing at all.

        Speculative copies (no slot tags: ``shared_gets`` off, or not x86): pages whose slot
        this client learnt (``PageRecall.learn``) are copied from there while the first lease
        request is on its way. The answer names every page's (offset, tag); a tag is unique to
        one page's stay in one slot, so a copy from the same (offset, tag) read that page's final bytes (the slot held
        them from when this client learnt it until the lease pinned it), and any other page is
        copied again from its leased slot. So a get of pages this client used before costs about
        one copy instead of a round trip plus a copy. A miss may leave speculated bytes in its
        host page (pools of ``batch_get_pages`` are never speculated into)."""
        sent = time.monotonic()
        out = {name: [False] * len(keys) for name, _, keys, _ in plan}
        todo = [(name, io, list(range(len(keys)))) for name, io, keys, _ in plan]
        keys_of = {name: keys for name, _, keys, _ in plan}
        starts_of = {name: starts for name, _, _, starts in plan}
        conn = self._conn
        epoch, arena, shared = conn.view  # one daemon's arena and tags, never a mix
        read: dict = {}  # pages read with no lease (``read_known``)
        if shared is not None and self.shared_gets and shared.view.grain:
            guesses, copy = {}, None  # (pages that fail the tags are stale guesses)
            read, touched = read_known(self._recall, shared.view, todo, keys_of, starts_of,
                                       arena)
            todo = [(name, io, [i for j, i in enumerate(idx) if j not in read.get(name, ())])
                    for name, io, idx in todo]
            for name, js in read.items():
                for j in js:
                    out[name][j] = True
            todo = [t for t in todo if t[2]]
            if touched:
                conn.releases.add_reads(touched, 0 if todo else 1)
        else:
            guesses, copy = self._recall.guess(todo, keys_of, starts_of, arena)
        first = True
        while todo:
            req = [P.PoolKeys(name, [keys_of[name][i] for i in idx]) for name, _, idx in todo]
            load = first
            res, (now, arena, _) = conn.call(
                lambda s, r, req=req, load=load: P.Lease(r, s, req, stream=True, load=load),
                while_waiting=copy if first else None, view=True)
            if first and now != epoch:
                guesses = {}  # the daemon restarted under the speculative copies
            again = []
            try:
                for p, ((name, io, idx), row) in enumerate(zip(todo, res.offsets)):
                    tags = res.tags[p] if p < len(res.tags) else []
                    g = guesses.get(name, {}) if first and tags else {}
                    # pages not where this client saw them (all of them without guesses)
                    new = [j for j, off in enumerate(row) if g.get(j) != (off, tags[j])] \
                        if g else range(len(row))
                    sel = [j for j in new if row[j] >= 0]
                    if sel:
                        try:
                            io.from_arena([starts_of[name][idx[j]] for j in sel], arena.tensor,
                                          [row[j] for j in sel])
                        except (ValueError, TypeError, IndexError) as e:  # (PageIO._check)
                            raise InvalidTransfer(f"pool {name!r}: {e}") from e
                    for j, off in enumerate(row):
                        if off >= 0:
                            out[name][idx[j]] = True
                    if new and tags and now == conn.epoch:  # (a guess that held: known)
                        self._recall.learn(name, io, [keys_of[name][idx[j]] for j in new],
                                           [row[j] for j in new], [tags[j] for j in new])
                    wait = [idx[j] for j, off in enumerate(row) if off == P.SLOT_LOADING]
                    if wait:
                        again.append((name, io, wait))
            finally:
                if res.lease_id:
                    conn.releases.add(res.lease_id)
            first = False
            if time.monotonic() - sent > conn.lease_ttl_s / 2:
                log.warning("get took longer than half the lease TTL: results discarded")
                return {name: [False] * len(row) for name, row in out.items()}
            if again and time.monotonic() - sent > conn.timeout_s:
                break  # what is still loading is a miss for this call
            todo = again
        if read and (not first or len(read) > 1):  # hits of one instant (``leaseless.py``)
            for name, js in still_there(shared.view, read).items():
                for j in js:
                    out[name][j] = False
        return out

    def batch_get_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """v1: load KV pages into the registered KV host pool."""
        return self.batch_get_v2([PoolTransfer(KV, host_indices, keys=key_list(keys))])[KV]
