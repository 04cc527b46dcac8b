"""The file L3's format: where a page's file lives and what its header holds (``file.py``
describes both).

    file      = header | page bytes
    header    = b"HCP2" | u16 header_len | u16 key_len | u64 page_bytes | u64 digest | key utf-8
"""

from __future__ import annotations

import hashlib
import re
import struct

from hicached.errors import ConfigError
from hicached.protocol import MAX_KEY_LEN
from hicached.settings import parse_size

MAGIC = b"HCP2"
OLD_MAGICS = (b"HCP1",)  # formats without a checksum: misses, removed when first read
_HEAD = struct.Struct("<4sHHQQ")
_PLAIN = re.compile(r"^[A-Za-z0-9_.-]{1,160}$")
HEADER_MAX = _HEAD.size + 4 * MAX_KEY_LEN  # a header holds the key's UTF-8 bytes
BLOCK = 4096  # a page file is counted as its size rounded up to this


def file_bytes(key: str, page_bytes: int) -> int:
    """Bytes a page file of ``key`` takes on disk, as counted against the capacity."""
    return -(-(_HEAD.size + len(key.encode()) + page_bytes) // BLOCK) * BLOCK


def fs_share(value: object, total: int, key: str, allow_zero: bool = False) -> int:
    """Bytes from a size (``100GiB``) or a share of the filesystem's ``total`` (``"25%"``)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ConfigError(f"{key}: cannot read {value!r} as a percentage") from None
        if not (0 < pct <= 100 or (allow_zero and pct == 0)):
            raise ConfigError(f"{key}: {value!r} is not a share of the filesystem")
        return int(total * pct / 100)
    return parse_size(value, key, allow_zero)


def file_name(key: str) -> str:
    """File name of a key: the key itself when safe, else a digest."""
    if _PLAIN.match(key) and not key.startswith((".", "h-")):
        return key
    return "h-" + hashlib.sha256(key.encode()).hexdigest()


def safe_pool(pool: str) -> bool:
    """Whether ``pool`` is one path component under its namespace's directory: a name such
    as "../<other namespace>/kv" would read and overwrite another namespace's pages."""
    return bool(pool) and pool not in (".", "..") and not any(c in pool for c in "/\\\0")


def pool_dir(pool: str) -> str:
    """Directory name of a pool (see the module docstring): never a path of its own."""
    if safe_pool(pool) and not pool.startswith("h-") and len(pool.encode()) <= 128:
        return pool
    return "h-" + hashlib.sha256(pool.encode()).hexdigest()


class OldFormat(ValueError):
    """A page file written before checksums: it cannot be verified."""


def header_bytes(key: str) -> int:
    """Length of the header ``encode_header`` writes for ``key``."""
    return _HEAD.size + len(key.encode())


def encode_header(key: str, page_bytes: int, digest: int) -> bytes:
    kb = key.encode()
    return _HEAD.pack(MAGIC, _HEAD.size + len(kb), len(kb), page_bytes, digest) + kb


def decode_header(raw: bytes) -> tuple[int, str, int, int]:
    """(header_len, key, page_bytes, digest) of a page file's first bytes; ValueError if not
    ours (``OldFormat`` for a file of the format before checksums)."""
    if raw[:4] in OLD_MAGICS:
        raise OldFormat("written before checksums")
    if len(raw) < _HEAD.size:
        raise ValueError("short header")
    magic, header_len, key_len, page_bytes, digest = _HEAD.unpack_from(raw)
    if magic != MAGIC or header_len != _HEAD.size + key_len or len(raw) < header_len:
        raise ValueError("bad header")
    return header_len, raw[_HEAD.size : header_len].decode(), page_bytes, digest
