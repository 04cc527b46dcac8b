"""The seeded trace of hybrid-model requests that ``bench_hybrid_cache.py`` replays (issue 25):
the mixes, their requests with page keys chained as SGLang's page hashes, the states each
request stores, and the ceiling (the trace with no eviction, worked out offline). Its docstring
describes the mixes; this module only builds them."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

PAGE_TOKENS = 64
KV_LAYERS, KV_HEADS, KV_HEAD_DIM = 4, 2, 8  # bf16, K and V: 256 B a token
KV_PAGE_BYTES = 2 * PAGE_TOKENS * KV_LAYERS * KV_HEADS * KV_HEAD_DIM * 2  # 16 KiB
VOCAB = 151_936  # Qwen3's


@dataclass(frozen=True)
class Mix:
    """One trace's mix: kinds' shares, item counts, token lengths (lo, hi: log-uniform)."""

    about: str
    shares: tuple[tuple[str, float], ...]
    zipf_s: float
    requests: int
    seed: int
    system_prompts: int
    system_tokens: tuple[int, int]
    conversations: int
    turns: tuple[int, int]
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    fewshots: int
    fewshot_tokens: tuple[int, int]
    question_tokens: tuple[int, int]
    answer_tokens: tuple[int, int]
    documents: int
    document_tokens: tuple[int, int]
    queries: tuple[int, int]
    instruction_tokens: int = 400


MIXES = {
    "mix1": Mix("chat-heavy", (("chat", 0.55), ("fewshot", 0.20), ("document", 0.25)), 0.9,
                1600, 1, system_prompts=4, system_tokens=(1000, 3000), conversations=300,
                turns=(3, 20), user_tokens=(50, 1500), reply_tokens=(100, 1200), fewshots=6,
                fewshot_tokens=(1500, 5000), question_tokens=(40, 300), answer_tokens=(10, 120),
                documents=64, document_tokens=(4000, 16000), queries=(2, 8)),
    "mix2": Mix("documents and few-shot", (("chat", 0.25), ("fewshot", 0.35), ("document", 0.40)),
                1.0, 1000, 2, system_prompts=3, system_tokens=(800, 3000), conversations=100,
                turns=(3, 16), user_tokens=(50, 1500), reply_tokens=(100, 1200), fewshots=10,
                fewshot_tokens=(1000, 6000), question_tokens=(30, 200), answer_tokens=(5, 80),
                documents=48, document_tokens=(5000, 20000), queries=(2, 6)),
}


class Request(NamedTuple):
    """One request of the trace. ``keys``: the finished sequence's full pages (prompt + reply);
    ``ids``: their indices in ``Trace.keys``; ``prompt_pages``: the pages an exists asks,
    (prompt_tokens - 1) // 64; ``branches``: page counts b at shared segments' ends (the state
    is the one of page b - 1)."""

    kind: str
    keys: list[str]
    ids: list[int]
    prompt_tokens: int
    prompt_pages: int
    branches: tuple[int, ...]


@dataclass
class Trace:
    """The requests, and every distinct key in first-seen order (a parent before its child)
    with its parent's index (-1: a root) and depth. The geometry: a page's tokens and bytes,
    and whether requests store states (False: attention-only, a hit needs KV pages alone).
    ``times_ms``: each request's arrival in the trace's own clock (None: the mixes have none).
    A mix's trace keeps the defaults; ``mooncake_trace.load`` fills them for a trace file."""

    name: str
    seed: int
    requests: list[Request]
    keys: list[str]
    parent: np.ndarray
    depth: np.ndarray
    page_tokens: int = PAGE_TOKENS
    kv_page_bytes: int = KV_PAGE_BYTES
    with_states: bool = True
    times_ms: np.ndarray | None = None
    about: str = ""


class _Gen:
    """Builds one trace; all randomness from one seeded generator."""

    def __init__(self, mix: Mix, seed: int):
        self.mix, self.rng = mix, np.random.default_rng(seed)
        self.index: dict[str, int] = {}
        self.parent: list[int] = []
        self.depth: list[int] = []

    def length(self, lo_hi: tuple[int, int]) -> int:
        lo, hi = lo_hi
        return round(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n, dtype=np.uint32)

    def zipf(self, n: int) -> int:
        w = 1.0 / np.arange(1, n + 1) ** self.mix.zipf_s
        return int(self.rng.choice(n, p=w / w.sum()))

    def keys(self, tokens: np.ndarray) -> tuple[list[str], list[int]]:
        """Chained page keys of ``tokens``' full pages (SGLang's: sha256 over the parent's
        digest and the page's token ids), and their distinct-key indices."""
        keys, ids, prev, parent = [], [], b"", -1
        data = tokens.astype("<u4").tobytes()
        step = 4 * PAGE_TOKENS
        for p in range(len(tokens) // PAGE_TOKENS):
            h = hashlib.sha256(prev + data[p * step:(p + 1) * step])
            prev, key = h.digest(), h.hexdigest()
            i = self.index.get(key)
            if i is None:
                i = self.index[key] = len(self.parent)
                self.parent.append(parent)
                self.depth.append(p)
            keys.append(key)
            ids.append(i)
            parent = i
        return keys, ids

    def request(self, kind: str, shared: list[np.ndarray], fresh: np.ndarray,
                reply: np.ndarray) -> Request:
        """A request whose prompt is ``shared`` segments (branching points at each one's end)
        then ``fresh`` tokens, with the reply ``reply``."""
        ends = np.cumsum([len(s) for s in shared])
        prompt = np.concatenate([*shared, fresh])
        keys, ids = self.keys(np.concatenate([prompt, reply]))
        branches = tuple(sorted({int(e) // PAGE_TOKENS for e in ends} - {0}))
        return Request(kind, keys, ids, len(prompt), (len(prompt) - 1) // PAGE_TOKENS, branches)


def make_trace(name: str, seed: int | None = None, requests: int | None = None) -> Trace:
    """The seeded trace of mix ``name`` (``seed`` / ``requests``: the mix's own when None)."""
    mix = MIXES[name]
    seed = mix.seed if seed is None else seed
    g = _Gen(mix, seed)
    systems = [g.tokens(g.length(mix.system_tokens)) for _ in range(mix.system_prompts)]
    fewshots = [g.tokens(g.length(mix.fewshot_tokens)) for _ in range(mix.fewshots)]
    instruction = g.tokens(mix.instruction_tokens)
    convs: list[dict | None] = [None] * mix.conversations
    docs: list[dict | None] = [None] * mix.documents
    kinds, shares = zip(*mix.shares, strict=True)
    out = []
    for _ in range(mix.requests if requests is None else requests):
        kind = kinds[int(g.rng.choice(len(kinds), p=np.array(shares) / sum(shares)))]
        if kind == "chat":
            slot = g.zipf(mix.conversations)
            c = convs[slot]
            if c is None or c["left"] == 0:
                c = convs[slot] = {"system": systems[g.zipf(mix.system_prompts)],
                                   "history": np.zeros(0, np.uint32),
                                   "left": int(g.rng.integers(mix.turns[0], mix.turns[1] + 1))}
            user = g.tokens(g.length(mix.user_tokens))
            reply = g.tokens(g.length(mix.reply_tokens))
            req = g.request(kind, [c["system"]], np.concatenate([c["history"], user]), reply)
            c["history"] = np.concatenate([c["history"], user, reply])  # the next turn's prefix
            c["left"] -= 1
        elif kind == "fewshot":
            req = g.request(kind, [fewshots[g.zipf(mix.fewshots)]],
                            g.tokens(g.length(mix.question_tokens)),
                            g.tokens(g.length(mix.answer_tokens)))
        else:
            slot = g.zipf(mix.documents)
            d = docs[slot]
            if d is None or d["left"] == 0:
                d = docs[slot] = {"tokens": g.tokens(g.length(mix.document_tokens)),
                                  "left": int(g.rng.integers(mix.queries[0], mix.queries[1] + 1))}
            req = g.request(kind, [instruction, d["tokens"]],
                            g.tokens(g.length(mix.question_tokens)),
                            g.tokens(g.length(mix.answer_tokens)))
            d["left"] -= 1
        out.append(req)
    return Trace(name, seed, out, list(g.index), np.array(g.parent, np.int64),
                 np.array(g.depth, np.int64))


def states_to_set(req: Request, hit: int) -> list[int]:
    """Pages b whose state (that of page b - 1) a request with ``hit`` pages restored stores:
    every branching point it computed past, and its last full page."""
    n = len(req.keys)
    return sorted({b for b in req.branches if hit < b <= n} | ({n} if hit < n else set()))


def stored_states(trace: Trace, req: Request, hit: int) -> list[int]:
    """``states_to_set`` in the trace's geometry: none when it stores no states."""
    return states_to_set(req, hit) if trace.with_states else []


def replay_unbounded(trace: Trace) -> tuple[list[int], set[int], set[int]]:
    """The trace with no eviction: per request the pages of its hit (what it reads of the pages
    and states stored before it), and the KV pages and states stored in the end (page ids)."""
    kv: set[int] = set()
    states: set[int] = set()
    hits = []
    for req in trace.requests:
        kv_pages = 0
        while kv_pages < req.prompt_pages and req.ids[kv_pages] in kv:
            kv_pages += 1
        hit = kv_pages
        while trace.with_states and hit and req.ids[hit - 1] not in states:
            hit -= 1
        hits.append(hit)
        kv.update(req.ids[hit:])
        states.update(req.ids[b - 1] for b in stored_states(trace, req, hit))
    return hits, kv, states


def ceiling(trace: Trace, warmup: int) -> dict:
    """The trace with no eviction, worked out here: hit tokens of the counted requests, and
    the working set (every KV page and state stored, at the end)."""
    hits, kv, states = replay_unbounded(trace)
    counted = trace.requests[warmup:]
    hit_tokens = sum(hits[warmup:]) * trace.page_tokens
    prompt_tokens = sum(req.prompt_tokens for req in counted)
    return {"hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
            "hit_rate": hit_tokens / max(1, prompt_tokens), "kv_pages": len(kv),
            "states": len(states)}


def add_trace_args(ap, budgets: str) -> None:
    """The options of the tools that replay a trace outside a daemon (``hybrid_oracle``,
    ``hybrid_index_replay``): the trace, its size, the state's size, the warm-up, budgets."""
    ap.add_argument("--trace", choices=sorted(MIXES), default="mix1")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--budgets", default=budgets, help="%% of the working set")
    ap.add_argument("--state-pages", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--json", action="store_true")


def parse_budgets(ap, text: str) -> list[float]:
    """``--budgets``' percentages, each in (0, 100]; ``ap.error`` (exit 2) otherwise."""
    try:
        budgets = [float(b) for b in text.split(",") if b]
    except ValueError:
        ap.error(f"--budgets: {text!r} is not a comma-separated list of numbers")
    if not budgets or any(not 0 < b <= 100 for b in budgets):
        ap.error(f"--budgets: {text!r}: each must be in (0, 100]")
    return budgets


def summary(trace: Trace, warmup: int, state_bytes: int) -> dict:
    """What the trace is: requests per kind, tokens, distinct pages, working set, ceiling."""
    c = ceiling(trace, warmup)
    kinds: dict[str, int] = {}
    for req in trace.requests:
        kinds[req.kind] = kinds.get(req.kind, 0) + 1
    mix = MIXES.get(trace.name)
    return {"trace": trace.name, "seed": trace.seed, "about": mix.about if mix else trace.about,
            "zipf_s": mix.zipf_s if mix else None, "requests": len(trace.requests),
            "warmup_requests": warmup, "kinds": kinds,
            "prompt_tokens": sum(r.prompt_tokens for r in trace.requests),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in trace.requests)
            / max(1, len(trace.requests)),
            "unique_pages": len(trace.keys), "kv_page_bytes": trace.kv_page_bytes,
            "page_tokens": trace.page_tokens, "geometry": "hybrid" if trace.with_states
            else "attention-only", "state_bytes": state_bytes if trace.with_states else 0,
            "stored_kv_pages": c["kv_pages"], "stored_states": c["states"],
            "working_set_bytes": c["kv_pages"] * trace.kv_page_bytes
            + c["states"] * state_bytes,
            "ceiling_hit_rate": c["hit_rate"]}
