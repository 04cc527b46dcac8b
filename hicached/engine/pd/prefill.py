"""The prefill side of PD disaggregation: compute prompts, publish their pages, say ready.

A request's life on the prefill (``docs/pd.md``):

1. ``PrefillRequest`` arrives on the bootstrap ROUTER; it becomes an engine request with
   ``max_new_tokens=1`` (the prefill's own radix cache and L2 load-back serve what they can)
2. the engine computes the prompt, keeping a state snapshot at ``a = len(prompt) // P * P``
   (one of the engine's snapshot points: the request then holds a lock on that node)
3. ``_publish`` (before the request lets go of its nodes): store pages ``[decode_prefix_len / P,
   a / P)`` and the state after ``a`` in hicached, whatever the write policy, and wait until
   they are visible to the decode (``Storage.wait_visible``): with ``transfer="l2"`` (one node,
   one daemon) until the daemon has read the commit (``Client.wait_committed``); with
   ``transfer="l3"`` (two nodes, two daemons sharing a store) until those pages are stored in
   L3 (``Client.wait_stored``: written now whatever the daemon's write policy)
4. ``Ready`` (first token and its logits) goes back; any failure is a ``Failed`` instead

A request that waits or runs past its ``timeout_s`` is aborted (``Failed(timeout)``); an
``AbortRequest`` aborts it wherever it is. Everything it held is given back (``Engine._release``).
"""

from __future__ import annotations

import logging
import time

from hicached.engine.engine import Engine
from hicached.engine.pd import protocol as M
from hicached.engine.pd.router import RouterServer
from hicached.engine.request import Request, Status
from hicached.engine.storage import TRANSFER_TIERS
from hicached.errors import HicachedError

log = logging.getLogger(__name__)


class PublishError(HicachedError):
    """The prompt's pages could not be made visible to the decode."""


class PrefillEngine(Engine):
    """An ``Engine`` whose finished prompts are published for a decode engine. Needs hicached
    storage (the transport) and the radix cache (the prompt-end snapshot lives in it).
    ``transfer``: where the pages must be before ``Ready`` (``l2``: the decode uses this
    engine's daemon; ``l3``: the decode's daemon shares this one's L3 store)."""

    def __init__(self, lm, config, storage=None, transfer: str = "l2"):
        if transfer not in TRANSFER_TIERS:
            raise ValueError(f"unknown disaggregation transfer {transfer!r}; valid: "
                             f"{list(TRANSFER_TIERS)}")
        super().__init__(lm, config, storage)
        self.transfer = transfer
        if not self.storage.enabled:
            raise ValueError("--disaggregation-mode prefill needs --hicache-storage-backend "
                             "hicached (pages travel through the daemon)")
        if self.config.disable_radix_cache:
            raise ValueError("--disaggregation-mode prefill needs the radix cache (the prompt-"
                             "end state is a snapshot in it)")
        self.asked: dict[str, int] = {}  # rid -> decode_prefix_len
        # rid -> (pages, state) stored, and the seconds that took
        self.published: dict[str, tuple[int, bool, float]] = {}
        self.published_pages = 0

    def add_prefill(self, rid: str, prompt: list[int], decode_prefix_len: int) -> Request:
        """Queue ``prompt`` for the decode that holds ``decode_prefix_len`` tokens of it."""
        ps = self.page_size
        a = len(prompt) // ps * ps
        if decode_prefix_len % ps or not 0 <= decode_prefix_len <= a:
            raise ValueError(f"decode_prefix_len {decode_prefix_len} must be a multiple of "
                             f"page_size {ps} in [0, {a}]")
        req = self.add_request(prompt, 1, rid)
        self.asked[rid] = decode_prefix_len
        return req

    def _release(self, req: Request, status: Status) -> None:
        held = self.asked.pop(req.rid, None)
        if status is Status.FINISHED and held is not None:
            try:
                t0 = time.perf_counter()
                pages, state = self._publish(req, held)
                self.published[req.rid] = pages, state, time.perf_counter() - t0
            except (PublishError, HicachedError) as e:
                req.error = f"publishing the prompt's pages failed: {e}"
                status = Status.ABORTED
        super()._release(req, status)

    def _publish(self, req: Request, held: int) -> tuple[int, bool]:
        """Store pages ``[held / P, a / P)`` and the state after ``a``; wait until visible
        (``transfer``: in L2, or those pages in L3)."""
        ps, n = self.page_size, len(req.prompt)
        a = n // ps * ps
        if a == 0:
            return 0, False
        if req.protected_len != a:  # the snapshot at a was skipped (every state slot locked)
            raise PublishError(f"no snapshot at the prompt's last page boundary {a} (the "
                               f"request holds {req.protected_len} tokens of the cache)")
        node = req.lock.node
        path = node.path()
        keys = [h for x in path for h in x.hashes]
        pages = [p for x in path for p in x.pages]
        assert len(keys) == len(pages) == a // ps, (len(keys), len(pages), a)
        first = held // ps
        hybrid = self.tree.hybrid
        if hybrid and node.state is None:
            raise PublishError(f"the node at {a} has no state")
        kv_keys = keys[first:]
        state_keys = [keys[-1]] if hybrid else []
        prefix = keys[:first] if kv_keys else keys[:-1]  # where the call's first key hangs
        kv_ok, state_ok = self.storage.store(kv_keys, pages[first:], state_keys,
                                             [node.state] if hybrid else [],
                                             prefix_keys=prefix)
        if (kv_keys and not kv_ok) or (hybrid and not state_ok):
            raise PublishError(f"the daemon stored {'all' if kv_ok else 'not all'} of "
                               f"{len(kv_keys)} pages and {'the' if state_ok else 'no'} state "
                               "(L2 full, or the daemon is down)")
        self.storage.wait_visible(kv_keys, state_keys, tier=self.transfer)
        for x in path:
            x.kv_stored = True
        if hybrid:
            node.state_stored = True
        self.published_pages += len(kv_keys)
        return len(kv_keys), hybrid


class PrefillServer(RouterServer):
    """The bootstrap ROUTER in front of a ``PrefillEngine``; ``serve_forever`` or ``poll_once``
    from one thread (the owner of the engine and the socket)."""

    def __init__(self, engine: PrefillEngine, endpoint: str):
        super().__init__(engine, endpoint)
        self.deadlines: dict[str, float] = {}

    def _tick(self) -> None:
        self._expire()

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = M.decode(frame, "prefill")
        except M.PDProtocolError as e:
            log.warning("dropping a bootstrap frame: %s", e)
            return
        match msg:
            case M.PrefillRequest():
                if msg.rid in self.peers:
                    self._send(ident, M.Failed(msg.rid, "error", "request id already in use"))
                    return
                try:
                    self.engine.add_prefill(msg.rid, msg.prompt, msg.decode_prefix_len)
                except ValueError as e:
                    self._send(ident, M.Failed(msg.rid, "error", str(e)))
                    return
                self.peers[msg.rid] = ident
                self.deadlines[msg.rid] = time.monotonic() + msg.timeout_s
            case M.AbortRequest():
                if self.engine.abort(msg.rid):
                    self.engine.asked.pop(msg.rid, None)
                    self._finish(msg.rid, M.Failed(msg.rid, "abort", "aborted by the decode"))

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self.deadlines.items() if t <= now]:
            if self.engine.abort(rid):
                self.engine.asked.pop(rid, None)
                self._finish(rid, M.Failed(rid, "timeout", "prefill timed out"))

    def _answer(self, req: Request) -> None:
        if req.status is Status.FINISHED and req.rid in self.engine.published:
            pages, state, publish_s = self.engine.published.pop(req.rid)
            self._finish(req.rid, M.Ready(req.rid, req.output_ids[0],
                                          M.logits_bytes(req.logits[:1]), pages, state,
                                          publish_s))
        else:
            self._finish(req.rid, M.Failed(req.rid, "error", req.error or "prefill failed"))

    def _finish(self, rid: str, msg) -> None:
        self.deadlines.pop(rid, None)
        ident = self.peers.pop(rid, None)
        if ident is not None:
            self._send(ident, msg)
