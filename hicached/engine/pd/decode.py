"""The decode side of PD disaggregation, with its own radix cache (``docs/pd.md``).

A request's life on the decode (``a = len(prompt) // P * P``, the prompt's whole pages):

1. ``add_request``  (radix cache on) load-back from L2 past the device match, as any engine
                    does: prefixes other engines of the node stored are this decode's too
                    (KV pages past its own, with the state at their end; never a state alone)
2. ``_bootstrap``   KV-only match of ``prompt[:a]`` (through tombstones: the prefill sends the
                    state), lock the matched node for the request's life, reserve only the
                    delta pages, a slot for the prompt-end state and the request's running
                    slot; send ``PrefillRequest(decode_prefix_len = matched tokens)``
3. ``_on_ready``    get the delta pages and the state from L2 into the reserved room, insert
                    them into the radix cache at ``a``, move the lock there, copy the state into
                    the request's slot (copy-on-write), rebuild the HF cache
4. the tail         ``a < len(prompt)``: the engine computes the sub-page tail from the state
                    and KV at ``a`` (the same last chunk a non-disaggregated engine computes);
                    ``a == len(prompt)``: the prefill's first token is the first output
5. decode, release  as any engine request (snapshots every ``track_interval``, finish insert)

Ownership while a request waits for the prefill (step 2 -> 3): ``lock`` on the matched node,
``room`` (delta pages and the prompt-end state slot), ``slot``: all request-owned, all given
back by ``_fail`` (prefill failure, timeout, abort, a load that misses). Without
``--disaggregation-decode-enable-radix-cache`` the match is empty: every page is moved.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from hicached.engine.engine import Engine
from hicached.engine.pd import protocol as M
from hicached.engine.pools import OutOfMemory, check_identity
from hicached.engine.radix import Lock
from hicached.engine.request import Request, Status
from hicached.engine.storage import Reservation

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    """What a request holds while the prefill works for it (owner: ``DecodeEngine``)."""

    lock: Lock
    prefix_pages: list[int]  # the decode's own pages of [0, decode_prefix_len)
    decode_prefix_len: int
    room: Reservation  # the delta's pages and the prompt-end state's slot
    deadline: float
    moved_pages: int = 0
    moved_states: int = 0
    first_token: int | None = None
    asked_s: float = 0.0  # perf_counter when the prefill was asked
    prefill_s: float = 0.0  # asked -> Ready received
    publish_s: float = 0.0  # of which the prefill's storing (its Ready says)
    load_s: float = 0.0  # the delta's load from the daemon


class DecodeEngine(Engine):
    """An ``Engine`` fed by a prefill engine over ``bootstrap_endpoint`` (a DEALER socket)."""

    def __init__(self, lm, config, bootstrap_endpoint: str, *, radix: bool = True,
                 timeout_s: float = 30.0, storage=None):
        super().__init__(lm, config, storage)
        if not self.storage.enabled:
            raise ValueError("--disaggregation-mode decode needs --hicache-storage-backend "
                             "hicached (pages travel through the daemon)")
        if self.config.disable_radix_cache:
            raise ValueError("the decode engine keeps prompt pages in its radix cache; use "
                             "it without --disaggregation-decode-enable-radix-cache instead "
                             "of --disable-radix-cache")
        self.radix, self.timeout_s = radix, timeout_s
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(bootstrap_endpoint)
        self.transferring: dict[str, Request] = {}
        self.moved_pages = 0
        self.first_token_mismatches = 0  # the tail's first token != the prefill's (logged)

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 8,
                    rid: str | None = None) -> Request:
        """Queue a request; the prefill is asked when it is bootstrapped (``step``)."""
        req = self._new_request(prompt, max_new_tokens, rid)
        prompt = req.prompt
        if self.radix:
            head = self._head(prompt)
            keys = req.keys.extend(head)
            if keys:
                peek = self.tree.match_prefix(head, count_hit=False)
                # (a state alone is never read: the prefill sends the one at the prompt's end)
                req.loaded = self.hicache.load_back(head, keys, peek, kv_only=True)
        self.waiting.append(req)
        return req

    def _head(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's whole pages (the last one too: the prefill computes it)."""
        return list(prompt[: len(prompt) // self.page_size * self.page_size])

    def abort(self, rid: str) -> bool:
        req = self.transferring.get(rid)
        if req is None:
            return super().abort(rid)
        self._send(M.AbortRequest(rid))
        self._fail(req, "aborted", Status.ABORTED)
        return True

    def run(self) -> None:
        while self.waiting or self.running or self.transferring:
            self.step()

    # ------------------------------------------------------------ admission

    def _admit(self) -> list[Request]:
        """Bootstrap waiting requests, take the prefill's answers, expire, report the ended."""
        ended: list[Request] = []
        while self.waiting:
            req = self.waiting[0]
            ok = self._bootstrap(req)
            if ok is None:
                break
            self.waiting.popleft()
            if not ok:
                req.status = Status.ABORTED
                self.requests.pop(req.rid, None)
                ended.append(req)
        wait_ms = 0 if (self.running or not self.transferring) else 5
        if self.sock.poll(wait_ms, zmq.POLLIN):
            while True:
                try:
                    frame = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                done = self._on_frame(frame)
                if done is not None:
                    ended.append(done)
        now = time.monotonic()
        for req in [r for r in self.transferring.values() if r.transfer.deadline <= now]:
            self._send(M.AbortRequest(req.rid))
            self._fail(req, f"the prefill did not answer within {self.timeout_s}s")
            ended.append(req)
        return ended

    def _bootstrap(self, req: Request) -> bool | None:
        """Match, lock, reserve the delta, ask the prefill: True asked, None no room yet,
        False never fits."""
        ps, head = self.page_size, self._head(req.prompt)
        if self.radix and head:
            m = self.tree.match_prefix(head)
            self.hicache.on_match(m.kv_node)
            node, have = m.kv_node, list(m.kv_pages)
        else:
            node, have = self.tree.root, []
        lock = self.tree.inc_lock(node)
        delta = len(head) // ps - len(have)
        need = math.ceil((len(req.prompt) + req.max_new_tokens) / ps) - len(have)
        hybrid = self.states is not None
        slots = 2 if hybrid else 0
        room = self.kv.allocator.available + self.tree.kv_evictable
        state_room = (self.states.allocator.available + self.tree.state_evictable
                      if hybrid else 0)
        if need > room or state_room < slots:
            self.tree.dec_lock(lock)
            if self.running or self.transferring:
                return None
            req.error = (f"request needs {need} KV pages and {slots} state slots; the device "
                         f"has {room} pages and {state_room} slots")
            return False
        pages, state = [], None
        try:
            pages = self._alloc_pages(delta)
            if hybrid:
                state = self._alloc_state()
                req.slot = self._alloc_state()
        except OutOfMemory as e:  # (room was counted: only a bug gets here)
            self.kv.allocator.free(pages)
            if state is not None:
                self._free_state(state)
            self.tree.dec_lock(lock)
            req.error = str(e)
            return False
        req.transfer = Transfer(lock, have, len(have) * ps, Reservation(pages, state),
                                time.monotonic() + self.timeout_s,
                                asked_s=time.perf_counter())
        self._count_hits(req, len(have) * ps)  # L2 tokens: what the arrival load-back brought
        self.transferring[req.rid] = req
        self._send(M.PrefillRequest(req.rid, req.prompt, len(have) * ps, self.timeout_s))
        return True

    # ------------------------------------------------------------ the prefill's answers

    def _on_frame(self, frame: bytes) -> Request | None:
        try:
            msg = M.decode(frame, "decode")
        except M.PDProtocolError as e:
            log.warning("dropping a bootstrap frame: %s", e)
            return None
        req = self.transferring.get(msg.rid)
        if req is None:
            return None  # a late answer for a request already failed or aborted
        match msg:
            case M.Failed():
                self._fail(req, f"prefill {msg.reason}: {msg.message}")
                return req
            case M.Ready():
                return self._on_ready(req, msg)
        return None

    def _on_ready(self, req: Request, msg: M.Ready) -> Request | None:
        """Load the delta and the state, insert them at ``a``, set the request up to run."""
        ps, t, head = self.page_size, req.transfer, self._head(req.prompt)
        a, n = len(head), len(req.prompt)
        t0 = time.perf_counter()
        t.prefill_s, t.publish_s = t0 - t.asked_s, msg.publish_s
        keys = req.keys.extend(head)
        first = t.decode_prefix_len // ps
        room = t.room
        state_keys = [keys[-1]] if room.state is not None and a else []
        if (msg.stored_pages, msg.state_stored) != (a // ps - first, bool(state_keys)):
            self._fail(req, f"the prefill published {msg.stored_pages} pages and "
                            f"{'a' if msg.state_stored else 'no'} state; asked for "
                            f"{a // ps - first} and {len(state_keys)}")
            return req
        if not self.storage.load(keys[first:], room.kv_pages, state_keys,
                                 [room.state] if state_keys else []):
            self._fail(req, f"the prefill's pages [{first}, {a // ps}) of the prompt were not "
                            "in hicached (evicted, or the daemon is down)")
            return req
        t.load_s = time.perf_counter() - t0
        t.moved_pages, t.moved_states = len(room.kv_pages), len(state_keys)
        self.moved_pages += t.moved_pages
        del self.transferring[req.rid]
        if a:
            res = self.tree.insert(head, t.prefix_pages + room.kv_pages, keys, room.state,
                                   prev_prefix_len=t.decode_prefix_len)
            if res.state_exists:
                self._free_state(room.state)
            m = self.tree.match_prefix(head, count_hit=False)
            assert len(m.pages) == a // ps, (len(m.pages), a)
            lock = self.tree.inc_lock(m.node)
            self.tree.dec_lock(t.lock)
            req.lock, req.pages = lock, list(m.pages)
            if req.slot is not None:
                self.states.copy(m.node.state, req.slot)
        else:  # a prompt shorter than a page: nothing was moved
            if room.state is not None:
                self._free_state(room.state)
            req.lock, req.pages = t.lock, []
        t.room = Reservation([], None)  # the tree owns them now
        req.protected_len = req.computed = a
        req.cache = self.io.build(req.pages, a, req.slot, has_state=a > 0,
                                  capacity=n + req.max_new_tokens)
        req.keep = []
        t.first_token = msg.first_token
        req.first_token_s = time.perf_counter()
        if a == n:  # no tail: the prefill's token is the first output
            req.output_ids.append(msg.first_token)
            req.logits.extend(M.logits_rows(msg.logits, self.lm.vocab_size))
            req.status = Status.DECODE
            if req.max_new_tokens <= 1:
                self._release(req, Status.FINISHED)
                return req
        else:
            req.status = Status.PREFILL
        self.running.append(req)
        return None

    def _prefill(self, req: Request) -> None:
        first_s = req.first_token_s
        super()._prefill(req)
        t = req.transfer
        if req.output_ids and t is not None and req.output_ids[0] != t.first_token:
            self.first_token_mismatches += 1
            log.warning("request %s: the tail's token %d differs from the prefill's %d",
                        req.rid, req.output_ids[0], t.first_token)
        req.first_token_s = first_s or req.first_token_s  # TTFT: the prefill's Ready

    def _fail(self, req: Request, error: str, status: Status = Status.ABORTED) -> None:
        """Give back everything a request waiting for the prefill holds."""
        t = req.transfer
        self.transferring.pop(req.rid, None)
        self.kv.allocator.free(t.room.kv_pages)
        if t.room.state is not None:
            self._free_state(t.room.state)
        t.room = Reservation([], None)
        if req.slot is not None:
            self._free_state(req.slot)
            req.slot = None
        self.tree.dec_lock(t.lock)
        req.error, req.status = error, status
        self.requests.pop(req.rid, None)

    def _send(self, msg) -> None:
        try:
            self.sock.send(M.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # no prefill connected: the request times out
            log.warning("bootstrap send failed (%s): %s", type(msg).__name__, e)

    # ------------------------------------------------------------ checks

    def check_idle(self) -> None:
        if self.transferring:
            raise RuntimeError(f"not idle: {len(self.transferring)} waiting for the prefill")
        super().check_idle()

    def check_busy(self) -> None:
        """The identity with requests running or waiting for the prefill (their own pages,
        reserved rooms and slots are the fourth term)."""
        ps = self.page_size
        own = [p for r in self.running for p in r.pages[r.protected_len // ps:]]
        own += [p for r in self.transferring.values() for p in r.transfer.room.kv_pages]
        check_identity(self.kv.allocator, self.tree.kv_evictable, self.tree.kv_protected,
                       len(own))
        if self.states is not None:
            reqs = [*self.running, *self.transferring.values()]
            slots = sum(r.slot is not None for r in reqs)
            slots += sum(r.transfer.room.state is not None for r in self.transferring.values())
            check_identity(self.states.allocator, self.tree.state_evictable,
                           self.tree.state_protected, slots)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
        super().close()
