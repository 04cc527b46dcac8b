"""The set calls of ``Client`` (``api.py``): reserve -> copy -> commit of every pool's pages of
a call, with the chain it belongs to (``Reserve``'s parent, depth, anchor pool and the pools
whose hits are TRAILING_PAGES, for the daemon's eviction policy)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hicached import protocol as P
from hicached.client.args import NO_CHAIN, Chain, check_chain
from hicached.client.calls import token_starts
from hicached.client.exists import KV
from hicached.client.flatpages import TensorPages
from hicached.kernels.pageio import PageIO
from hicached.errors import DaemonUnavailable, InvalidTransfer, LengthMismatch
from hicached.types import PoolHitPolicy, PoolTransfer, key_list, pool_value

TRAILING = PoolHitPolicy.TRAILING_PAGES.value


class SetCalls:
    """``batch_set_v2`` / ``batch_set_pages`` / ``batch_set_v1`` (a mixin of ``Client``)."""

    def _plan(self, transfers: Sequence[Any]) -> list[tuple[str, PageIO, list[str], list[int]]]:
        plan = []
        for t in transfers:
            name = pool_value(t.name)
            if any(name == p[0] for p in plan):  # results are per pool: one would be lost
                raise InvalidTransfer(f"pool {name!r} is named twice in one call: put its "
                                      "keys in one transfer")
            keys = key_list(t.keys or (), f"pool {name!r}: keys")
            io = self._io(name)
            plan.append((name, io, keys, token_starts(t.host_indices, len(keys),
                                                       io.page_size, name, io.capacity_tokens)))
        return plan

    def _pages_plan(self, pool_name: Any, keys: Sequence[str], pages: Sequence[torch.Tensor]
                    ) -> tuple[str, list[tuple[str, PageIO, list[str], list[int]]]]:
        name = pool_value(pool_name)
        keys = key_list(keys)
        if len(keys) != len(pages):
            raise LengthMismatch(f"pool {name!r}: {len(keys)} keys but {len(pages)} pages")
        try:
            io = TensorPages(pages, self._io(name).page_bytes)
        except ValueError as e:
            raise InvalidTransfer(f"pool {name!r}: {e}") from None
        return name, [(name, io, keys, list(range(len(keys))))]

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
        plan = self._plan(transfers)
        chain = check_chain(parent, depth, anchor_pool, [p[0] for p in plan])
        trailing = tuple(p[0] for p, t in zip(plan, transfers, strict=True)
                         if _value(getattr(t, "hit_policy", None)) == TRAILING)
        return self._store(plan, chain._replace(trailing=trailing) if trailing else chain)

    def batch_set_pages(self, pool_name: Any, keys: Sequence[str],
                        pages: Sequence[torch.Tensor], *, parent: str | None = None,
                        depth: int | None = None) -> list[bool]:
        """Store flat page tensors (SGLang's generic v0 path): ``pages[i]`` under ``keys[i]``
        in the registered pool ``pool_name`` (whose page size they must have). ``parent`` and
        ``depth``: as ``batch_set_v2``."""
        chain = check_chain(parent, depth, None, ())
        name, plan = self._pages_plan(pool_name, keys, [p.contiguous() for p in pages])
        return self._store(plan, chain)[name]

    def _store(self, plan: list[tuple[str, PageIO, list[str], list[int]]],
               chain: Chain = NO_CHAIN) -> dict[str, list[bool]]:
        with self._inflight:  # counted before the check: close() waits for it, or it sees
            if self._closed:   # the client closed
                raise DaemonUnavailable("client is closed")
            return self._store_now(plan, chain)

    def _store_now(self, plan: list[tuple[str, PageIO, list[str], list[int]]], chain: Chain
                   ) -> dict[str, list[bool]]:
        sent = time.monotonic()
        epoch = self._epoch
        claim = self._ahead.claim(plan, epoch, sent, self.reservation_ttl_s)
        pool_keys = [P.PoolKeys(n, k) for n, _, k, _ in plan]

        def build(s: int, r: int) -> P.Reserve:
            if claim is None or self._epoch != epoch:  # joined again: those slots are void
                return P.Reserve(r, s, pool_keys, anchor_pool=chain.anchor_pool,
                                 parent=chain.parent, depth=chain.depth,
                                 trailing=list(chain.trailing))
            return P.Reserve(r, s, pool_keys, claim.ahead, claim.want,
                             anchor_pool=chain.anchor_pool, parent=chain.parent,
                             depth=chain.depth, trailing=list(chain.trailing))

        arena = self.arena
        failed = claim.failed if claim is not None else set()

        def copy_ahead() -> None:  # only into slots the request just sent named (same epoch)
            if self._epoch == epoch:
                claim.copy(arena)
        try:
            res, (epoch, arena, _) = self._call(
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
                    if time.monotonic() - sent > self.reservation_ttl_s / 2:
                        raise TimeoutError(f"reservation too old to copy into ({name})")
                    try:
                        io.to_arena([starts[i] for i in sel], arena.tensor,
                                    [row[i] for i in sel])
                    except (ValueError, TypeError, IndexError) as e:  # PageIO._check: the
                        raise InvalidTransfer(f"pool {name!r}: {e}") from e  # caller's indices
            except BaseException:
                self._abort(res.reservation_id)
                raise
            # Fire and forget: the daemon publishes all pools of the call at once when it reads
            # this; requests this client sends later are ordered after it (one socket). A commit
            # that never arrives (client killed now) only loses the pages: the slots expire.
            with self._lock:  # seq: the daemon acknowledges it in the presence table
                # another thread joined a restarted daemon meanwhile, or close() gave up
                # waiting for this call: the commit cannot reach the reservation's session
                if self._epoch != epoch or self._sock is None:
                    return {name: [False] * len(keys) for name, _, keys, _ in plan}
                self._commits[0] += 1
                self._send_only(P.Commit(0, self.session, res.reservation_id, ok, reply=False,
                                         seq=self._commits[0]))
            for (name, io, keys, _), row, tags in zip(plan, res.offsets, res.tags):
                self._recall.learn(name, io, keys, row, tags)
        return {name: [off >= 0 or off in (P.SLOT_PRESENT, P.SLOT_INFLIGHT) for off in row]
                for (name, _, _, _), row in zip(plan, res.offsets)}

    def _abort(self, reservation_id: int) -> None:
        # if this is lost, the reservation expires on its own
        self._send_only(P.Commit(0, self.session, reservation_id, abort=True, reply=False))

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None, *,
                     parent: str | None = None, depth: int | None = None) -> list[bool]:
        """v1: store KV pages from the registered KV host pool (``parent`` and ``depth``: as
        ``batch_set_v2``)."""
        return self.batch_set_v2([PoolTransfer(KV, host_indices, keys=key_list(keys))],
                                 parent=parent, depth=depth)[KV]


def _value(enum_or_str: Any) -> Any:
    return getattr(enum_or_str, "value", enum_or_str)
