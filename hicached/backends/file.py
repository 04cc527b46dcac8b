"""The embedded L3: one file per page under a local directory (``<state_dir>/l3``).

    l3/<namespace digest>/<pool dir>/<2-char fan-out>/<file name>
    pool dir  = the pool name when it is one plain path component (no "/", NUL, "." or "..",
                <= 128 bytes, not "h-..."), else "h-" + sha256(pool) (pages of a digest-named
                pool are not found again after a restart, so the restart scan deletes them).
                Pool names with "/", "\\", NUL, or "." / ".." alone are refused outright, by
                the daemon at registration and by this backend (``safe_pool``): they would
                reach another namespace's directory, or take the daemon's writes outside the
                root
    file name = the key when it is a plain token ([A-Za-z0-9_.-], <= 160 chars),
                else "h-" + sha256(key)  (the key itself is in the header either way)
    file      = header | page bytes
    header    = b"HCP2" | u16 header_len | u16 key_len | u64 page_bytes | u64 digest | key utf-8
    digest    = XXH3-64 of the page bytes seeded with the page's identity (namespace, pool,
                key, page size: ``integrity.py``), so a file copied under another namespace or
                pool directory does not verify either

Writes are atomic: the page goes to ``<name>.tmp-<pid>-<thread>`` and is renamed over the final
name, so a reader (or a restarted daemon) sees a whole page or none. Leftover temp files of a
crash are removed at start. Reads check magic, page size and key, then the digest of the bytes
read into the arena, before the page counts as loaded: a file of another page size or key, with
a changed byte or cut short, is a miss, never a wrong page; it is counted
(``integrity_failures``), logged once per episode and removed, so the next set stores the page
again. Files of the format before checksums (b"HCP1") are misses and removed when first read
(the restart scan only stats files). The in-memory key set, rebuilt by
scanning the directory at start, answers ``exists`` without touching the disk.

Space is bounded twice (``capacity``, ``min_free``): the pages take at most ``capacity`` bytes
(default 25 % of the filesystem), and a put never leaves the filesystem with less than
``min_free`` free (default 5 %, whoever else fills it). Room is made by deleting the least
recently used pages first; a get renews its file's mtime, so a restarted daemon, which orders
the pages it finds by mtime, keeps that order. A reader that has a page open while it is evicted
still reads the whole page (the inode lives until it is closed); later ones miss.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from hicached.backends.base import L3Backend
from hicached.backends.file_format import (
    BLOCK,
    HEADER_MAX,
    OldFormat,
    decode_header,
    encode_header,
    file_bytes,
    file_name,
    fs_share,
    header_bytes,
    pool_dir,
    safe_pool,
)
from hicached.backends.integrity import (
    HASH_AHEAD_MIN,
    HashAhead,
    HashedBatch,
    Integrity,
    checksums_on,
    identity_seed,
    read_hashed,
    write_hashed,
    write_plain,
)
from hicached.errors import ArenaError, ConfigError

log = logging.getLogger(__name__)

SCAN_REPORT_S = 10.0  # a long start-up scan logs how far it got this often
EVICTED_MAX = 1 << 16  # evicted keys kept for ``take_evicted``; past it, it answers None


class FileBackend(L3Backend):
    """Pages as files under ``root``; safe for one writer and one reader thread plus the loop.

    ``capacity``: bytes the pages may take (a size or a share of the filesystem, ``"25%"``).
    ``min_free``: bytes a put leaves free on the filesystem at least (size or share, ``"5%"``;
    0 turns the check off).
    """

    name = "file"
    clears_namespaces = True  # a namespace's pages are the files under <root>/<its digest>/

    def __init__(self, root: str, capacity: object = "25%", min_free: object = "5%",
                 **unknown):
        if unknown:
            raise ConfigError(f"file: unknown option {min(unknown)!r}; valid: "
                              "['root', 'capacity', 'min_free']")
        if not isinstance(root, str) or not root:  # "" would be the daemon's working directory
            raise ConfigError(f"file: option 'root' must name a directory, got {root!r}")
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        fs = os.statvfs(self.root)
        total = fs.f_blocks * fs.f_frsize
        self.capacity = fs_share(capacity, total, "file capacity")
        self.min_free = fs_share(min_free, total, "file min_free", allow_zero=True)
        self._lock = threading.Lock()  # the LRU, ``used`` and the key tables
        self._keys: dict[tuple[str, str], dict[str, int]] = {}  # (ns, pool) -> key -> bytes
        self._lru: OrderedDict[tuple[str, str, str], None] = OrderedDict()  # oldest first
        self.used = 0
        self._dirs: set[str] = set()
        self.errors = 0
        self._errors_lock = threading.Lock()
        self.evictions = 0
        self.refused = 0  # pages not stored: no room could be made for them
        self._full_logged = False
        self._evicted: deque[tuple[str, str, str]] = deque()
        self._evicted_lost = False
        self.integrity = Integrity("file")
        self._put_hash, self._get_hash = HashAhead(), HashAhead()  # digests ahead of I/O
        self._scan()
        with self._lock:
            self._make_room(0)  # a restart with a smaller capacity

    # ------------------------------------------------------------ layout

    def _dir(self, ns: str, pool: str, name: str) -> str:
        return os.path.join(self.root, ns, pool_dir(pool), name[-2:])

    def _path(self, ns: str, pool: str, key: str) -> str:
        name = file_name(key)
        return os.path.join(self._dir(ns, pool, name), name)

    def _scan(self) -> None:
        """Rebuild the key tables and the LRU (by mtime) from the directory; remove temp files
        of a crashed writer and files that are not whole pages."""
        found: list[tuple[float, str, str, str, int]] = []
        started = last = time.monotonic()
        for ns in os.listdir(self.root):
            ns_dir = os.path.join(self.root, ns)
            if not os.path.isdir(ns_dir):
                continue
            for pool in os.listdir(ns_dir):
                # a digest directory names no pool: its pages are never found again, and
                # evictions and clears (which go by pool name) would never delete them
                unreachable = pool.startswith("h-")
                for dirpath, _, files in os.walk(os.path.join(ns_dir, pool)):
                    for f in files:
                        if unreachable:
                            self._remove(os.path.join(dirpath, f))
                            continue
                        page = self._scan_one(os.path.join(dirpath, f), f)
                        if page is not None:
                            found.append((page[0], ns, pool, page[1], page[2]))
                    if time.monotonic() - last > SCAN_REPORT_S:
                        last = time.monotonic()
                        log.info("file L3 at %s: scanning, %d pages so far", self.root,
                                 len(found))
        found.sort()
        for _, ns, pool, key, nbytes in found:
            self._add(ns, pool, key, nbytes)
        if found:
            log.info("file L3 at %s: %d pages found (%d bytes of a capacity of %d) in %.1f s",
                     self.root, len(found), self.used, self.capacity,
                     time.monotonic() - started)

    def _scan_one(self, path: str, name: str) -> tuple[float, str, int] | None:
        """(mtime, key, bytes) of a page file, or None (a temp file, removed)."""
        if ".tmp-" in name:
            self._remove(path)
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        key: str | None = name
        if name.startswith("h-"):
            key = self._read_key(path)
            if key is None:
                return None
        return st.st_mtime, key, -(-st.st_size // BLOCK) * BLOCK

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _read_key(self, path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                return decode_header(f.read(HEADER_MAX))[1]
        except OldFormat:  # (a digest-named file of the old format: it names no key)
            self._remove(path)
            return None
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    # ------------------------------------------------------------ space (under ``_lock``)

    def _add(self, ns: str, pool: str, key: str, nbytes: int) -> None:
        table = self._keys.setdefault((ns, pool), {})
        old = table.get(key)
        if old is not None:
            self.used -= old
        table[key] = nbytes
        self.used += nbytes
        self._lru[(ns, pool, key)] = None
        self._lru.move_to_end((ns, pool, key))

    def _forget(self, ns: str, pool: str, key: str) -> None:
        nbytes = self._keys.get((ns, pool), {}).pop(key, None)
        if nbytes is not None:
            self.used -= nbytes
            self._lru.pop((ns, pool, key), None)

    def _make_room(self, need: int) -> bool:
        """Delete least recently used pages until ``need`` more bytes fit the capacity and
        leave ``min_free`` free on the filesystem; whether they do (a page larger than the
        whole capacity evicts nothing)."""
        while need <= self.capacity and self._lru and (
                self.used + need > self.capacity or not self._disk_fits(need)):
            ns, pool, key = next(iter(self._lru))
            self._forget(ns, pool, key)
            if len(self._evicted) < EVICTED_MAX:
                self._evicted.append((ns, pool, key))
            else:
                self._evicted_lost = True
            try:
                os.unlink(self._path(ns, pool, key))
            except FileNotFoundError:
                pass
            except OSError as e:
                self._count_error("delete", self._path(ns, pool, key), e)
            self.evictions += 1
        fits = self.used + need <= self.capacity and self._disk_fits(need)
        if not fits and need:
            self.refused += 1
            if not self._full_logged:
                self._full_logged = True
                log.warning("file L3 at %s: no room for a page of %d bytes (%d of %d bytes "
                            "used, min_free %d): pages are not stored until there is",
                            self.root, need, self.used, self.capacity, self.min_free)
        elif fits and need:
            self._full_logged = False
        return fits

    def _disk_fits(self, need: int) -> bool:
        if not self.min_free:
            return True
        try:
            fs = os.statvfs(self.root)
        except OSError:
            return True  # the write itself will tell
        return fs.f_bavail * fs.f_frsize - need >= self.min_free

    # ------------------------------------------------------------ contract

    def exists(self, ns: str, pool: str, keys: Sequence[str]) -> list[bool]:
        have = self._keys.get((ns, pool))
        if not have or not safe_pool(pool):
            return [False] * len(keys)
        return [k in have for k in keys]

    def batch_put(self, ns, pool, keys, offsets, page_bytes):
        if not safe_pool(pool):
            return [False] * len(keys)
        with self._lock:
            have = self._keys.setdefault((ns, pool), {})
        todo = [i for i, key in enumerate(keys) if key not in have]
        ahead = self._hash_ahead(ns, pool, keys, offsets, page_bytes, todo)
        out = [True] * len(keys)
        try:
            for j, i in enumerate(todo):
                key = keys[i]
                if key in have:  # named twice in the batch: stored by the first
                    continue
                nbytes = file_bytes(key, page_bytes)
                with self._lock:
                    room = self._make_room(nbytes)
                digest = None if ahead is None else (lambda j=j: ahead.get(j))
                ok = room and self._put_one(ns, pool, key, offsets[i], page_bytes, digest)
                if ok:
                    with self._lock:
                        self._add(ns, pool, key, nbytes)
                out[i] = ok
        finally:
            if ahead is not None:
                ahead.cancel()
        return out

    def _hash_ahead(self, ns, pool, keys, offsets, page_bytes, todo) -> HashedBatch | None:
        """The pages' digests, computed on the helper thread while this one writes them; None
        where hashing each page as it is written is cheaper (one page, small pages)."""
        if len(todo) < 2 or page_bytes < HASH_AHEAD_MIN or not checksums_on():
            return None
        try:
            items = [(identity_seed(ns, pool, keys[i], page_bytes),
                      self.arena.view(offsets[i], page_bytes)) for i in todo]
        except (ValueError, ArenaError):  # a bad slot: each page fails on its own below
            return None
        return self._put_hash.start(items)

    def _put_one(self, ns: str, pool: str, key: str, offset: int, page_bytes: int,
                 digest_of: Callable[[], int | None] | None = None) -> bool:
        """Write one page file; ``digest_of`` gives the page's digest once its bytes are
        written (hashed ahead on the helper thread), else the page is hashed as written."""
        path = self._path(ns, pool, key)
        d = os.path.dirname(path)
        if d not in self._dirs:
            os.makedirs(d, exist_ok=True)
            self._dirs.add(d)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # the page first, hashed piece by piece as it goes; then the header with its
                # digest (the file is renamed into place only once both are written)
                header_len = header_bytes(key)
                view = self.arena.view(offset, page_bytes)
                if digest_of is None:
                    digest = write_hashed(fd, view, header_len,
                                          identity_seed(ns, pool, key, page_bytes))
                else:
                    write_plain(fd, view, header_len)
                    digest = digest_of()
                    if digest is None:
                        raise OSError("the page's hash did not finish")
                header = encode_header(key, page_bytes, digest)
                if os.pwrite(fd, header, 0) != header_len:
                    raise OSError(f"short header write ({header_len} bytes)")
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
        have = self._keys.get((ns, pool), {}) if safe_pool(pool) else {}
        ahead = None
        if len(keys) > 1 and page_bytes >= HASH_AHEAD_MIN and checksums_on():
            ahead = self._get_hash.start()
        if ahead is None:  # each page hashed piece by piece as it is read
            return [key in have and self._get_one(ns, pool, key, offset, page_bytes)
                    for key, offset in zip(keys, offsets)]
        out: list = []
        pending = []  # pages read whole, hashed on the helper: (item, key, fd, path, digest, j)
        try:
            for i, (key, offset) in enumerate(zip(keys, offsets)):
                got = key in have and self._get_one(ns, pool, key, offset, page_bytes, ahead)
                if isinstance(got, tuple):
                    pending.append((i, key, *got))
                    got = False
                out.append(got)
            for i, key, fd, path, digest, j in pending:  # a page is a hit once verified
                out[i] = self._settle(ns, pool, key, path, fd, True, ahead.get(j) == digest)
        finally:
            ahead.cancel()
            for _, _, fd, *_ in pending:
                os.close(fd)
        return out

    def _drop_stale(self, ns: str, pool: str, key: str, path: str, fd: int) -> None:
        """Remove a file that can never be this key's page (another page size: the namespace
        came back with another geometry; another key): a put skips keys the store has, so
        left in place it would make the key a miss for good."""
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return  # replaced meanwhile by a put of the right page
            os.unlink(path)
        except OSError:
            return
        with self._lock:
            self._forget(ns, pool, key)

    def _get_one(self, ns: str, pool: str, key: str, offset: int, page_bytes: int,
                 ahead: HashedBatch | None = None):
        """Load one page: True (verified) or False. With ``ahead``, a page read whole comes
        back unverified, as ``(fd, path, digest, j)``: its hash is ``ahead``'s item ``j``,
        and ``_settle`` decides (the fd stays open until then)."""
        path = self._path(ns, pool, key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            with self._lock:
                self._forget(ns, pool, key)
            return False
        except OSError as e:
            self._count_error("open", path, e)
            return False
        keep = False
        try:
            header_len, stored_key, stored_bytes, digest = decode_header(
                os.pread(fd, HEADER_MAX, 0))
            if stored_key != key or stored_bytes != page_bytes:
                log.warning("file L3: %s holds key %r of %d bytes, wanted %r of %d bytes: miss "
                            "(removed, so the page is stored again)", path, stored_key,
                            stored_bytes, key, page_bytes)
                self._drop_stale(ns, pool, key, path, fd)
                return False
            view = self.arena.view(offset, page_bytes)
            seed = identity_seed(ns, pool, key, page_bytes)
            if ahead is None:
                n, got = read_hashed(fd, view, header_len, seed)
            else:
                n, got = os.preadv(fd, [view], header_len), None
                if n == page_bytes:
                    keep = True
                    return fd, path, digest, ahead.add(seed, view)
            return self._settle(ns, pool, key, path, fd, n == page_bytes, got == digest)
        except OldFormat:
            self.integrity.unchecked_copies()
            self._drop_stale(ns, pool, key, path, fd)
            return False
        except (OSError, ValueError, UnicodeDecodeError) as e:
            self._count_error("read", path, e)
            return False
        finally:
            if not keep:
                os.close(fd)

    def _settle(self, ns: str, pool: str, key: str, path: str, fd: int, whole: bool,
                good: bool) -> bool:
        """A page read (``whole``: all its bytes) whose hash did (``good``) or did not match
        its header: a hit, or a counted failure whose file goes."""
        if not (whole and good):
            self.integrity.failed(ns, pool, key, "page bytes or identity changed" if whole
                                  else "cut short")
            self._drop_stale(ns, pool, key, path, fd)
            return False
        self.integrity.verified_loads(1)
        with self._lock:
            if (ns, pool, key) in self._lru:
                self._lru.move_to_end((ns, pool, key))
        try:
            os.utime(fd)  # the LRU order a restart finds
        except OSError:
            pass
        return True

    def take_evicted(self) -> list[tuple[str, str, str]] | None:
        with self._lock:
            out = None if self._evicted_lost else list(self._evicted)
            self._evicted.clear()
            self._evicted_lost = False
        return out

    def _count_error(self, what: str, path: str, err: Exception) -> None:
        with self._errors_lock:  # the writer and the reader count (not ``_lock``: held here)
            first = self.errors == 0
            self.errors += 1
        if first:
            log.error("file L3 %s failed for %s: %s (further errors are only counted)",
                      what, path, err)

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
            self._lru.clear()
            self.used = 0
        return n

    def clear_namespace(self, ns: str) -> int:
        """Delete the pages under ``<root>/<ns>/`` (every pool of namespace digest ``ns``);
        other namespaces' pages stay."""
        n = 0
        with self._lock:
            for pool in [p for (space, p) in self._keys if space == ns]:
                for key in list(self._keys[(ns, pool)]):
                    try:
                        os.unlink(self._path(ns, pool, key))
                        n += 1
                    except FileNotFoundError:
                        pass
                    self._forget(ns, pool, key)
        return n

    def close(self) -> None:
        self._put_hash.close()
        self._get_hash.close()

    def stats(self) -> dict:
        return {"pages": len(self._lru), "bytes": self.used, "capacity": self.capacity,
                "min_free": self.min_free, "evictions": self.evictions,
                "refused": self.refused, "errors": self.errors, **self.integrity.stats()}
