"""Issue 48's pressure pattern against a real daemon per policy: what usable prefix of each
older chain is kept.

A 64 MiB arena of 4 MiB slabs, L3 off. Four chains, unrelated (each from the root), each stored
by one ``batch_set_v2``: 160 KV pages of 256 KiB and a Mamba state (548,864 B) at every 16th
page (pages 15, 31, ..., 159), set one after the other (each commit read before the next set).
After the fourth, each chain's pages are read from the daemon's shared presence table (from
outside: no exists, nothing touched). A chain's usable prefix is the longest L with KV pages
0..L-1 all present and the state at page L-1 present: what a hybrid hit can restore.

The room, with the daemon's set-ahead slots pinned at an eighth of L2 (``--set-ahead-bytes
8MiB``: 2 slabs, the most a daemon may hold idle) and evict-ahead off (``--evict-ahead 0``):
the fourth chain takes 12 of the 16 slabs (10 of KV, 2 of states with 4 state slots free);
the set-ahead reserve 2; two KV slabs are left, enough for the third chain's first 32 pages,
with its states at pages 15 and 31 in the free state slots:

    slabs   0 ........ 9 | 10  11 | 12  13 | 14  15
            chain 4's KV | states | ahead  | free: chain 3's pages 0..31 (+ 2 states above)

    python tools/pressure_prefix.py [--policies lru,prefix,hybrid] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling modules)

L2_BYTES, SLAB_BYTES = 64 << 20, 4 << 20
CHAINS, CHAIN_PAGES, STATE_EVERY = 4, 160, 16
KV_PAGE_BYTES, STATE_BYTES = 256 << 10, 548_864
# a KV page: 64 tokens x 8 layers x 2 KV heads x head_dim 64 x K,V x bf16 = 256 KiB
PAGE_TOKENS, KV_LAYERS, KV_HEADS, KV_HEAD_DIM = 64, 8, 2, 64
# a state: 4 layers x (SSM [32, 32, 32] fp32 + conv [4, 768] bf16) = 548,864 B
MAMBA_LAYERS, SSM_SHAPE, CONV_SHAPE = 4, (32, 32, 32), (4, 768)
PINNED = ["--set-ahead-bytes", str(L2_BYTES // 8), "--evict-ahead", "0"]
NS = "pressure-prefix|hybrid-256k|bf16|tp0of1"


class ChainKept(NamedTuple):
    """What the daemon kept of one chain: KV pages present, the pages whose states are
    present, the usable prefix (pages), and the KV pages past the first missing one (orphans)."""

    chain: int
    kv_pages: int
    state_pages: tuple[int, ...]
    usable_pages: int
    orphan_kv_pages: int


def chain_keys(chain: int) -> list[str]:
    """Chain ``chain``'s page keys (64 hex each, distinct across chains)."""
    from hicached.keys import page_keys

    return page_keys([chain] * (CHAIN_PAGES * 4), 4)


def kept(chain: int, kv: np.ndarray, st: np.ndarray) -> ChainKept:
    """``ChainKept`` of a chain from its pages' presence (``kv``, ``st``: bool per page)."""
    whole = np.logical_and.accumulate(kv)
    usable = np.flatnonzero(whole & st)
    return ChainKept(chain, int(kv.sum()), tuple(int(p) for p in np.flatnonzero(st)),
                     int(usable[-1]) + 1 if len(usable) else 0, int((kv & ~whole).sum()))


def measure(endpoint: str) -> list[ChainKept]:
    """Store the four chains into the daemon at ``endpoint`` (empty, configured as the module
    docstring says); what it kept of each, from its presence table."""
    import torch

    from bench_hybrid_cache import presence_masks

    from hicached import Client, HostPool, PoolHitPolicy, PoolName, PoolTransfer

    kv_pool = HostPool.allocate_mha(CHAIN_PAGES, PAGE_TOKENS, KV_LAYERS, KV_HEADS, KV_HEAD_DIM)
    assert kv_pool.page_bytes == KV_PAGE_BYTES, kv_pool.page_bytes
    states = CHAIN_PAGES // STATE_EVERY
    mamba = HostPool.allocate_mamba(states, MAMBA_LAYERS, SSM_SHAPE, [CONV_SHAPE])
    assert mamba.page_bytes == STATE_BYTES, mamba.page_bytes
    at = list(range(STATE_EVERY - 1, CHAIN_PAGES, STATE_EVERY))  # 15, 31, ..., 159
    keys = [chain_keys(c) for c in range(CHAINS)]
    with Client(endpoint, NS, timeout_s=60.0) as c:
        c.register_mem_host_pool_v2(kv_pool, PoolName.KV)
        c.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        for ks in keys:
            c.batch_set_v2([
                PoolTransfer(PoolName.KV, torch.arange(CHAIN_PAGES * PAGE_TOKENS), keys=ks,
                             hit_policy=PoolHitPolicy.ALL_PAGES),
                PoolTransfer(PoolName.MAMBA, torch.arange(states), keys=[ks[p] for p in at],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                parent=None, depth=0, anchor_pool=PoolName.KV)
            c.wait_committed()
        got = presence_masks(c, [k for ks in keys for k in ks])  # as bench_hybrid_cache reads
        if got is None:
            raise RuntimeError(f"the daemon at {endpoint} publishes no usable presence table, "
                               "or it changed under every read")
        masks, kv_bit, st_bit = got
    masks = masks.reshape(CHAINS, CHAIN_PAGES)
    return [kept(i + 1, (m & kv_bit) != 0, (m & st_bit) != 0) for i, m in enumerate(masks)]


def run(policy: str, extra: tuple[str, ...] = ()) -> list[ChainKept]:
    """``measure`` against a fresh daemon running ``policy`` (``NAME`` or ``NAME:ALPHA``)."""
    from bench_hybrid_cache import policy_args, start_daemon, stop

    with tempfile.TemporaryDirectory(prefix="pressure-prefix-") as tmp:
        proc, endpoint = start_daemon(tmp, L2_BYTES, SLAB_BYTES,
                                      policy_args(policy) + PINNED + list(extra))
        try:
            return measure(endpoint)
        finally:
            stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="lru,prefix,hybrid",
                    help="comma-separated: lru, prefix, hybrid, hybrid:ALPHA")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if not policies:
        ap.error(f"--policies: {args.policies!r} names none")
    out = {p: run(p) for p in policies}
    if args.json:
        print(json.dumps({p: [k._asdict() for k in ks] for p, ks in out.items()}, indent=1))
        return 0
    print(f"pressure_prefix: {L2_BYTES >> 20} MiB arena, {SLAB_BYTES >> 20} MiB slabs, "
          f"{CHAINS} chains of {CHAIN_PAGES} KV pages of {KV_PAGE_BYTES >> 10} KiB + a "
          f"{STATE_BYTES:,} B state every {STATE_EVERY}th page; {' '.join(PINNED)}")
    print("policy     chain  KV pages  states (at pages)         usable prefix  orphan KV")
    for policy, ks in out.items():
        for k in ks:
            at = k.state_pages
            pages = ", ".join(map(str, at)) if len(at) <= 3 else f"{at[0]}, {at[1]}, ..., {at[-1]}"
            print(f"{policy:<10s} {k.chain:5d}  {k.kv_pages:8d}  {len(at):2d} ({pages})"
                  f"{'':<{max(0, 21 - len(pages))}s}  {k.usable_pages:13d}  "
                  f"{k.orphan_kv_pages:9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
