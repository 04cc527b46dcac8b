"""How pages move between the arena and Mooncake, and what its answers mean: the object keys,
the return codes, and the batched put / get / remove of ``MooncakeBackend`` (a mixin: the
connection, the breaker and the guarded calls it uses are ``backend.py``'s).

    put     per ``SLOTS`` pages: seal each page's trailer (``trailer.py``), then one
            ``batch_put_from_multi_buffers`` of [arena slot, trailer] per page
    get     per ``SLOTS`` pages: one ``batch_get_into_multi_buffers`` into [arena slot, trailer],
            then every page that came whole checked against its trailer, on the reader
            thread, before the batch answers: a page that does not verify is a miss, counted,
            and its object removed (force)
    remove  ``batch_remove`` (force) of the objects that did not verify; a key whose object
            stays is kept in ``bad`` (written again, never counted on)

Return codes become per-key answers here: a put answering 0 (or -705, already there: Mooncake
keeps the first value, unless that is a bad copy still in ``bad``) is stored; a get answering
page_bytes + the trailer whose page verifies is a hit; -704 (not found) is a miss; another byte
count, -600 (the stored object is larger than the slot) or -800 (smaller: the two buffers of a
get are not filled) are misses counted as ``size_mismatches``; -900 / -901 and the
unavailable-status codes (``UNREACHABLE``) mean the store is unreachable: the breaker opens.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Sequence

from hicached.backends.integrity import digests, identity_seed
from hicached.backends.mooncake.trailer import FORMAT_PART, SLOTS, TRAILER_BYTES
from hicached.errors import ArenaError

log = logging.getLogger("hicached.backends.mooncake.backend")

# Mooncake ErrorCode values (mooncake-store/include/types.h); Python gets plain ints.
NO_AVAILABLE_HANDLE = -200  # no segment space (also right after a master restart: not remounted)
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
UNREACHABLE = {RPC_FAIL, RPC_TIMEOUT, -1010, -1011}  # + UNAVAILABLE_IN_CURRENT_STATUS / _MODE
CODE_NAMES = {-1: "INTERNAL_ERROR", NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
              INVALID_PARAMS: "INVALID_PARAMS", OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
              OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
              -707: "LEASE_EXPIRED", TRANSFER_FAIL: "TRANSFER_FAIL", RPC_FAIL: "RPC_FAIL",
              RPC_TIMEOUT: "RPC_TIMEOUT", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
              -1011: "UNAVAILABLE_IN_CURRENT_MODE"}

_PLAIN = re.compile(r"^[A-Za-z0-9_.=+-]{1,128}$")


def key_part(part: str) -> str:
    """A key component as it appears in an object key: itself when plain, else its digest."""
    if _PLAIN.match(part) and not part.startswith("h-"):
        return part
    return "h-" + hashlib.sha256(part.encode()).hexdigest()


def object_key(prefix: str, ns: str, pool: str, key: str) -> str:
    """The Mooncake key of page ``key`` of ``pool`` in namespace digest ``ns``."""
    return f"{prefix}/{key_part(ns)}/{key_part(pool)}/{key_part(key)}"


def code_name(rc: int) -> str:
    return f"{rc} {CODE_NAMES.get(rc, '')}".strip()


class MooncakeTransfers:
    """The put, get and remove of ``MooncakeBackend`` (its ``opts``, ``arena``, ``trailers``,
    ``integrity``, ``hash_put`` / ``hash_get``, ``bad``, ``counters``, ``breaker`` and guarded
    calls ``_admit`` / ``_transfer`` / ``_settle`` / ``_call``)."""

    def _names(self, ns: str, pool: str, keys: Sequence[str]) -> list[str]:
        prefix = f"{self.opts.key_prefix}/{FORMAT_PART}"  # objects with a trailer (trailer.py)
        return [object_key(prefix, ns, pool, k) for k in keys]

    def _ptrs(self, offsets: Sequence[int], page_bytes: int) -> list[int]:
        """Absolute addresses of arena slots; a slot outside the arena is a bug upstream, and
        a wrong pointer handed to C would corrupt memory, so it is checked here."""
        size = self.arena.size_bytes
        for off in offsets:
            if off < 0 or off + page_bytes > size:
                raise ArenaError(f"slot [{off}, {off + page_bytes}) outside the arena of "
                                 f"{size} bytes")
        return [self._base + off for off in offsets]

    def _batch(self, method: str, kind: str, names: list[str], ptrs: list[int],
               trailers: list[int], page_bytes: int) -> list[int] | None:
        """One transfer (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``)
        of arena slots and their trailers: its return codes, or None when the store is
        unavailable or the call failed (counted as failed puts / missed gets of ``kind``)."""
        failed = "put_failures" if kind == "put" else "get_misses"
        store = self._admit(self.opts.timeout_s)
        rcs, timed_out = None, False
        if store is not None:
            t = time.perf_counter()
            rcs, timed_out = self._transfer(getattr(store, method), names,
                                            [[p, tp] for p, tp in zip(ptrs, trailers)],
                                            [[page_bytes, TRAILER_BYTES]] * len(names),
                                            nbytes=len(names) * page_bytes)
            self.counters[f"{kind}_s"] += time.perf_counter() - t
        if rcs is None:
            self.counters[failed] += len(names)
            return None
        self._settle(method, rcs, timed_out)
        return rcs

    def batch_put(self, ns, pool, keys, offsets, page_bytes):
        out: list[bool] = []
        for at in range(0, len(keys), SLOTS):
            out += self._put(ns, pool, keys[at:at + SLOTS], offsets[at:at + SLOTS], page_bytes)
        return out

    def _put(self, ns, pool, keys, offsets, page_bytes) -> list[bool]:
        if not keys:
            return []
        ptrs, names = self._ptrs(offsets, page_bytes), self._names(ns, pool, keys)
        again = [(n, (ns, pool, k)) for n, k in zip(names, keys) if (ns, pool, k) in self.bad]
        if again:  # their bad copies are still there: a put would keep the first value
            self._remove([n for n, _ in again], keys=[key for _, key in again])
        sums = digests(self.hash_put, [(identity_seed(ns, pool, k, page_bytes),
                                         self.arena.view(off, page_bytes))
                                        for k, off in zip(keys, offsets)])
        if None in sums:  # (a hash that failed: no page of this batch is put half-sealed)
            return [False] * len(keys)
        with self.trailers.locks["put"]:
            for i, digest in enumerate(sums):
                self.trailers.seal("put", i, page_bytes, digest)
            rcs = self._batch("batch_put_from_multi_buffers", "put", names, ptrs,
                              self.trailers.ptrs("put", len(keys)), page_bytes)
        if rcs is None:
            return [False] * len(keys)
        # already stored: a success, unless what is stored is a bad copy that could not be
        # removed (still in ``bad``): then the page is not in L3, and stays a failed put
        out = [rc == 0 or (rc == OBJECT_ALREADY_EXISTS and (ns, pool, k) not in self.bad)
               for rc, k in zip(rcs, keys)]
        for key, ok in zip(keys, out):
            if ok:
                self.bad.discard(ns, pool, key)
        self.counters["puts"] += sum(out)
        self.counters["put_bytes"] += sum(out) * page_bytes
        self.counters["put_failures"] += len(out) - sum(out)
        self.counters["no_space"] += sum(rc == NO_AVAILABLE_HANDLE for rc in rcs)
        others = [rc for rc in rcs if rc < 0 and rc not in UNREACHABLE
                  and rc not in (OBJECT_ALREADY_EXISTS, NO_AVAILABLE_HANDLE)]
        self._count_errors("batch_put_from_multi_buffers", others)
        return out

    def batch_get(self, ns, pool, keys, offsets, page_bytes):
        out: list[bool] = []
        for at in range(0, len(keys), SLOTS):
            out += self._get(ns, pool, keys[at:at + SLOTS], offsets[at:at + SLOTS], page_bytes)
        return out

    def _get(self, ns, pool, keys, offsets, page_bytes) -> list[bool]:
        if not keys:
            return []
        ptrs, names = self._ptrs(offsets, page_bytes), self._names(ns, pool, keys)
        whole = page_bytes + TRAILER_BYTES
        bad: list[str] = []
        with self.trailers.locks["get"]:
            self.trailers.clear("get", len(keys))
            rcs = self._batch("batch_get_into_multi_buffers", "get", names, ptrs,
                              self.trailers.ptrs("get", len(keys)), page_bytes)
            if rcs is None:
                return [False] * len(keys)
            # checked here, before L2 sees them: hashed on this reader thread and a helper
            got = [i for i, rc in enumerate(rcs) if rc == whole]
            sums = dict(zip(got, digests(self.hash_get, [
                (identity_seed(ns, pool, keys[i], page_bytes),
                 self.arena.view(offsets[i], page_bytes)) for i in got])))
            out = []
            for i, (rc, key) in enumerate(zip(rcs, keys)):
                why = None
                if rc == whole:
                    why = self.trailers.check("get", i, page_bytes, sums[i])
                    if why is not None:
                        self.integrity.failed(ns, pool, key, why)
                        bad.append(names[i])
                        self.bad.add(ns, pool, key)  # until the copy is removed or replaced
                out.append(rc == whole and why is None)
            self.integrity.verified_loads(sum(out))
        if bad:
            self._remove(bad, keys=[(ns, pool, k) for k, n in zip(keys, names) if n in bad])
        # another size: larger answers -600, smaller -800 (a get into two buffers that the
        # object does not fill fails its transfer): both misses, counted, never errors
        mismatched = sum((rc >= 0 and rc != whole) or rc in (INVALID_PARAMS, TRANSFER_FAIL)
                         for rc in rcs)
        if mismatched:
            self.counters["size_mismatches"] += mismatched
            log.debug("mooncake L3: %d pages of pool %s stored with another size than %d bytes",
                      mismatched, pool, page_bytes)
        self.counters["gets"] += sum(out)
        self.counters["get_bytes"] += sum(out) * page_bytes
        self.counters["get_misses"] += len(out) - sum(out)
        self._count_errors("batch_get_into_multi_buffers",
                           [rc for rc in rcs if rc < 0 and rc not in UNREACHABLE
                            and rc not in (OBJECT_NOT_FOUND, INVALID_PARAMS, TRANSFER_FAIL)])
        return out

    def _remove(self, names: list[str], keys: list[tuple[str, str, str]] | None = None) -> None:
        """Remove objects whose copies did not verify (force: a reader's lease does not keep a
        bad copy); the keys of those removed are good to write again as usual."""
        rcs = self._call(self._store_remove, names, timeout_s=self.opts.exists_timeout_s)
        if rcs is None or keys is None:
            return
        for rc, key in zip(rcs, keys):
            if rc in (0, OBJECT_NOT_FOUND):
                self.bad.discard(*key)  # gone: exists says missing, a put stores it again
        self.counters["bad_copies_removed"] = self.counters.get("bad_copies_removed", 0) + sum(
            rc == 0 for rc in rcs)

    def _store_remove(self, names: list[str]) -> list[int]:
        store = self._store
        if store is None:
            return [-1] * len(names)
        return store.batch_remove(names, True)

    def _count_errors(self, op: str, rcs: list[int]) -> None:
        if not rcs:
            return
        if self.counters["errors"] == 0:
            log.error("mooncake L3: %s answered %s (further errors are only counted)",
                      op, sorted({code_name(rc) for rc in rcs}))
        self.counters["errors"] += len(rcs)
        self.breaker.last_error = f"{op}: {code_name(rcs[0])}"
