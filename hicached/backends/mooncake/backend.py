"""L3 on Mooncake Store: pages move zero-copy between the arena and the distributed store.

    open(arena)   setup() the client, register_buffer(the whole arena, the trailers) once
    batch_put     batch_put_from_multi_buffers(object keys, [arena slot, trailer] per page)
    batch_get     batch_get_into_multi_buffers(object keys, [arena slot, trailer] per page),
                  then every page checked against its trailer (``trailer.py``): a page that
                  does not verify is a miss, counted, and its object removed (force)
                                                                     (both: ``transfers.py``)
    exists        batch_is_exist(object keys)
    clear         remove_by_regex("^<key_prefix>/", force): our pages only, other users' stay
    clear_namespace  remove_by_regex("^<key_prefix>/(c1/)?<namespace digest>/", force): one
                  namespace's pages (every node's: the store is shared), other namespaces' stay

    object key = <key_prefix>/c1/<namespace digest>/<pool>/<key>
                 (a part that is not a plain token of [A-Za-z0-9_.=+-], <= 128 chars, becomes
                  "h-" + sha256(part): stable across daemons and restarts, never colliding
                  with a plain part because plain parts never start with "h-")

Return codes become per-key answers at this edge (``transfers.py``: the put, get and remove,
the object keys and what each code means).

Deadlines and degradation (``guard.py``): calls that touch no arena bytes (``batch_is_exist``
on the prober thread, ``health_check``) run on a helper thread and are abandoned past their
deadline (``exists_timeout_s``). Transfers (``batch_put_from`` / ``batch_get_into``) run on the
daemon's I/O worker thread and are never abandoned: Mooncake cannot cancel a transfer, and an
abandoned one could still write (get) or read (put) arena slots after the controller reused them.
The slots stay pinned until the call returns, which Mooncake's own RPC timeouts bound (~4 s dead
master, ~30 s hung one); meanwhile a waiting get is answered by the controller after
``get_wait_s`` and further jobs are refused by the full worker queue, so nobody hangs. A transfer
that took longer than ``timeout_s`` plus ``timeout_per_gib_s`` per GiB counts as a timeout. A
timeout or an unreachable-store code opens the breaker: logged once, counted, and calls answer
misses at once until a backoff passes; then one call probes (after a free ``health_check``), and
success closes the breaker.

Measured with 0.3.13.post1: against a killed master calls take ~4.3 s (-900), against a
SIGSTOPped one 30 s (-901). Once the master runs again at the same address the client reconnects
and remounts its segment by itself within ~1-2 s (puts answer -200 until then), so recovery
needs no new client; a client that never got set up (master down at start) is set up by a
background thread. Two calls hold the GIL, which no helper thread can bound: ``setup`` (~90 s
against a dead master, minutes against a hung one or a port that is no master) and ``close``
(7-16 s against a dead master, 1-2.5 s against a live one: it joins the client's heartbeat
thread). So before any ``setup`` in the daemon, the master's port is probed, then a child
process must get through ``setup`` and ``health_check`` within ``probe_timeout_s``; a client is
closed only when its master answers and no transfer runs in it, else left open for Mooncake's
own cleanup at process exit. A daemon never closes one while it serves (``slow_close``): a
detached backend stays open, idle, until the daemon exits or attaches it again with the same
options (no new ``setup`` then either).

A store that recovers from an outage may have lost its pages (a master restarted empty):
``take_evicted`` then answers None once, so the daemon stops counting on pages it knew stored,
and writes pages it holds again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from hicached.arena import Arena
from hicached.backends.base import L3Backend
from hicached.backends.guard import Breaker, CallTimeout, DeadlineCaller, StoreUnavailable
from hicached.backends.integrity import BadKeys, HashAhead, Integrity
from hicached.backends.mooncake.options import MooncakeOptions, redact
from hicached.backends.mooncake.probe import probe_master, probe_setup
from hicached.backends.mooncake.trailer import FORMAT_PART, Trailers
from hicached.backends.mooncake.transfers import (
    INVALID_PARAMS,
    UNREACHABLE,
    MooncakeTransfers,
    code_name,
    key_part,
)
from hicached.errors import BackendError, BackendUnavailable, ConfigError
from hicached.extras import install_hint

log = logging.getLogger(__name__)
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")


def _literal(text: str) -> str:
    """``text`` matched literally in the store's (ECMAScript) regular expressions."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def import_store_class() -> type:
    """``mooncake.store.MooncakeDistributedStore``, or a ConfigError naming the extra."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ConfigError(
            f"l3_backend 'mooncake' needs the Mooncake client: {install_hint('mooncake')} "
            "(mooncake-transfer-engine-non-cuda; on Debian also apt-get install libibverbs1 "
            f"librdmacm1 libnuma1). Import failed: {e}") from e
    return MooncakeDistributedStore


class MooncakeBackend(MooncakeTransfers, L3Backend):
    """Mooncake Store as L3. Thread-safe for the control loop plus the two I/O workers.

    ``MooncakeBackend(env=None, **options)``: options as in ``options.py``; ``env`` is
    where unset options are looked up: SGLang's ``MOONCAKE_*`` variables, which the daemon's
    config captures from the environment at its edge (``DaemonConfig.store_env``) and
    ``backend_options`` passes here. None: no environment.
    """

    name = "mooncake"
    slow_close = True  # ``close`` holds the GIL ~1 s against a live master (module docstring)
    clears_namespaces = True  # object keys carry the namespace digest

    def __init__(self, env: Mapping[str, str] | None = None, **options: object):
        self.opts = MooncakeOptions.resolve(options, env or {})
        self._store_cls = import_store_class()
        self.breaker = Breaker(f"Mooncake store at {redact(self.opts.master_server_address)}",
                               self.opts.backoff_s, self.opts.max_backoff_s)
        self._caller = DeadlineCaller("mooncake", self.opts.max_call_threads)
        self._store = None  # a set-up MooncakeDistributedStore, or None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connector: threading.Thread | None = None
        self._buffer = None  # the arena's mmap, kept mapped while Mooncake may touch it
        self._base = 0
        self._closed = False
        self._transfers = 0  # transfers running in the client (it is not closed under them)
        self._recoveries_told = 0  # breaker recoveries ``take_evicted`` has answered for
        self.trailers = Trailers()  # registered with the client beside the arena
        self.integrity = Integrity("mooncake")
        self.hash_put, self.hash_get = HashAhead(), HashAhead()  # a second core's share
        self.bad = BadKeys()  # keys whose bad copy could not be removed: stored again
        self.counters = {"puts": 0, "put_failures": 0, "gets": 0, "get_misses": 0,
                         "exists_calls": 0, "size_mismatches": 0,
                         "no_space": 0, "timeouts": 0, "errors": 0, "setups": 0,
                         "put_bytes": 0, "get_bytes": 0, "put_s": 0.0, "get_s": 0.0}

    # ------------------------------------------------------------ connection

    def open(self, arena: Arena) -> None:
        """Set up the client and register the arena; on failure start degraded and keep trying
        in the background (the daemon serves L2 meanwhile)."""
        super().open(arena)
        self._buffer = arena.buffer
        self._base = arena.tensor.data_ptr()
        log.info("mooncake L3: %s", self.opts.describe())
        o = self.opts
        loopback = ("localhost", "127.0.0.1", "::1")
        if (o.local_hostname in loopback and o.global_segment_size
                and not o.master_server_address.startswith(loopback)):
            log.warning("mooncake L3: local_hostname is %s but the master is remote: other nodes "
                        "cannot reach this node's segment; set local_hostname (or "
                        "MOONCAKE_LOCAL_HOSTNAME) to this node's address", o.local_hostname)
        try:
            self._connect()
        except StoreUnavailable as e:
            self.breaker.failed(f"setup: {e}")
            self._recoveries_told = -1  # connected later: the store may lack what L2 holds
            self._connector = threading.Thread(target=self._keep_connecting, daemon=True,
                                               name="hicached-mooncake-connect")
            self._connector.start()

    def _extra(self) -> dict[str, object]:
        o = self.opts
        extra: dict[str, object] = {}
        if o.tenant_id != "default":
            extra["tenant_id"] = o.tenant_id
        if o.enable_ssd_offload:
            extra["enable_ssd_offload"] = True
        if o.ssd_offload_path:
            extra["ssd_offload_path"] = o.ssd_offload_path
        return extra

    def _connect(self) -> None:
        """One setup attempt; raises StoreUnavailable (ConfigError for options Mooncake
        refuses). ``setup`` holds the GIL for its whole duration, so the master is probed
        first: its port, then a whole setup in a child process."""
        probe_master(self.opts)
        probe_setup(self.opts, self._extra())
        store = self._store_cls()
        o = self.opts
        rc = store.setup(o.local_hostname, o.metadata_server, o.global_segment_size,
                         o.local_buffer_size, o.protocol, o.device_name,
                         o.master_server_address, **self._extra())
        self.counters["setups"] += 1
        if rc == INVALID_PARAMS:
            raise ConfigError(f"mooncake L3: setup() refused the options ({code_name(rc)}): "
                              f"check global_segment_size, local_buffer_size, protocol and "
                              f"device_name ({o.describe()})")
        if rc != 0:
            # a client whose setup failed crashes on data calls: drop it without using it
            raise StoreUnavailable(f"setup() returned {code_name(rc)}")
        rc = store.register_buffer(self._base, self.arena.size_bytes)
        if rc != 0:
            raise StoreUnavailable(f"register_buffer of the {self.arena.size_bytes}-byte arena "
                                   f"returned {code_name(rc)}")
        rc = store.register_buffer(self.trailers.base, self.trailers.nbytes)
        if rc != 0:
            raise StoreUnavailable(f"register_buffer of the trailers returned {code_name(rc)}")
        with self._lock:
            if self._closed:
                return  # closed meanwhile: leave it (close() would hold the GIL again)
            self._store = store
        log.info("mooncake L3: connected, arena of %d bytes registered", self.arena.size_bytes)

    def _keep_connecting(self) -> None:
        delay = self.opts.backoff_s
        while not self._stop.wait(delay):
            try:
                self._connect()
            except StoreUnavailable as e:
                self.breaker.failed(f"setup: {e}")
                delay = min(delay * 2, self.opts.max_backoff_s)
                continue
            except ConfigError as e:  # retrying cannot help: say so, and stay degraded
                self.breaker.failed(f"setup: {e}")
                log.error("%s; not retrying (attach the backend again with other options)", e)
                return
            except Exception as e:  # noqa: BLE001 - a thread that dies would never retry
                self.breaker.failed(f"setup: {type(e).__name__}: {e}")
                delay = min(delay * 2, self.opts.max_backoff_s)
                continue
            self.breaker.ok()
            return

    # ------------------------------------------------------------ guarded calls

    def _admit(self, timeout_s: float):
        """The client to call now, or None: not connected, closed, or the breaker is open.
        A probe (the first call after a backoff) first asks the free ``health_check``."""
        store = self._store
        if store is None:
            self.breaker.refuse()
            return None
        if not self.breaker.admit():
            return None
        if self.breaker.degraded:
            try:
                health = self._caller.call(store.health_check, timeout_s=timeout_s)
            except StoreUnavailable as e:
                self._failed(e)
                return None
            except Exception as e:  # noqa: BLE001 - the probe must report back, or none follows
                self._failed(StoreUnavailable(f"health_check: {type(e).__name__}: {e}"))
                return None
            if health != 0:
                self.breaker.failed(f"health_check() = {health} (2: master unreachable)")
                return None
        return store

    def _call(self, fn: Callable, *args: object, timeout_s: float):
        """``fn(*args)`` within ``timeout_s``; None (after counting) if it failed or timed out."""
        try:
            return self._caller.call(fn, *args, timeout_s=timeout_s)
        except StoreUnavailable as e:
            self._failed(e)
        except Exception as e:  # noqa: BLE001 - a binding error is a failed call, not a crash
            self.counters["errors"] += 1
            self._failed(StoreUnavailable(f"{type(e).__name__}: {e}"))
        return None

    def _transfer(self, fn: Callable, *args: object, nbytes: int):
        """A transfer, run to completion on this (worker) thread: never abandoned, because its
        arena slots must not be reused while Mooncake may still touch them. (return codes or
        None if it failed, whether it was slower than its deadline: a timeout, which opens the
        breaker.) ``close`` leaves the client open while a transfer runs in it."""
        t = time.monotonic()
        with self._lock:
            self._transfers += 1
        try:
            rcs = fn(*args)
        except Exception as e:  # noqa: BLE001 - a binding error is a failed call, not a crash
            self.counters["errors"] += 1
            self._failed(StoreUnavailable(f"{type(e).__name__}: {e}"))
            return None, False
        finally:
            with self._lock:
                self._transfers -= 1
        took = time.monotonic() - t
        if took > self._deadline(nbytes):
            self._failed(CallTimeout(f"{getattr(fn, '__name__', 'transfer')} took {took:.1f} s"))
            return rcs, True
        return rcs, False

    def _failed(self, e: StoreUnavailable) -> None:
        if isinstance(e, CallTimeout):
            self.counters["timeouts"] += 1
        self.breaker.failed(str(e))

    def _settle(self, op: str, rcs: Sequence[int], timed_out: bool = False) -> None:
        """Open or close the breaker from a call's return codes (a call that timed out opened
        it already: its codes do not close it again)."""
        bad = [rc for rc in rcs if rc in UNREACHABLE]
        if bad:
            self.breaker.failed(f"{op}: {code_name(bad[0])} for {len(bad)} of {len(rcs)} keys")
        elif not timed_out:
            self.breaker.ok()

    def _deadline(self, nbytes: int) -> float:
        """Deadline of a transfer of ``nbytes``: ``timeout_s`` + ``timeout_per_gib_s`` per GiB."""
        return self.opts.timeout_s + nbytes / 2**30 * self.opts.timeout_per_gib_s

    # ------------------------------------------------------------ contract

    def exists(self, ns: str, pool: str, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        names = self._names(ns, pool, keys)
        store = self._admit(self.opts.exists_timeout_s)
        if store is None:
            return [False] * len(keys)
        self.counters["exists_calls"] += 1
        rcs = self._call(store.batch_is_exist, names, timeout_s=self.opts.exists_timeout_s)
        if rcs is None:
            return [False] * len(keys)
        self._settle("batch_is_exist", rcs)
        return [rc == 1 and (ns, pool, k) not in self.bad for rc, k in zip(rcs, keys)]

    def clear(self) -> int:
        """Remove every page under our key prefix (force: a page another node read in the last
        lease TTL, which includes any exists check, would otherwise survive). Returns how many;
        BackendUnavailable when the store could not be reached (unavailable, timed out: a 502
        over HTTP), BackendError when it refused."""
        return self._remove_matching(f"^{_literal(self.opts.key_prefix)}/")

    def clear_namespace(self, ns: str) -> int:
        """Remove the pages of namespace digest ``ns`` under our key prefix (with the objects
        of the format before trailers, ``<key_prefix>/<ns>/...``), as ``clear`` does; other
        namespaces' objects stay. Every node's copies go: the store is shared."""
        return self._remove_matching(f"^{_literal(self.opts.key_prefix)}/({FORMAT_PART}/)?"
                                     f"{_literal(key_part(ns))}/")

    def _remove_matching(self, regex: str) -> int:
        """``remove_by_regex(regex, force)``: how many objects went, or the error (``clear``)."""
        where = f"Mooncake store at {redact(self.opts.master_server_address)}"
        store = self._admit(self.opts.timeout_s)
        if store is None:
            why = self.breaker.last_error or "not set up"
            raise BackendUnavailable(f"{where} is unavailable ({why}): nothing was cleared")
        n = self._call(store.remove_by_regex, regex, True,
                       timeout_s=self.opts.timeout_s)  # (on the L3 writer thread)
        if n is None:
            raise BackendUnavailable(f"{where}: clear failed or timed out "
                                     f"({self.breaker.last_error}); some pages may remain")
        self._settle("remove_by_regex", [n])
        if n < 0:
            self._count_errors("remove_by_regex", [n] if n not in UNREACHABLE else [])
            error = BackendUnavailable if n in UNREACHABLE else BackendError
            raise error(f"{where}: clear answered {code_name(n)}; some pages may remain")
        return n

    def take_evicted(self) -> list[tuple[str, str, str]] | None:
        """Mooncake evicts on its own without telling ([]); after the store recovered from an
        outage (or was first reached late) None once: it may have lost every page."""
        seen = self.breaker.recoveries
        if seen == self._recoveries_told or (self._recoveries_told < 0 and self._store is None):
            return []
        self._recoveries_told = seen
        return None

    def stats(self) -> dict:
        return {
            "connected": self._store is not None,
            "master": redact(self.opts.master_server_address),
            **self.breaker.stats(),
            **self.counters,
            **self.integrity.stats(),
            "bad_keys": len(self.bad),
            "abandoned_calls": self._caller.abandoned_total,
            "abandoned_running": self._caller.abandoned_running,
        }

    def close(self) -> None:
        """Bounded and idempotent: wait up to ``close_timeout_s`` for running calls, then close
        the client only if its master answers (``close`` holds the GIL for ~16 s otherwise).
        A client left open, or with calls still running, is kept referenced with the arena
        mapping, so nothing is freed under a call; process exit reclaims both."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        self._stop.set()
        self.hash_put.close()
        self.hash_get.close()
        if store is None:
            self._caller.close()
            return
        idle = self._caller.wait_idle(self.opts.close_timeout_s)
        deadline = time.monotonic() + self.opts.close_timeout_s
        while self._transfers and time.monotonic() < deadline:
            time.sleep(0.01)
        idle = idle and not self._transfers  # never close under a running transfer
        health = None
        if idle:
            try:
                probe_master(self.opts)  # health_check lags a dead master by a few seconds
                health = self._caller.call(store.health_check, timeout_s=1.0)
            except StoreUnavailable as e:
                health = str(e)
        if idle and health == 0:
            try:
                self._caller.call(store.unregister_buffer, self._base, timeout_s=1.0)
                self._caller.call(store.unregister_buffer, self.trailers.base, timeout_s=1.0)
                self._caller.call(store.close, timeout_s=self.opts.close_timeout_s)
                self._buffer = None
            except StoreUnavailable as e:
                log.warning("mooncake L3: close did not finish: %s", e)
                _LEFT_OPEN.append((store, self._buffer, self.trailers))
        else:
            log.warning("mooncake L3: client left open at close (%s)",
                        "calls still running" if not idle else f"health: {health}")
            _LEFT_OPEN.append((store, self._buffer, self.trailers))
        self._caller.close()


# Clients not closed (master unreachable, or calls still running in them), with the arena
# mappings they may still write: referenced until the process exits.
_LEFT_OPEN: list[tuple[object, object, object]] = []
