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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hicached.engine.models import CacheGeometry
from hicached.engine.pools import IndexerPool, KVPool, StatePool


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
              has_state: bool):
        """A fresh cache holding tokens ``[0, num_tokens)`` of ``pages``; its recurrent layers
        run on state slot ``slot`` (``has_state``: the slot holds the state after
        ``num_tokens`` tokens; False: a fresh sequence, the model starts from zeros)."""
        from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

        cache = self.new_cache()
        if num_tokens:
            for li, layer_id in enumerate(self.geometry.attn_layers):
                layer = cache.layers[layer_id]
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
