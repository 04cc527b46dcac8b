"""The engine's one frozen config, and its command-line flags (shared by the demo and bench).

    --hicache-storage-backend hicached|none   L2/L3 through a hicached daemon, or no storage
    --hicached-endpoint ipc:///path.sock      the daemon (required with ``hicached``)
    --hicache-write-policy write_through | write_through_selective | write_back
    --hicache-storage-prefetch-policy wait_complete   (SGLang's name for the stop policy)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from hicached.settings import WRITE_POLICIES

STORAGE_BACKENDS = ("hicached", "none")
PREFETCH_POLICIES = ("wait_complete", "timeout", "best_effort")  # hicached.client.prefetch


@dataclass(frozen=True)
class EngineConfig:
    """Sizes are in pages / slots; lengths in tokens.

    ``track_interval``: tokens between kept state snapshots during prefill and decode (a multiple
    of ``page_size``); snapshots are also kept at the prompt end and at branching points.
    ``prefill_chunk_pages``: pages per prefill forward (1 = page-chunked prefill, whose cached
    continuations are bit-exact; more is faster and exact to fp rounding).
    ``debug_pools``: allocators catch double frees, leak reports name the ids.
    """

    page_size: int = 16
    kv_pages: int = 512
    state_slots: int = 64
    track_interval: int = 64
    prefill_chunk_pages: int = 1
    device: str = "cpu"
    debug_pools: bool = False
    disable_radix_cache: bool = False
    storage_backend: str = "none"
    hicached_endpoint: str = ""
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    prefetch_policy: str = "wait_complete"
    tenant: str = ""
    storage_timeout_s: float = 5.0
    storage_retry_s: float = 1.0  # after a daemon failure, storage calls miss this long

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        need(self.kv_pages >= 2, f"kv_pages must be >= 2, got {self.kv_pages}")
        need(self.state_slots >= 3, f"state_slots must be >= 3 (running + locked + snapshot), "
             f"got {self.state_slots}")
        need(self.track_interval >= self.page_size and self.track_interval % self.page_size == 0,
             f"track_interval {self.track_interval} must be a positive multiple of page_size "
             f"{self.page_size}")
        need(self.prefill_chunk_pages >= 1,
             f"prefill_chunk_pages must be >= 1, got {self.prefill_chunk_pages}")
        need(self.storage_backend in STORAGE_BACKENDS,
             f"unknown storage backend {self.storage_backend!r}; valid: {list(STORAGE_BACKENDS)}")
        need(self.storage_backend != "hicached" or bool(self.hicached_endpoint),
             "--hicache-storage-backend hicached needs --hicached-endpoint")
        need(self.write_policy in WRITE_POLICIES,
             f"unknown write policy {self.write_policy!r}; valid: {list(WRITE_POLICIES)}")
        need(self.write_through_threshold >= 1,
             f"write_through_threshold must be >= 1, got {self.write_through_threshold}")
        need(self.prefetch_policy in PREFETCH_POLICIES,
             f"unknown prefetch policy {self.prefetch_policy!r}; valid: {list(PREFETCH_POLICIES)}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine's flags (defaults from ``EngineConfig``)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--kv-pages", type=int, default=d.kv_pages, help="device KV pool pages")
    g.add_argument("--state-slots", type=int, default=d.state_slots,
                   help="device state pool slots")
    g.add_argument("--track-interval", type=int, default=d.track_interval,
                   help="tokens between kept state snapshots")
    g.add_argument("--prefill-chunk-pages", type=int, default=d.prefill_chunk_pages)
    g.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    g.add_argument("--debug-pools", action="store_true")
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--hicache-storage-backend", dest="storage_backend",
                   choices=STORAGE_BACKENDS, default=d.storage_backend)
    g.add_argument("--hicached-endpoint", default=d.hicached_endpoint)
    g.add_argument("--hicache-write-policy", dest="write_policy", choices=WRITE_POLICIES,
                   default=d.write_policy)
    g.add_argument("--hicache-write-through-threshold", dest="write_through_threshold",
                   type=int, default=d.write_through_threshold)
    g.add_argument("--hicache-storage-prefetch-policy", dest="prefetch_policy",
                   choices=PREFETCH_POLICIES, default=d.prefetch_policy)
    g.add_argument("--tenant", default=d.tenant, help="namespace salt")


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """An ``EngineConfig`` from parsed flags (attributes it does not know are ignored)."""
    kw = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    kw.update(overrides)
    return EngineConfig(**kw)
