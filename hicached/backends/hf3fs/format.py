"""On-disk format of the 3FS backend: paths, key hashes and the fixed-size records it writes.

Everything here is pure (no I/O): the backend (``backend.py``) and its slot space
(``space.py``) build and check these records. All integers are little-endian; every record
ends with a CRC-32 of its other bytes, so a record that is torn, zeroed (a sparse hole) or of
another format never decodes.

    <root>/hicached-hf3fs.json                    format marker {"format": 1}
    <root>/nodes/<node>.json                      node identity: uuid, host, epoch (atomic rename)
    <root>/nodes/<node>.lock                      flock: one daemon per node name on a host
    <root>/segments/<uuid>/owner.json             whose directory this is: node, host
    <root>/segments/<uuid>/<seg>.seg              a node's segment files (only it writes them)
    <root>/index/<ns>/<pool>/<kh[:2]>/<kh>        pointer records, kh = key hash (32 hex)

Segment file (``seg`` = "<slot_bytes>-<epoch>-<n>", never reused):

    [0, 4096)                  segment header (SEG)
    [4096, slots_off)          directory: one 256-byte DirEntry per slot
    slots_off + i*slot_bytes   slot i:
        +0      .. +4032       unused (sparse)
        +4032   .. +4096       head stamp (64 B)         written first
        +4096   .. +4096+P     page bytes (4 KiB aligned) written second, with the trail stamp
        +4096+P .. +4160+P     trail stamp (64 B)
    slot_bytes = round_up(4096 + P + 64, 4096) for the largest page P of the class

Stamp (head and trail, the same fields): magic, slot, generation, page size, key hash, segment
tag, ``data_hash``, flags, CRC-32. With ``HAS_HASH`` in the flags (every stamp written now),
``data_hash`` is XXH3-64 of the page bytes seeded with the page's identity (namespace, pool,
key, page size: ``integrity.py``): page bytes that changed under intact stamps (bit rot, a
misdirected write of another key's page) do not verify. Stamps of the format before it (a
u32 CRC-32 of the page only with the option ``checksum``, then u32 flags and 4 bytes of
padding) decode with the same CRC and fields, and flags 0 (the padding): they cannot be
verified, so such a slot is a miss and its page is stored again. ``FORMAT`` stays 1: an
upgraded daemon keeps the root, its segments and pointers; only old slots miss once each.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
import zlib
from typing import NamedTuple

FORMAT = 1
MARKER = "hicached-hf3fs.json"  # at the root: {"format": FORMAT}
BLOCK = 4096
STAMP_BYTES = 64
HEAD_OFF = BLOCK - STAMP_BYTES  # head stamp offset inside a slot
PAGE_OFF = BLOCK  # page offset inside a slot
DIR_ENTRY_BYTES = 256
NAME_MAX = 64  # longest ns / pool path component kept as is

HEAD_MAGIC, TRAIL_MAGIC = b"H3SH", b"H3ST"
_STAMP = struct.Struct("<4sIQQ16sQQI")  # + crc32 -> 64 bytes
_DIR = struct.Struct("<4sIQQQ16sBB64s64s74x")  # + crc32 -> 256 bytes
_SEG = struct.Struct("<4sIQQQQ16sQ")  # + crc32, inside the first block
_PTR = struct.Struct("<4sIQQIIQQ16s16sH")  # + seg name + crc32
_CRC = struct.Struct("<I")
assert _STAMP.size + 4 == STAMP_BYTES and _DIR.size + 4 == DIR_ENTRY_BYTES

_PLAIN = re.compile(r"^[A-Za-z0-9_.-]+$")


def round_up(n: int, align: int = BLOCK) -> int:
    return -(-n // align) * align


def slot_bytes_for(page_bytes: int) -> int:
    """Bytes of the slot class that holds pages of ``page_bytes``."""
    return round_up(PAGE_OFF + page_bytes + STAMP_BYTES)


def safe_name(s: str) -> str:
    """A path component for ``s``: itself when plain and short, else ``h-`` + a digest."""
    if _PLAIN.match(s) and len(s) <= NAME_MAX and not s.startswith((".", "h-")):
        return s
    return "h-" + hashlib.sha256(s.encode()).hexdigest()[:40]


@functools.lru_cache(maxsize=1024)
def _table_hasher(ns: str, pool: str):
    n, p = ns.encode(), pool.encode()
    return hashlib.sha256(b"hicached-hf3fs\0%d:%b%d:%b" % (len(n), n, len(p), p))


def key_hash(ns: str, pool: str, key: str) -> bytes:
    """128-bit digest of (namespace, pool, key); ns and pool are length-prefixed, so no two
    triples collide by concatenation. Stable across processes and hosts (never ``hash``)."""
    h = _table_hasher(ns, pool).copy()
    h.update(key.encode())
    return h.digest()[:16]


def pointer_relpath(ns_name: str, pool_name: str, kh: bytes) -> str:
    """Pointer record path under the root (``ns_name`` / ``pool_name`` from ``safe_name``)."""
    hx = kh.hex()
    return f"index/{ns_name}/{pool_name}/{hx[:2]}/{hx}"


@functools.lru_cache(maxsize=4096)
def segment_tag(node_uuid: bytes, seg: str) -> int:
    """64-bit tag of one segment file, stamped into every slot: a read from the wrong file
    (a recycled fd, a renamed file) never verifies."""
    return int.from_bytes(hashlib.sha256(node_uuid + seg.encode()).digest()[:8], "little")


def _seal(body: bytes) -> bytes:
    return body + _CRC.pack(zlib.crc32(body))


def _open(raw: bytes | memoryview, size: int) -> bytes | None:
    """The body of a sealed record of ``size`` bytes, or None if the CRC does not match."""
    raw = bytes(raw[:size])
    if len(raw) != size or zlib.crc32(raw[:-4]) != _CRC.unpack_from(raw, size - 4)[0]:
        return None
    return raw[:-4]


# ---------------------------------------------------------------- slot stamps


class Stamp(NamedTuple):
    """What a slot holds: written as the head (before the page) and the trail (after it)."""

    slot: int
    gen: int
    page_bytes: int
    key_hash: bytes
    seg_tag: int
    data_hash: int  # ``integrity.page_digest`` of the page bytes when ``flags & HAS_HASH``
    flags: int = 0


# flag bits. (1 was the old format's "has a page CRC-32"; an old stamp's flags land in the
# high half of data_hash, and its flags field, once padding, decodes as 0.)
HAS_HASH = 2


def pack_stamp(magic: bytes, s: Stamp) -> bytes:
    return _seal(_STAMP.pack(magic, s.slot, s.gen, s.page_bytes, s.key_hash, s.seg_tag,
                             s.data_hash, s.flags))


def unpack_stamp(magic: bytes, raw: bytes | memoryview) -> Stamp | None:
    body = _open(raw, STAMP_BYTES)
    if body is None:
        return None
    m, slot, gen, page_bytes, kh, tag, dhash, flags = _STAMP.unpack(body)
    return Stamp(slot, gen, page_bytes, kh, tag, dhash, flags) if m == magic else None


# ---------------------------------------------------------------- segment header and directory


class SegmentHeader(NamedTuple):
    slot_bytes: int
    num_slots: int
    dir_off: int
    slots_off: int
    node_uuid: bytes
    created_ns: int

    @classmethod
    def layout(cls, slot_bytes: int, num_slots: int, node_uuid: bytes, created_ns: int
               ) -> SegmentHeader:
        dir_off = BLOCK
        slots_off = dir_off + round_up(num_slots * DIR_ENTRY_BYTES)
        return cls(slot_bytes, num_slots, dir_off, slots_off, node_uuid, created_ns)

    @property
    def file_bytes(self) -> int:
        return self.slots_off + self.num_slots * self.slot_bytes

    def slot_off(self, i: int) -> int:
        return self.slots_off + i * self.slot_bytes

    def dir_entry_off(self, i: int) -> int:
        return self.dir_off + i * DIR_ENTRY_BYTES

    def pack(self) -> bytes:
        return _seal(_SEG.pack(b"H3SG", FORMAT, *self))

    @classmethod
    def unpack(cls, raw: bytes) -> SegmentHeader | None:
        body = _open(raw, _SEG.size + 4)
        if body is None:
            return None
        magic, version, *fields = _SEG.unpack(body)
        return cls(*fields) if magic == b"H3SG" and version == FORMAT else None


class DirEntry(NamedTuple):
    """One slot's directory record: enough to rebuild a node's live set at restart and to
    find the pointer to remove when the slot is evicted. ``state`` 0 = free, 1 = live."""

    state: int
    gen: int
    page_bytes: int
    written_ns: int
    key_hash: bytes
    ns_name: str
    pool_name: str

    def pack(self) -> bytes:
        return _seal(_DIR.pack(b"H3DE", self.state, self.gen, self.page_bytes, self.written_ns,
                               self.key_hash, len(self.ns_name), len(self.pool_name),
                               self.ns_name.encode(), self.pool_name.encode()))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> DirEntry | None:
        body = _open(raw, DIR_ENTRY_BYTES)
        if body is None:
            return None
        magic, state, gen, pb, wns, kh, nl, pl, ns, pool = _DIR.unpack(body)
        if magic != b"H3DE":
            return None
        return cls(state, gen, pb, wns, kh, ns[:nl].decode(), pool[:pl].decode())


# ---------------------------------------------------------------- pointer records


class Pointer(NamedTuple):
    """A key's pointer record: which node's segment, which slot (and its file offset, so a
    reader needs nothing else of the segment), which generation."""

    node_uuid: bytes
    seg: str
    slot: int
    slot_off: int
    gen: int
    page_bytes: int
    key_hash: bytes

    def pack(self) -> bytes:
        name = self.seg.encode()
        return _seal(_PTR.pack(b"H3PT", FORMAT, self.gen, self.page_bytes, self.slot, 0, 0,
                               self.slot_off, self.key_hash, self.node_uuid, len(name)) + name)

    def segment_relpath(self) -> str:
        return f"segments/{self.node_uuid.hex()}/{self.seg}.seg"

    @classmethod
    def unpack(cls, raw: bytes) -> Pointer | None:
        if len(raw) < _PTR.size + 4:
            return None
        name_len = _PTR.unpack_from(raw)[-1]
        body = _open(raw, _PTR.size + name_len + 4)
        if body is None or len(raw) != _PTR.size + name_len + 4:
            return None
        magic, version, gen, pb, slot, _, _, slot_off, kh, node, _ = _PTR.unpack_from(body)
        if magic != b"H3PT" or version != FORMAT:
            return None
        seg = body[_PTR.size:].decode(errors="replace")
        if not _PLAIN.match(seg):
            return None
        return cls(node, seg, slot, slot_off, gen, pb, kh)
