"""Page keys and namespaces for engines that need hicached to name their pages.

A page key is SGLang's page hash: SHA-256 over the previous page's digest (raw 32 bytes, absent for
the first page) followed by the page's token ids as 4-byte little-endian unsigned integers, as
64 lowercase hex characters. The chain makes key i stand for the whole prefix up to page i, so a
page can never be reused under another prefix, and "longest run of present keys" is the prefix hit.
Never Python ``hash()``: it is salted per process and would make keys differ between engines.

    keys = page_keys(token_ids, page_size=16)              # one key per *full* page
    more = page_keys(next_tokens, 16, prior=keys[-1])      # continue the chain

A namespace (fixed in the client's handshake) names everything that changes a page's bytes for the
same tokens: model identity and weights revision, KV dtype, pool layout, page size, the parallel
slice, and an optional tenant salt. Changing any of them makes old pages unreachable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_U32_MAX = (1 << 32) - 1


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > _U32_MAX):
        bad = int(arr[(arr < 0) | (arr > _U32_MAX)][0])
        raise ValueError(f"token id {bad} does not fit an unsigned 32-bit page key")
    return arr.astype("<u4").tobytes()


def page_hash(token_ids: Sequence[int], prior: str | None = None) -> str:
    """The key of one page whose tokens are ``token_ids``, chained after key ``prior``."""
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    h.update(_token_bytes(token_ids))
    return h.hexdigest()


def page_keys(token_ids: Sequence[int], page_size: int, prior: str | None = None) -> list[str]:
    """Chained keys of the full pages of ``token_ids`` (a partial last page gets no key)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    data = _token_bytes(tokens)
    step = 4 * page_size
    keys: list[str] = []
    for start in range(0, (len(tokens) // page_size) * step, step):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        h.update(data[start : start + step])
        prior = h.hexdigest()
        keys.append(prior)
    return keys


class KeyChain:
    """The page keys of one growing token sequence, extended incrementally (a request's)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.keys: list[str] = []

    def extend(self, token_ids: Sequence[int]) -> list[str]:
        """Keys of every full page of ``token_ids`` (which must extend what was seen before)."""
        have = len(self.keys) * self.page_size
        full = (len(token_ids) // self.page_size) * self.page_size
        if full > have:
            prior = self.keys[-1] if self.keys else None
            self.keys += page_keys(token_ids[have:full], self.page_size, prior)
        return self.keys


def namespace(model: str, weights: str, dtype: str, layout: str, page_size: int, *,
              tp_rank: int = 0, tp_size: int = 1, salt: str = "") -> str:
    """The namespace string of a client: ``model|weights|dtype|layout|p<page>|tp<r>of<n>[|salt]``.

    ``model`` is the architecture and shape, ``weights`` a digest or revision of the weights.
    """
    for name, value in (("model", model), ("weights", weights), ("dtype", dtype),
                        ("layout", layout)):
        if not value or "|" in value:
            raise ValueError(f"namespace {name} must be non-empty and contain no '|', got "
                             f"{value!r}")
    if "|" in salt:
        raise ValueError(f"namespace salt must contain no '|', got {salt!r}")
    parts = [model, weights, dtype, layout, f"p{page_size}", f"tp{tp_rank}of{tp_size}"]
    if salt:
        parts.append(salt)
    return "|".join(parts)
