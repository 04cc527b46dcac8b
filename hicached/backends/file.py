"""The embedded L3: one file per page under a local directory (``<state_dir>/l3``).

    l3/<namespace digest>/<pool>/<2-char fan-out>/<file name>
    file name = the key when it is a plain token ([A-Za-z0-9_.-], <= 160 chars),
                else "h-" + sha256(key)  (the key itself is in the header either way)
    file      = header | page bytes
    header    = b"HCP1" | u16 header_len | u16 key_len | u64 page_bytes | key utf-8

Writes are atomic: the page goes to ``<name>.tmp-<pid>-<thread>`` and is renamed over the final
name, so a reader (or a restarted daemon) sees a whole page or none. Leftover temp files of a
crash are removed at start. Reads check magic, page size and key before the bytes are trusted: a
file of another page size or key is a miss, never a wrong page. The in-memory key set, rebuilt by
scanning the directory at start, answers ``exists`` without touching the disk.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import threading
from collections.abc import Sequence

from hicached.backends.base import L3Backend
from hicached.protocol import MAX_KEY_LEN

log = logging.getLogger(__name__)

MAGIC = b"HCP1"
_HEAD = struct.Struct("<4sHHQ")
_PLAIN = re.compile(r"^[A-Za-z0-9_.-]{1,160}$")
HEADER_MAX = _HEAD.size + 4 * MAX_KEY_LEN  # a header holds the key's UTF-8 bytes


def file_name(key: str) -> str:
    """File name of a key: the key itself when safe, else a digest."""
    if _PLAIN.match(key) and not key.startswith((".", "h-")):
        return key
    return "h-" + hashlib.sha256(key.encode()).hexdigest()


def encode_header(key: str, page_bytes: int) -> bytes:
    kb = key.encode()
    return _HEAD.pack(MAGIC, _HEAD.size + len(kb), len(kb), page_bytes) + kb


def decode_header(raw: bytes) -> tuple[int, str, int]:
    """(header_len, key, page_bytes) of a page file's first bytes; ValueError if not ours."""
    if len(raw) < _HEAD.size:
        raise ValueError("short header")
    magic, header_len, key_len, page_bytes = _HEAD.unpack_from(raw)
    if magic != MAGIC or header_len != _HEAD.size + key_len or len(raw) < header_len:
        raise ValueError("bad header")
    return header_len, raw[_HEAD.size : header_len].decode(), page_bytes


class FileBackend(L3Backend):
    """Pages as files under ``root``; safe for one writer and one reader thread plus the loop."""

    name = "file"

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str], set[str]] = {}
        self._dirs: set[str] = set()
        self.errors = 0
        self._scan()

    # ------------------------------------------------------------ layout

    def _dir(self, ns: str, pool: str, name: str) -> str:
        return os.path.join(self.root, ns, pool, name[-2:])

    def _path(self, ns: str, pool: str, key: str) -> str:
        name = file_name(key)
        return os.path.join(self._dir(ns, pool, name), name)

    def _scan(self) -> None:
        """Rebuild the key sets from the directory; remove temp files of a crashed writer."""
        found = 0
        for ns in os.listdir(self.root):
            ns_dir = os.path.join(self.root, ns)
            if not os.path.isdir(ns_dir):
                continue
            for pool in os.listdir(ns_dir):
                keys = self._keys.setdefault((ns, pool), set())
                for dirpath, _, files in os.walk(os.path.join(ns_dir, pool)):
                    for f in files:
                        path = os.path.join(dirpath, f)
                        if ".tmp-" in f:
                            os.unlink(path)
                        elif f.startswith("h-"):
                            key = self._read_key(path)
                            if key is not None:
                                keys.add(key)
                        else:
                            keys.add(f)
                found += len(keys)
        if found:
            log.info("file L3 at %s: %d pages found", self.root, found)

    def _read_key(self, path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                return decode_header(f.read(HEADER_MAX))[1]
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    # ------------------------------------------------------------ contract

    def exists(self, ns: str, pool: str, keys: Sequence[str]) -> list[bool]:
        have = self._keys.get((ns, pool))
        if not have:
            return [False] * len(keys)
        return [k in have for k in keys]

    def batch_put(self, ns, pool, keys, offsets, page_bytes):
        with self._lock:
            have = self._keys.setdefault((ns, pool), set())
        out = []
        for key, offset in zip(keys, offsets):
            if key in have:
                out.append(True)
                continue
            ok = self._put_one(ns, pool, key, offset, page_bytes)
            if ok:
                have.add(key)
            out.append(ok)
        return out

    def _put_one(self, ns: str, pool: str, key: str, offset: int, page_bytes: int) -> bool:
        path = self._path(ns, pool, key)
        d = os.path.dirname(path)
        if d not in self._dirs:
            os.makedirs(d, exist_ok=True)
            self._dirs.add(d)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                data = self.arena.view(offset, page_bytes)
                header = encode_header(key, page_bytes)
                written = os.writev(fd, [header, data])
                while written < len(header) + page_bytes:  # short writes: finish the page
                    done = written - len(header)
                    written += os.write(fd, data[done:])
            finally:
                os.close(fd)
            os.rename(tmp, path)
            return True
        except (OSError, struct.error, ValueError) as e:  # (a key no header can hold)
            self._count_error("write", path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def batch_get(self, ns, pool, keys, offsets, page_bytes):
        have = self._keys.get((ns, pool), set())
        return [
            key in have and self._get_one(ns, pool, key, offset, page_bytes)
            for key, offset in zip(keys, offsets)
        ]

    def _get_one(self, ns: str, pool: str, key: str, offset: int, page_bytes: int) -> bool:
        path = self._path(ns, pool, key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._keys.get((ns, pool), set()).discard(key)
            return False
        except OSError as e:
            self._count_error("open", path, e)
            return False
        try:
            header_len, stored_key, stored_bytes = decode_header(os.pread(fd, HEADER_MAX, 0))
            if stored_key != key or stored_bytes != page_bytes:
                log.warning("file L3: %s holds key %r of %d bytes, wanted %r of %d bytes: miss",
                            path, stored_key, stored_bytes, key, page_bytes)
                return False
            n = os.preadv(fd, [self.arena.view(offset, page_bytes)], header_len)
            return n == page_bytes
        except (OSError, ValueError, UnicodeDecodeError) as e:
            self._count_error("read", path, e)
            return False
        finally:
            os.close(fd)

    def _count_error(self, what: str, path: str, err: Exception) -> None:
        if self.errors == 0:
            log.error("file L3 %s failed for %s: %s (further errors are only counted)",
                      what, path, err)
        self.errors += 1

    def clear(self) -> int:
        n = 0
        with self._lock:
            for (ns, pool), keys in self._keys.items():
                for key in list(keys):
                    try:
                        os.unlink(self._path(ns, pool, key))
                        n += 1
                    except FileNotFoundError:
                        pass
                keys.clear()
        return n

    def stats(self) -> dict:
        return {"pages": sum(len(k) for k in self._keys.values()), "errors": self.errors}
