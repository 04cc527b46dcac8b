"""The set calls of ``Client`` (``api.py``): reserve -> copy -> commit of every pool's pages of
a call, with the chain it belongs to (``Reserve``'s parent, depth, anchor pool and the pools
whose hits are TRAILING_PAGES, for the daemon's eviction policy). Set-ahead slots
(``overlap.SetAhead``) are copied into while the ``Reserve`` travels."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hicached import protocol as P
from hicached.client.args import NO_CHAIN, Chain, check_chain
from hicached.client.connection import Connection
from hicached.client.exists import KV
from hicached.client.overlap import PageRecall, SetAhead
from hicached.client.pools import Plan, PoolTable
from hicached.errors import InvalidTransfer
from hicached.types import PoolHitPolicy, PoolTransfer, key_list

TRAILING = PoolHitPolicy.TRAILING_PAGES.value


class SetCalls:
    """``batch_set_v2`` / ``batch_set_pages`` / ``batch_set_v1`` of ``Client``.

    Owns nothing of its own. Mutates the arena slots the daemon reserved for a call (and the
    set-ahead slots of ``ahead``), ``recall`` (where the pages went) and the connection's
    commit counter; reads its plans from ``pools``. A call blocks for one ``Reserve`` round
    trip; its ``Commit`` goes without waiting (``Connection.send_commit``)."""

    def __init__(self, conn: Connection, pools: PoolTable, recall: PageRecall,
                 ahead: SetAhead):
        self._conn = conn
        self._pools = pools
        self._recall = recall
        self._ahead = ahead

    def batch_set_v2(self, transfers: Sequence[Any], extra_info: Any = None, *,
                     parent: str | None = None, depth: int | None = None,
                     anchor_pool: Any = None) -> dict[str, list[bool]]:
        """Store every pool's pages of the call atomically (reserve -> copy -> commit).

        One round trip (Reserve); the Commit is sent without waiting. Per key: True when the
        page was copied (or was already there / being written by another client), False when
        the arena had no evictable room.

        Where the call's pages hang, for the daemon's chains (``Reserve``): the keys of the
        ``anchor_pool`` transfer (None: the first transfer) are consecutive pages of one
        sequence; ``parent`` is the key of the page before the first of them (None: a root or
        not known) and ``depth`` the number of pages before it (None: not known). SGLang
        passes them as ``extra_info.prefix_keys``: parent = its last, depth = its length."""
        plan = self._pools.plan(transfers)
        chain = check_chain(parent, depth, anchor_pool, [p[0] for p in plan])
        trailing = tuple(p[0] for p, t in zip(plan, transfers, strict=True)
                         if _value(getattr(t, "hit_policy", None)) == TRAILING)
        return self.store(plan, chain._replace(trailing=trailing) if trailing else chain)

    def batch_set_pages(self, pool_name: Any, keys: Sequence[str],
                        pages: Sequence[torch.Tensor], *, parent: str | None = None,
                        depth: int | None = None) -> list[bool]:
        """Store flat page tensors (SGLang's generic v0 path): ``pages[i]`` under ``keys[i]``
        in the registered pool ``pool_name`` (whose page size they must have). ``parent`` and
        ``depth``: as ``batch_set_v2``."""
        chain = check_chain(parent, depth, None, ())
        name, plan = self._pools.pages_plan(pool_name, keys, [p.contiguous() for p in pages])
        return self.store(plan, chain)[name]

    def store(self, plan: Plan, chain: Chain = NO_CHAIN) -> dict[str, list[bool]]:
        """Store the pages of ``plan`` (reserve -> copy -> commit); one bool per key of each
        pool, as ``batch_set_v2``."""
        conn = self._conn
        with conn.inflight:  # counted before the check: close() waits for it, or it sees
            conn.check_open()  # the client closed
            return self._store_now(plan, chain)

    def _store_now(self, plan: Plan, chain: Chain) -> dict[str, list[bool]]:
        conn = self._conn
        sent = time.monotonic()
        epoch = conn.epoch
        claim = self._ahead.claim(plan, epoch, sent, conn.reservation_ttl_s)
        pool_keys = [P.PoolKeys(n, k) for n, _, k, _ in plan]

        def build(s: int, r: int) -> P.Reserve:
            if claim is None or conn.epoch != epoch:  # joined again: those slots are void
                return P.Reserve(r, s, pool_keys, anchor_pool=chain.anchor_pool,
                                 parent=chain.parent, depth=chain.depth,
                                 trailing=list(chain.trailing))
            return P.Reserve(r, s, pool_keys, claim.ahead, claim.want,
                             anchor_pool=chain.anchor_pool, parent=chain.parent,
                             depth=chain.depth, trailing=list(chain.trailing))

        arena = conn.arena
        failed = claim.failed if claim is not None else set()

        def copy_ahead() -> None:  # only into slots the request just sent named (same epoch)
            if conn.epoch == epoch:
                claim.copy(arena)
        try:
            res, (epoch, arena, _) = conn.call(
                build, while_waiting=copy_ahead if claim and claim.jobs else None, view=True)
        except BaseException:
            if claim is not None:
                claim.settle((), (), -1)
            raise
        if claim is not None:
            claim.settle([name for name, _, _, _ in plan], res.ahead, epoch)
        ok = [[off >= 0 for off in row] for row in res.offsets]
        if res.reservation_id:
            try:
                for p, ((name, io, _, starts), row) in enumerate(zip(plan, res.offsets)):
                    done = res.bound[p] if p < len(res.bound) and p not in failed else ()
                    sel = [i for i, off in enumerate(row) if off >= 0 and not (done and done[i])]
                    if not sel:
                        continue
                    if time.monotonic() - sent > conn.reservation_ttl_s / 2:
                        raise TimeoutError(f"reservation too old to copy into ({name})")
                    try:
                        io.to_arena([starts[i] for i in sel], arena.tensor,
                                    [row[i] for i in sel])
                    except (ValueError, TypeError, IndexError) as e:  # PageIO._check: the
                        raise InvalidTransfer(f"pool {name!r}: {e}") from e  # caller's indices
            except BaseException:
                self.abort(res.reservation_id)
                raise
            # Fire and forget: the daemon publishes all pools of the call at once when it reads
            # this; requests this client sends later are ordered after it (one socket). A commit
            # that never arrives (client killed now) only loses the pages: the slots expire.
            # (seq: the daemon acknowledges it in the presence table.) Refused when another
            # thread joined a restarted daemon meanwhile, or close() gave up waiting for this
            # call: the commit cannot reach the reservation's session
            if not conn.send_commit(epoch, res.reservation_id, ok):
                return {name: [False] * len(keys) for name, _, keys, _ in plan}
            for (name, io, keys, _), row, tags in zip(plan, res.offsets, res.tags):
                self._recall.learn(name, io, keys, row, tags)
        return {name: [off >= 0 or off in (P.SLOT_PRESENT, P.SLOT_INFLIGHT) for off in row]
                for (name, _, _, _), row in zip(plan, res.offsets)}

    def abort(self, reservation_id: int) -> None:
        """Abort reservation ``reservation_id`` without waiting (if this is lost, the
        reservation expires on its own)."""
        conn = self._conn
        conn.send_only(P.Commit(0, conn.session, reservation_id, abort=True, reply=False))

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None, *,
                     parent: str | None = None, depth: int | None = None) -> list[bool]:
        """v1: store KV pages from the registered KV host pool (``parent`` and ``depth``: as
        ``batch_set_v2``)."""
        return self.batch_set_v2([PoolTransfer(KV, host_indices, keys=key_list(keys))],
                                 parent=parent, depth=depth)[KV]


def _value(enum_or_str: Any) -> Any:
    return getattr(enum_or_str, "value", enum_or_str)
