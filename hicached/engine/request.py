"""A request's record: what the caller sees, and what the engine holds for it while it runs.

Ownership of a running request's KV pages (``pages``, one per ``page_size`` tokens):

    [0, protected_len)            the radix cache's, kept alive by ``lock`` (a tree lock)
    [protected_len, computed)     the request's own, not in the tree yet (no snapshot there)
    last partial page             the request's own, never inserted

and of state slots: ``slot`` is its private running state (a copy of the matched one); the tree's
snapshots are copies it donated. Releasing a request frees exactly its own part.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hicached.keys import KeyChain


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """One generation request (greedy decoding)."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    page_size: int
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # prompt end, then per decode
    error: str = ""
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    # where the cached prefix came from (tokens), filled at admission
    cached_tokens: int = 0
    l1_tokens: int = 0
    l2_tokens: int = 0
    l3_tokens: int = 0
    # engine-private (see the module docstring)
    keys: KeyChain | None = None
    pages: list[int] = field(default_factory=list)
    protected_len: int = 0
    lock: Any = None
    slot: int | None = None
    cache: Any = None
    computed: int = 0
    keep: list[int] = field(default_factory=list)  # prompt positions to snapshot, ascending
    loaded: Any = None  # hicache.LoadBack of the arrival
    transfer: Any = None  # pd.decode.Transfer: what a PD decode request holds (DecodeEngine)

    @property
    def seq(self) -> list[int]:
        """Prompt and generated tokens."""
        return self.prompt + self.output_ids

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def hit_sources(self) -> dict[str, int]:
        """Cached prompt tokens by tier, and the tokens computed."""
        return {"l1": self.l1_tokens, "l2": self.l2_tokens, "l3": self.l3_tokens,
                "computed": len(self.prompt) - self.cached_tokens}
