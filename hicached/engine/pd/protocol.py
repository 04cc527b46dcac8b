"""Every message of the reference engine's PD channels: msgspec Structs, msgpack, one frame each.

Two channels, both ZeroMQ DEALER (connecting) -> ROUTER (bound), ``[payload]`` frames:

Bootstrap (decode -> prefill; the prefill binds ``--disaggregation-bootstrap-endpoint``)

  decode -> prefill   PrefillRequest(rid, prompt, decode_prefix_len, timeout_s)
                      AbortRequest(rid)                 the decode gave up (timeout, abort)
  prefill -> decode   Ready(rid, first_token, logits, stored_pages, state_stored, publish_s)
                      Failed(rid, reason, message)     reason: abort | timeout | error

  ``decode_prefix_len``: prompt tokens the decode already holds (a page multiple). Ready means
  the prompt's pages ``[decode_prefix_len, a)`` and, for a hybrid model, the state after token
  ``a`` are visible in the node's hicached L2, where ``a = len(prompt) // page_size *
  page_size``; the daemon acknowledged the commit before Ready was sent (``docs/pd.md``).

Front (a user -> an engine in mode decode or none; the engine binds ``--serve-endpoint``)

  Generate(rid, prompt, max_new_tokens)  ->  Generated(rid, output_ids, logits, error, ...)
  CheckIdle()                            ->  Checked(ok, message)   the engine's leak identity
  GetUsage()                             ->  Usage(...)             the engine's pools now

Malformed frames raise ``PDProtocolError``; the receiver answers ``Failed`` / ``Generated``
with an error where it can name the request, and drops the frame otherwise.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from hicached.errors import HicachedError


class PDProtocolError(HicachedError):
    """A frame that is not a message of this channel."""


class _Msg(msgspec.Struct, tag_field="t", omit_defaults=True):
    pass


class PrefillRequest(_Msg, tag="prefill"):
    """Compute ``prompt`` and publish its pages past ``decode_prefix_len`` (a page multiple)
    and the end-of-prompt state; answer Ready or Failed within ``timeout_s``."""

    rid: str
    prompt: list[int]
    decode_prefix_len: int = 0
    timeout_s: float = 30.0


class AbortRequest(_Msg, tag="abort"):
    rid: str


class Ready(_Msg, tag="ready"):
    """Pages ``[decode_prefix_len // P, stored_pages + decode_prefix_len // P)`` and the state
    (``state_stored``) are visible in L2; ``logits``: float32 [vocab] at the prompt end;
    ``publish_s``: the prefill's seconds storing them and waiting until they were visible."""

    rid: str
    first_token: int
    logits: bytes = b""
    stored_pages: int = 0
    state_stored: bool = False
    publish_s: float = 0.0


class Failed(_Msg, tag="failed"):
    rid: str
    reason: str  # "abort" | "timeout" | "error"
    message: str = ""


class Generate(_Msg, tag="generate"):
    rid: str
    prompt: list[int]
    max_new_tokens: int = 8


class Generated(_Msg, tag="generated"):
    """``logits``: float32 [len(output_ids), vocab]; ``decode_prefix_len``: prompt tokens the
    decode held itself; ``moved_pages`` / ``moved_states``: KV pages and states it loaded from
    the prefill's delta; ``loaded_pages`` / ``loaded_states``: those its arrival load-back read
    from the daemon (pages other engines of the node stored). Pages moved into the decode, all
    told: ``moved_pages + loaded_pages``. Where ``ttft_s`` went: ``prefill_s`` from asking the
    prefill to its Ready (of which ``publish_s`` the prefill's storing and waiting until the
    pages were visible), ``load_s`` the decode's load of the delta."""

    rid: str
    output_ids: list[int] = []
    logits: bytes = b""
    error: str = ""
    ttft_s: float = 0.0
    cached_tokens: int = 0
    decode_prefix_len: int = 0
    moved_pages: int = 0
    moved_states: int = 0
    loaded_pages: int = 0
    loaded_states: int = 0
    prefill_s: float = 0.0
    publish_s: float = 0.0
    load_s: float = 0.0


class CheckIdle(_Msg, tag="check"):
    pass


class Checked(_Msg, tag="checked"):
    ok: bool
    message: str = ""


class GetUsage(_Msg, tag="get_usage"):
    pass


class Usage(_Msg, tag="usage"):
    """The engine's device pools: ``kv_pages`` of ``page_size`` tokens, ``kv_free`` of them
    free, ``kv_cached`` held by its radix cache (evictable or locked); ``page_bytes``: one KV
    page (and its indexer page), ``state_bytes``: one state slot (0: no states)."""

    page_size: int
    kv_pages: int
    kv_free: int
    kv_cached: int
    page_bytes: int
    state_slots: int = 0
    state_free: int = 0
    state_bytes: int = 0

    @property
    def used_tokens(self) -> int:
        """Tokens of the KV pool in use (cached prefixes and running requests' pages)."""
        return (self.kv_pages - self.kv_free) * self.page_size


ToPrefill = PrefillRequest | AbortRequest
ToDecode = Ready | Failed
ToEngine = Generate | CheckIdle | GetUsage
ToUser = Generated | Checked | Usage

_encoder = msgspec.msgpack.Encoder()
_decoders = {name: msgspec.msgpack.Decoder(t) for name, t in
             (("prefill", ToPrefill), ("decode", ToDecode), ("engine", ToEngine),
              ("user", ToUser))}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes, direction: str):
    """A message read by ``direction`` ("prefill", "decode", "engine" or "user")."""
    try:
        return _decoders[direction].decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
        raise PDProtocolError(f"malformed {direction} frame of {len(frame)} bytes: {e}") from None


def logits_bytes(rows: list[torch.Tensor]) -> bytes:
    """float32 rows [vocab] -> bytes (empty for no rows)."""
    if not rows:
        return b""
    return torch.stack([r.detach().float().cpu() for r in rows]).numpy().tobytes()


def logits_rows(data: bytes, vocab: int) -> list[torch.Tensor]:
    """Inverse of ``logits_bytes``."""
    if not data:
        return []
    a = np.frombuffer(data, dtype=np.float32).reshape(-1, vocab)
    return [torch.from_numpy(a[i].copy()) for i in range(a.shape[0])]
