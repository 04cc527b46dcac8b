"""Real request traces in Mooncake's format (issue 48), as ``hybrid_trace.Trace`` objects that
``bench_hybrid_cache.py --trace-file`` and ``hybrid_oracle.py --trace-file`` replay.

The format (``kvcache-ai/Mooncake``, ``FAST25-release/traces/``; copies in
``../shared/data/traces/``): one JSON object a line, ``timestamp`` (ms since the trace's start),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the
prompt, chained: two prompts sharing a prefix share its leading ids). An engine stores only full
pages, so a request's pages are its first ``input_length // 512`` ids; the last id of a prompt
whose length is not a multiple of 512 covers a partial block and is neither asked for nor stored.
There are no reply pages (the trace has no ids for the output).

One block is one page. Per request (``hybrid_trace.Request``):

    keys / ids       its full blocks' page keys (sha256 of the block id, 64 hex, as SGLang's
                     page hashes look) and their indices in first-seen order
    prompt_tokens    512 x its full blocks: the token hit rate is over full prompt blocks
    prompt_pages     its full blocks: an exists asks them all (the table's definition)
    branches         the hybrid geometry's states besides the last full page's, as a store can
                     know them online: page k when the request's first page not seen before is
                     page k and key k - 1 already had a child (the request gives it a second one),
                     so the state at page k - 1 is worth keeping. ``states_to_set`` stores it only
                     when the request computed page k - 1 (its hit ended before k)

    geometry   attention-only   KV pages only; a hit is the longest run of present KV pages
               hybrid           KV pages plus those states; a hit also needs the state at its end

The bench's page is small (``KV_PAGE_BYTES``, 1 KiB: the daemon's cost is per page, not per byte,
and the budgets are shares of the working set), its state ``STATE_PAGES`` pages of bytes.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from hybrid_trace import Request, Trace

BLOCK_TOKENS = 512
# One 512-token block as a HostPool page: 64 token rows x 1 layer x 2 KV heads x head_dim 2 x K,V
# x bf16 = 1 KiB. The rows are the pool's; the hit counts 512 tokens a page.
POOL_PAGE_ROWS, POOL_LAYERS, POOL_KV_HEADS, POOL_HEAD_DIM = 64, 1, 2, 2
KV_PAGE_BYTES = 2 * POOL_PAGE_ROWS * POOL_LAYERS * POOL_KV_HEADS * POOL_HEAD_DIM * 2
# A state's bytes in 512-token KV pages. Qwen3-Next-80B: a 512-token page of its 12 full-attention
# layers (2 KV heads x 256, bf16, K and V) is 12 MiB; its 36 Gated DeltaNet layers' state (32 heads
# x 128 x 128, fp32) is 72 MiB: 6 pages (3 with a bf16 state or at TP 2).
STATE_PAGES = 6
GEOMETRIES = ("attention", "hybrid")


class TraceFileError(ValueError):
    """A trace file that is not in Mooncake's format: the file, the line and what was wrong."""


def _key(block_id: int) -> str:
    return hashlib.sha256(b"mooncake-block:%d" % block_id).hexdigest()


def read_rows(path: str, requests: int | None = None) -> list[dict]:
    """The first ``requests`` (None: all) rows of ``path``, checked: each a JSON object with a
    numeric ``timestamp``, a non-negative ``input_length`` and ``hash_ids`` of
    ceil(input_length / 512) integers, timestamps in order."""
    if not os.path.isfile(path):
        raise TraceFileError(f"trace file {path!r}: no such file")
    rows, last = [], 0.0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if requests is not None and len(rows) >= requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFileError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise TraceFileError(f"{path}:{n}: a {type(row).__name__}, not a JSON object")
            ts, length, ids = row.get("timestamp"), row.get("input_length"), row.get("hash_ids")
            if not isinstance(ts, (int, float)) or ts < last:
                raise TraceFileError(f"{path}:{n}: timestamp {ts!r} is not a number >= the "
                                     f"previous line's {last}")
            if not isinstance(length, int) or length < 0:
                raise TraceFileError(f"{path}:{n}: input_length {length!r} is not an int >= 0")
            want = -(-length // BLOCK_TOKENS)
            if not isinstance(ids, list) or len(ids) != want or not all(
                    isinstance(x, int) for x in ids):
                got = len(ids) if isinstance(ids, list) else ids
                raise TraceFileError(f"{path}:{n}: hash_ids must be {want} integers (one per "
                                     f"512-token block of {length} tokens), got {got!r}")
            rows.append(row)
            last = ts
    if not rows:
        raise TraceFileError(f"trace file {path!r}: no requests")
    return rows


def load(path: str, geometry: str = "hybrid", requests: int | None = None) -> Trace:
    """The trace of ``path``'s first ``requests`` rows in ``geometry`` (``attention`` or
    ``hybrid``); ``TraceFileError`` on a malformed file or a chain that contradicts itself
    (an id under two parents or at two depths)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry: {geometry!r} is not one of {', '.join(GEOMETRIES)}")
    rows = read_rows(path, requests)
    index: dict[int, int] = {}
    keys: list[str] = []
    parent: list[int] = []
    depth: list[int] = []
    children: list[int] = []
    out = []
    for n, row in enumerate(rows, 1):
        full = row["input_length"] // BLOCK_TOKENS
        ids, prev, first_new = [], -1, None
        for d, block in enumerate(row["hash_ids"][:full]):
            i = index.get(block)
            if i is None:
                i = index[block] = len(keys)
                keys.append(_key(block))
                parent.append(prev)
                depth.append(d)
                children.append(0)
                if prev >= 0:
                    children[prev] += 1
                if first_new is None:
                    first_new = d
            elif parent[i] != prev or depth[i] != d:
                raise TraceFileError(f"{path}: request {n}: block {block} at depth {d} under "
                                     f"{prev}, first seen at depth {depth[i]} under {parent[i]}")
            ids.append(i)
            prev = i
        # a second child for key first_new - 1: a branch point, its state worth a hit later
        branch = (first_new,) if (geometry == "hybrid" and first_new
                                  and children[ids[first_new - 1]] >= 2) else ()
        out.append(Request("trace", [keys[i] for i in ids], ids, full * BLOCK_TOKENS, full,
                           branch))
    name = os.path.splitext(os.path.basename(path))[0]
    return Trace(name, 0, out, keys, np.array(parent, np.int64), np.array(depth, np.int64),
                 page_tokens=BLOCK_TOKENS, kv_page_bytes=KV_PAGE_BYTES,
                 with_states=geometry == "hybrid",
                 times_ms=np.array([r["timestamp"] for r in rows], np.float64),
                 about=f"Mooncake-format trace, {geometry}")
