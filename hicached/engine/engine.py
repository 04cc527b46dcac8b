"""The reference engine: a scheduler over one model, its device pools and hybrid radix cache.

A request's life (batch size 1 per forward: transformers' CPU kernels do not pack sequences; the
scheduler interleaves requests chunk by chunk, so their locks and pages really overlap):

1. ``add_request``  page keys of the prompt; peek at the radix cache; load-back from hicached of
                    what it holds past the device match (``HiCache.load_back``): arrival prefetch
2. ``_admit``       match (hits counted) and lock the prefix; check the room; copy the matched
                    state into a private slot (copy-on-write); rebuild the HF cache from pages;
                    pick the snapshot positions (track interval, prompt end, branching point)
3. ``_prefill``     one chunk (``prefill_chunk_pages`` pages, cut at snapshot positions): forward,
                    write its KV into the request's pages; at a snapshot position insert the
                    prefix with a copy of the state (``_cache_unfinished``), switch to the tree's
                    canonical pages and move the lock down
4. ``_decode``      one token; a snapshot every ``track_interval`` tokens
5. ``_release``     free the request's own pages and slot, unlock its prefix (finish or abort)

Never more than ``len(prompt) - 1`` tokens are taken from the cache: the last prompt token is
always computed, so the first output token has logits.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Sequence

from hicached.engine.cache_io import CacheIO
from hicached.engine.config import EngineConfig
from hicached.engine.hicache import NO_LOAD, HiCache
from hicached.engine.models import LoadedModel
from hicached.engine.pools import (
    IndexerPool,
    KVPool,
    OutOfMemory,
    StatePool,
    check_identity,
)
from hicached.engine.radix import HybridRadixCache, MatchResult
from hicached.engine.request import Request, Status
from hicached.engine.storage import Storage, make_storage
from hicached.keys import KeyChain, namespace


class Engine:
    """See the module docstring. ``storage``: a ``Storage`` to use instead of the one the
    config names (tests, tools)."""

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None,
                 storage: Storage | None = None):
        self.lm, self.config = lm, config or EngineConfig()
        cfg, g = self.config, lm.geometry
        if str(lm.device) != str(cfg.device) and cfg.device != lm.device.type:
            raise ValueError(f"model is on {lm.device}, the engine config says {cfg.device}")
        self.page_size = ps = cfg.page_size
        self.kv = KVPool(g.kind, cfg.kv_pages, ps, len(g.attn_layers), g.kv_heads, g.k_dim,
                         g.v_dim, g.kv_dtype, lm.device, debug=cfg.debug_pools)
        self.indexer = IndexerPool(cfg.kv_pages, ps, len(g.attn_layers), g.indexer_dim,
                                   g.indexer_dtype, lm.device) if g.has_indexer else None
        self.states = StatePool(cfg.state_slots, len(g.linear_layers), g.conv_shape,
                                g.recurrent_shape, g.state_dtype, lm.device,
                                conv_dtype=g.conv_dtype,
                                debug=cfg.debug_pools) if g.hybrid else None
        self.io = CacheIO(g, lm.new_cache, self.kv, self.indexer, self.states)
        self.namespace = namespace(
            lm.identity, lm.weights_digest, str(g.kv_dtype).removeprefix("torch."),
            f"{g.kind}-paged", ps, salt=cfg.tenant)
        self.storage = storage or make_storage(
            cfg.storage_backend, cfg.hicached_endpoint, self.namespace, self.kv, self.indexer,
            self.states, prefetch_policy=cfg.prefetch_policy, timeout_s=cfg.storage_timeout_s,
            retry_s=cfg.storage_retry_s)
        self.tree = HybridRadixCache(ps, self.kv.allocator,
                                     self.states.allocator if self.states else None,
                                     hybrid=g.hybrid)
        self.hicache = HiCache(self.tree, self.storage, cfg.write_policy,
                               cfg.write_through_threshold, self._alloc_pages,
                               self._alloc_state, self.kv.allocator.free, self._free_state)
        self.tree.on_evict = self.hicache.on_evict
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests by id
        self._rids = itertools.count()

    # ------------------------------------------------------------ allocation

    def _alloc_pages(self, n: int) -> list[int]:
        """``n`` KV pages, evicting from the radix cache if short; raises OutOfMemory."""
        alloc = self.kv.allocator
        if n > alloc.available:
            self.tree.evict(n - alloc.available)
        pages = alloc.alloc(n)
        if pages is None:
            raise OutOfMemory(f"need {n} KV pages, {alloc.available} free after eviction "
                              f"({self.tree.kv_protected} protected by running requests)")
        return pages

    def _alloc_state(self) -> int:
        alloc = self.states.allocator
        if alloc.available == 0:
            self.tree.evict_states(1)
        got = alloc.alloc(1)
        if got is None:
            raise OutOfMemory(f"no state slot free after eviction "
                              f"({self.tree.state_protected} locked by running requests)")
        return got[0]

    def _free_state(self, slot: int) -> None:
        self.states.allocator.free([slot])

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 8,
                    rid: str | None = None) -> Request:
        """Queue a request; prefetches its prefix from hicached at once (arrival)."""
        req = self._new_request(prompt, max_new_tokens, rid)
        if not self.config.disable_radix_cache and self.storage.enabled:
            head = self._cacheable(prompt)
            keys = req.keys.extend(head)
            peek = self.tree.match_prefix(head, count_hit=False)
            req.loaded = self.hicache.load_back(head, keys, peek)
        self.waiting.append(req)
        return req

    def _new_request(self, prompt: Sequence[int], max_new_tokens: int, rid: str | None
                     ) -> Request:
        """A checked, registered request (not queued); ValueError names what is wrong."""
        prompt = [int(t) for t in prompt]
        if not prompt or max_new_tokens < 1:
            raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1, got "
                             f"{len(prompt)} tokens and {max_new_tokens}")
        if max(prompt) >= self.lm.vocab_size or min(prompt) < 0:
            raise ValueError(f"token ids must be in [0, {self.lm.vocab_size})")
        rid = rid or f"r{next(self._rids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, max_new_tokens, self.page_size,
                      keys=KeyChain(self.page_size))
        self.requests[rid] = req
        req.loaded = NO_LOAD
        return req

    def _cacheable(self, prompt: Sequence[int]) -> list[int]:
        """The whole pages of the prompt a cache may serve (the last token is always run)."""
        n = (len(prompt) - 1) // self.page_size * self.page_size
        return list(prompt[:n])

    def abort(self, rid: str) -> bool:
        """Stop a live request wherever it is; everything it holds is given back. False when
        no live request has that id (unknown, or already ended)."""
        req = self.requests.pop(rid, None)
        if req is None:
            return False
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            req.status = Status.ABORTED
        else:
            self.running.remove(req)
            self._release(req, Status.ABORTED)
        return True

    def step(self) -> list[Request]:
        """Admit what fits, then run one prefill chunk or decode step of the next running
        request. Returns the requests that ended in this step."""
        ended = self._admit()
        if not self.running:
            return ended
        req = self.running.popleft()
        try:
            if req.status is Status.PREFILL:
                self._prefill(req)
            else:
                self._decode(req)
        except OutOfMemory as e:
            req.error = str(e)
            self._release(req, Status.ABORTED)
            return ended + [req]
        if len(req.output_ids) >= req.max_new_tokens:
            self._release(req, Status.FINISHED)
            return ended + [req]
        self.running.append(req)
        return ended

    def run(self) -> None:
        """Step until nothing waits or runs."""
        while self.waiting or self.running:
            self.step()

    def generate(self, prompt: Sequence[int], max_new_tokens: int = 8) -> Request:
        """Run one request to the end (others queued before it run too)."""
        req = self.add_request(prompt, max_new_tokens)
        while not req.done:
            self.step()
        return req

    # ------------------------------------------------------------ admission

    def _admit(self) -> list[Request]:
        ended = []
        while self.waiting:
            req = self.waiting[0]
            ok = self._try_admit(req)
            if ok is None:
                break  # no room now: wait for running requests to finish
            self.waiting.popleft()
            if not ok:
                req.status = Status.ABORTED
                self.requests.pop(req.rid, None)
                ended.append(req)
            else:
                self.running.append(req)
        return ended

    def _try_admit(self, req: Request) -> bool | None:
        """Match, lock and set up ``req``: True admitted, None no room yet, False never fits."""
        ps, head = self.page_size, self._cacheable(req.prompt)
        if self.config.disable_radix_cache:
            m = MatchResult([], self.tree.root, self.tree.root, [], 0, None)
        else:
            m = self.tree.match_prefix(head)
            self.hicache.on_match(m.node)
        cached = len(m.pages) * ps
        need = math.ceil((len(req.prompt) + req.max_new_tokens) / ps) - len(m.pages)
        lock = self.tree.inc_lock(m.node)
        room = self.kv.allocator.available + self.tree.kv_evictable
        state_room = (self.states.allocator.available + self.tree.state_evictable
                      if self.states else 2)
        if need > room or state_room < 2:
            self.tree.dec_lock(lock)
            if self.running:
                return None
            req.error = (f"request needs {need} KV pages and 2 state slots; the device has "
                         f"{room} pages and {state_room} slots")
            return False
        req.lock, req.pages, req.protected_len = lock, list(m.pages), cached
        req.computed = cached
        if self.states is not None:
            req.slot = self._alloc_state()
            if m.node.state is not None:
                self.states.copy(m.node.state, req.slot)  # copy-on-write of the match
        req.cache = self.io.build(req.pages, cached, req.slot, has_state=cached > 0,
                                  capacity=len(req.prompt) + req.max_new_tokens)
        self._count_hits(req, cached)
        req.keep = self._snapshot_points(req, cached, m.branching_len)
        req.status = Status.PREFILL
        return True

    def _count_hits(self, req: Request, cached: int) -> None:
        lb = req.loaded
        from_storage = max(0, min(cached, lb.to_tokens) - lb.from_tokens)
        l3 = round(from_storage * lb.l3_fraction / self.page_size) * self.page_size
        req.cached_tokens = cached
        req.l1_tokens = cached - from_storage
        req.l2_tokens, req.l3_tokens = from_storage - l3, l3

    def _snapshot_points(self, req: Request, start: int, branching: int | None) -> list[int]:
        """Prompt positions after which the state is kept in the radix cache."""
        if self.config.disable_radix_cache:
            return []
        ps, n, step = self.page_size, len(req.prompt), self.config.track_interval
        points = set(range((start // step + 1) * step, n + 1, step))
        points |= {n // ps * ps, (n - 1) // ps * ps}  # prompt end; what a re-send can match
        if branching:
            points.add(branching)
        return sorted(p for p in points if p > start)

    # ------------------------------------------------------------ forward

    def _ensure_pages(self, req: Request, tokens: int) -> None:
        need = math.ceil(tokens / self.page_size) - len(req.pages)
        if need > 0:
            req.pages += self._alloc_pages(need)

    def _prefill(self, req: Request) -> None:
        ps, start, n = self.page_size, req.computed, len(req.prompt)
        end = min(n, (start // ps + self.config.prefill_chunk_pages) * ps)
        while req.keep and req.keep[0] <= start:
            req.keep.pop(0)
        if req.keep:
            end = min(end, req.keep[0])
        self._ensure_pages(req, end)
        logits = self.lm.forward(req.prompt[start:end], req.cache)
        self.io.store(req.cache, start, end, req.pages)
        req.computed = end
        if req.keep and req.keep[0] == end:
            self._cache_unfinished(req, end)
        if end == n:
            req.logits.append(logits[-1])
            req.output_ids.append(int(logits[-1].argmax()))
            req.first_token_s = time.perf_counter()
            req.status = Status.DECODE
            self.hicache.flush_pending()  # write-through after the first token

    def _decode(self, req: Request) -> None:
        pos = req.computed
        self._ensure_pages(req, pos + 1)
        logits = self.lm.forward(req.output_ids[-1:], req.cache)[-1]
        self.io.store(req.cache, pos, pos + 1, req.pages)
        req.computed = pos + 1
        if req.computed % self.config.track_interval == 0:
            self._cache_unfinished(req, req.computed)
        req.logits.append(logits)
        req.output_ids.append(int(logits.argmax()))

    # ------------------------------------------------------------ radix cache

    def _cache_unfinished(self, req: Request, length: int) -> None:
        """Insert ``req.seq[:length]`` (whole pages; the running state is the state after it)
        and make the request hold the tree's pages and a lock on the new node."""
        if self.config.disable_radix_cache or length <= req.protected_len:
            return  # never shrink what the request already shares
        ps, tokens = self.page_size, req.seq[:length]
        keys = req.keys.extend(tokens)[: length // ps]
        state = None
        if self.states is not None:
            try:
                state = self._alloc_state()
            except OutOfMemory:
                return  # every slot is locked: skip this snapshot, the request goes on
            self.states.copy(req.slot, state)
        res = self.tree.insert(tokens, req.pages[: length // ps], keys, state,
                               prev_prefix_len=req.protected_len)
        if res.state_exists:
            self._free_state(state)
        m = self.tree.match_prefix(tokens, count_hit=False)
        assert len(m.pages) == length // ps and m.node is res.node, (len(m.pages), length)
        req.pages[: length // ps] = m.pages  # the tree's copies of pages it already had
        lock = self.tree.inc_lock(m.node)
        self.tree.dec_lock(req.lock)
        req.lock, req.protected_len = lock, length
        self.hicache.on_insert(m.node)

    def _release(self, req: Request, status: Status) -> None:
        """Give back everything ``req`` owns (module docstring of ``request.py``)."""
        if status is Status.FINISHED:
            # the state at a page-aligned end is at hand; a KV-only model caches every page
            end = req.computed // self.page_size * self.page_size
            if end == req.computed or not self.tree.hybrid:
                self._cache_unfinished(req, end)
        self.hicache.flush_pending()  # while this request's nodes are still locked
        own = req.pages[req.protected_len // self.page_size :]
        self.kv.allocator.free(own)
        req.pages = req.pages[: req.protected_len // self.page_size]
        if req.slot is not None:
            self._free_state(req.slot)
            req.slot = None
        if req.lock is not None:
            self.tree.dec_lock(req.lock)
            req.lock = None
        req.cache = None
        req.status = status
        self.requests.pop(req.rid, None)

    # ------------------------------------------------------------ admin

    def flush_cache(self) -> None:
        """Drop every unlocked node of the device cache (write_back stores them first)."""
        self.tree.evict(self.kv.allocator.total)
        if self.states is not None:
            self.tree.evict_states(self.states.allocator.total)

    def check_idle(self) -> None:
        """Raise LeakDetected unless, with nothing running, available + evictable + protected
        == total for the KV pool and the state pool (and the tree's invariants hold)."""
        if self.waiting or self.running:
            raise RuntimeError(f"not idle: {len(self.waiting)} waiting, "
                               f"{len(self.running)} running")
        self.tree.sanity_check()
        debug = self.config.debug_pools
        check_identity(self.kv.allocator, self.tree.kv_evictable, self.tree.kv_protected,
                       accounted=self.tree.tree_pages() if debug else None)
        if self.states is not None:
            check_identity(self.states.allocator, self.tree.state_evictable,
                           self.tree.state_protected,
                           accounted=self.tree.tree_states() if debug else None)

    def check_busy(self) -> None:
        """The identity while requests run: their own pages and slots are the fourth term."""
        ps = self.page_size
        own = [p for r in self.running for p in r.pages[r.protected_len // ps :]]
        check_identity(self.kv.allocator, self.tree.kv_evictable, self.tree.kv_protected,
                       len(own))
        if self.states is not None:
            slots = sum(r.slot is not None for r in self.running)
            check_identity(self.states.allocator, self.tree.state_evictable,
                           self.tree.state_protected, slots)

    def close(self) -> None:
        self.storage.close()
