"""The checksum trailer of every page object the Mooncake backend stores.

Mooncake stores exactly the bytes it is given, and an arena slot (the page rounded up to 64
bytes) has no room to spare, so each object is put from two buffers and read back into two:

    object = page bytes (the arena slot) | trailer (16 bytes, from a registered scratch buffer)
    trailer = b"HCT1" | u32 page_bytes | u64 digest
    digest  = XXH3-64 of the page bytes seeded with its identity (``integrity.py``)

with ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` (one object, one
atomic put: a separate checksum object could be evicted apart from its page). The objects live
under ``<key_prefix>/c1/...``: a store never mixes them with the unchecked objects of earlier
versions (``<key_prefix>/<ns>/...``), which are never read again and go with ``clear``.

The scratch buffer holds ``SLOTS`` trailers per lane (put, get), registered with the client
once; a batch of more pages is moved in several calls.
"""

from __future__ import annotations

import mmap
import struct
import threading

import torch

FORMAT_PART = "c1"  # object keys: <key_prefix>/c1/<ns>/<pool>/<key>
MAGIC = b"HCT1"
_TRAILER = struct.Struct("<4sIQ")
TRAILER_BYTES = _TRAILER.size
SLOTS = 1 << 14  # trailers per lane and call
LANES = ("put", "get")


class Trailers:
    """The registered scratch buffer of trailers: one lane (a lock and ``SLOTS`` trailers) for
    puts, one for gets."""

    def __init__(self):
        self.nbytes = len(LANES) * SLOTS * TRAILER_BYTES
        self.buffer = mmap.mmap(-1, self.nbytes)
        self._view = torch.frombuffer(self.buffer, dtype=torch.uint8)
        self.base = self._view.data_ptr()
        self.locks = {lane: threading.Lock() for lane in LANES}

    def lane_base(self, lane: str) -> int:
        return LANES.index(lane) * SLOTS * TRAILER_BYTES

    def ptrs(self, lane: str, n: int) -> list[int]:
        """Addresses of the first ``n`` trailers of ``lane``."""
        start = self.base + self.lane_base(lane)
        return [start + i * TRAILER_BYTES for i in range(n)]

    def seal(self, lane: str, i: int, page_bytes: int, digest: int) -> None:
        """Write the trailer of a page whose ``page_digest`` is ``digest`` into trailer ``i``
        of ``lane``."""
        at = self.lane_base(lane) + i * TRAILER_BYTES
        _TRAILER.pack_into(self.buffer, at, MAGIC, page_bytes, digest)

    def check(self, lane: str, i: int, page_bytes: int, digest: int | None) -> str | None:
        """None when trailer ``i`` of ``lane`` names a page of ``page_bytes`` whose
        ``page_digest`` is ``digest`` (the page as read); else what is wrong."""
        at = self.lane_base(lane) + i * TRAILER_BYTES
        magic, size, stored = _TRAILER.unpack_from(self.buffer, at)
        if magic != MAGIC or size != page_bytes:
            return "no trailer of this format and page size"
        if digest is None or digest != stored:
            return "page bytes or identity changed"
        return None

    def clear(self, lane: str, n: int) -> None:
        """Zero the first ``n`` trailers of ``lane`` (before a get writes them: a get that
        wrote no trailer must not verify against the previous call's)."""
        at = self.lane_base(lane)
        self.buffer[at:at + n * TRAILER_BYTES] = bytes(n * TRAILER_BYTES)
