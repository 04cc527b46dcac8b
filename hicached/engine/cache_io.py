"""Between a request's ``transformers`` cache and the device pools.

The HF attention kernels want each layer's KV as one contiguous tensor, so a running request keeps
a ``DynamicCache`` (its working copy); the pools are the storage of record that the radix cache
shares between requests and that hicached copies to and from.

    build(pages, T, slot)       pools -> cache: KV / indexer tokens [0, T) gathered from pages;
                                every recurrent layer's conv / recurrent state *is* a view of
                                ``slot`` of the state pool, so the model updates it in place
    store(cache, s, e, pages)   cache -> pools: tokens [s, e) of every attention layer (and the
                                indexer), token t into page ``pages[t // P]`` at ``t % P``

The restore follows transformers' own lazy initialisation (``engine-plugins.md`` §3), so the cache
is indistinguishable from one that computed the prefix itself: continuation is bit-exact.

With a ``capacity`` (the request's prompt and answer), each plain attention layer's KV lives in
a buffer of that many tokens (``ReservedLayer``): a chunk is written after the tokens before it,
where transformers' ``DynamicLayer`` copies the whole cache into a new tensor per chunk (a long
context's prefill and decode then cost a copy of the context per forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hicached.engine.models import CacheGeometry
from hicached.engine.pools import IndexerPool, KVPool, StatePool, token_major


def _reserved_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values are views of the first ``length`` tokens of
        buffers [1, heads, capacity, dim]: ``update`` copies the chunk in place (the buffers
        double when a chunk would not fit)."""

        def reserve(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
            """Take ``k`` / ``v`` [1, heads, capacity, dim] (any strides) as the buffers,
            ``length`` tokens of them filled."""
            self.dtype, self.device = k.dtype, k.device
            self.kbuf, self.vbuf, self.length = k, v, length
            self.keys, self.values = k[:, :, :length], v[:, :, :length]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.reserve(_token_major(key_states, key_states.shape[-2]),
                             _token_major(value_states, value_states.shape[-2]), 0)
            start, end = self.length, self.length + key_states.shape[-2]
            if end > self.kbuf.shape[-2]:
                self._grow(end)
            self.kbuf[:, :, start:end].copy_(key_states)
            self.vbuf[:, :, start:end].copy_(value_states)
            self.length = end
            self.keys, self.values = self.kbuf[:, :, :end], self.vbuf[:, :, :end]
            return self.keys, self.values

        def _grow(self, need: int) -> None:
            cap = max(need, 2 * self.kbuf.shape[-2])
            for name in ("kbuf", "vbuf"):
                old = getattr(self, name)
                new = _token_major(old, cap)
                new[:, :, : self.length].copy_(old[:, :, : self.length])
                setattr(self, name, new)

        def reset(self) -> None:
            self.length = 0
            self.kbuf = self.vbuf = None
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("the engine never crops a request's cache")

    return ReservedLayer


_RESERVED = None


def _token_major(like: torch.Tensor, tokens: int) -> torch.Tensor:
    return token_major(like, like.shape[1], like.shape[3], tokens)


def reserved_layer():
    """The ``ReservedLayer`` class (made once, on first use: transformers imports lazily)."""
    global _RESERVED
    if _RESERVED is None:
        _RESERVED = _reserved_layer_class()
    return _RESERVED


class CacheIO:
    """Moves tokens and states of one model's cache between HF layers and the pools."""

    def __init__(self, geometry: CacheGeometry, new_cache: Callable[[], object], kv: KVPool,
                 indexer: IndexerPool | None, states: StatePool | None):
        if geometry.hybrid and states is None:
            raise ValueError("a hybrid model needs a state pool")
        if geometry.has_indexer and indexer is None:
            raise ValueError("a DSA model needs an indexer pool")
        self.geometry, self.new_cache = geometry, new_cache
        self.kv, self.indexer, self.states = kv, indexer, states
        self.page_size = kv.page_size

    def store(self, cache, start: int, end: int, pages: Sequence[int]) -> None:
        """Write tokens ``[start, end)`` of every attention layer into their pages."""
        if end <= start:
            return
        device = self.kv.device
        t = torch.arange(start, end, device=device)
        page_of = torch.as_tensor(list(pages), dtype=torch.long, device=device)[t // self.page_size]
        offsets = t % self.page_size
        for li, layer_id in enumerate(self.geometry.attn_layers):
            layer = cache.layers[layer_id]
            k = layer.keys[0, :, start:end].transpose(0, 1)  # [n, heads, k_dim]
            v = layer.values[0, :, start:end].transpose(0, 1)
            self.kv.write(li, page_of, offsets, k, v)
            if self.indexer is not None:
                self.indexer.write(li, page_of, offsets, layer.indexer_keys[0, start:end])

    def build(self, pages: Sequence[int], num_tokens: int, slot: int | None,
              has_state: bool, capacity: int = 0):
        """A fresh cache holding tokens ``[0, num_tokens)`` of ``pages``; its recurrent layers
        run on state slot ``slot`` (``has_state``: the slot holds the state after
        ``num_tokens`` tokens; False: a fresh sequence, the model starts from zeros).
        ``capacity``: tokens the request will hold at most; with it, plain attention layers
        keep their KV in buffers of that size (``ReservedLayer``) instead of growing by
        concatenation."""
        from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

        cache = self.new_cache()
        for li, layer_id in enumerate(self.geometry.attn_layers):
            layer = cache.layers[layer_id]
            if capacity and type(layer) is DynamicLayer and self.indexer is None:  # (not DSA's)
                cache.layers[layer_id] = layer = reserved_layer()()
                layer.reserve(*self.kv.read(li, pages, num_tokens,
                                            capacity=max(capacity, num_tokens, 1)), num_tokens)
            elif num_tokens:
                k, v = self.kv.read(li, pages, num_tokens)
                DynamicLayer.lazy_initialization(layer, k, v)
                layer.keys, layer.values = k, v
                if self.indexer is not None:
                    ik = self.indexer.read(li, pages, num_tokens)
                    layer.lazy_initialization_indexer(ik)
                    layer.indexer_keys = ik
        if self.geometry.hybrid:
            if slot is None:
                raise ValueError("a hybrid model's cache needs a state slot")
            for si, layer_id in enumerate(self.geometry.linear_layers):
                layer = cache.layers[layer_id]
                conv, rec = self.states.views(slot, si)
                LinearAttentionLayer.lazy_initialization(
                    layer, conv_states=conv, recurrent_states=rec,
                    conv_kernel_size=self.geometry.conv_kernel)
                layer.conv_states[0], layer.recurrent_states[0] = conv, rec
                layer.has_previous_state[0] = has_state
        return cache
