"""The engine-side client: SGLang's v2 storage calls over the daemon's socket and shared arena.

    client = Client(namespace="qwen3-next|bf16|tp0/1")  # the default endpoint of `hicached serve`
    client.register_mem_host_pool_v2(kv_host_pool, PoolName.KV)
    client.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=idx, keys=keys)])

``Client`` is a facade: it checks its arguments, builds its objects once and hands each call to
the one that owns it. Who builds whom (every arrow a constructor argument)::

    Client ──> PoolTable (pools.py)      registered pools; a call's plan
           ──> PageRecall, SetAhead      where pages were seen; set-ahead slots (overlap.py)
           ──> Connection (connection.py: pools, recall, ahead)
                                         socket, session, arena, presence table, commit
                                         counters, pending releases (piggyback.py)
           ──> ExistsCalls (exists.py: conn)           batch_exists*
           ──> GetCalls   (get.py: conn, pools, recall)  batch_get*
           ──> SetCalls   (sets.py: conn, pools, recall, ahead)  batch_set*
           ──> WaitCalls  (waits.py: conn)             wait_committed, wait_stored
           ──> ClientAdmin (admin.py: conn, recall)    stats, flush, ping, L3 attach/detach

Control messages go through the connection's one DEALER socket (guarded by a lock, so any
thread may call); page bytes never do: the calls copy them between host pools and arena slots
themselves, outside the lock, so several threads copy at once (except the copies that overlap a
request in flight, ``overlap.py``: speculative gets and set-ahead slots). Every round trip has a
deadline (``timeout_s``): a daemon that is gone or stuck raises ``DaemonUnavailable``, never
hangs. A daemon that restarted is re-joined transparently (new handshake, pools registered
again).

Exists needs no message at all when the daemon's shared presence table can answer alone
(``exists.py``, ``table_exists.py``): L2 presence is read from shared memory. Nor does a get of
pages this client saw before (``get.py``, ``leaseless.py``): they are copied straight from their
slots, checked by the slot tags the daemon publishes in that table.

Slots are only touched while the client is sure it still owns them: a reservation or lease
expires ``ttl`` after the daemon granted it, so copies that would end later than half the TTL
after the request was sent are abandoned (set: aborted; get: reported as misses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import torch

from hicached.arena import Arena
from hicached.client.admin import ClientAdmin
from hicached.client.args import check_client_args
from hicached.client.connection import Connection
from hicached.client.exists import KV, ExistsCalls
from hicached.client.get import GetCalls
from hicached.client.hostpool import make_page_io
from hicached.client.overlap import PageRecall, SetAhead
from hicached.client.pools import PoolTable
from hicached.client.sets import SetCalls
from hicached.client.waits import WaitCalls
from hicached.kernels.pageio import PageIO
from hicached.settings import process_default_endpoint
from hicached.types import PoolTransferResult, pool_value

if TYPE_CHECKING:
    from hicached.client.prefetch import PrefetchOperation, StopPolicy

# Pages at least this large are copied while a request travels (get: ``PageRecall``; set:
# ``SetAhead``): below it, the bookkeeping per key costs more than the copy it would overlap.
OVERLAP_MIN_PAGE_BYTES = 64 * 1024


class Client:
    """A connection to one hicached daemon, in one namespace. Thread-safe; a context manager.

    ``endpoint``: where the daemon listens (``ipc:///path`` or ``tcp://host:port``). Left out
    (None), it is the endpoint ``hicached serve`` listens on by default for this process's user,
    ``settings.process_default_endpoint`` (the process environment, read once):
    ``ipc://$XDG_RUNTIME_DIR/hicached/hicached.sock``, else ``ipc:///tmp/hicached-$UID/...``.
    A client of a daemon run by another user, or by the systemd unit, must name its endpoint.
    ``namespace`` is required: ``Client(namespace=...)`` or ``Client(endpoint, namespace)``.

    Owns the objects it builds (module docstring) and nothing else: each public call is one
    call of the object that owns it."""

    def __init__(self, endpoint: str | None = None, namespace: str | None = None, *,
                 timeout_s: float = 5.0, client_name: str = "", spin_s: float = 0.002,
                 token: str = "", remember_pages: int = 65536, set_ahead_bytes: int = 64 << 20,
                 release_delay_s: float = 0.05, shared_exists: bool = True,
                 shared_gets: bool = True):
        default = endpoint is None  # (named in the error when nobody listens)
        if endpoint is None:  # an entry point of engine code: the environment is read here
            endpoint = process_default_endpoint()
        check_client_args(endpoint, namespace, timeout_s, client_name, spin_s, token,
                          remember_pages, set_ahead_bytes, release_delay_s, shared_exists,
                          shared_gets)
        self._pools = PoolTable()
        # (pool, key) -> (offset, tag) of pages this client wrote or read (see GetCalls); at
        # most ``remember_pages`` entries (0: never copy speculatively). Only for large pages.
        self._recall = PageRecall(remember_pages, OVERLAP_MIN_PAGE_BYTES)
        # set-ahead slots (overlap.py): per pool at most ``set_ahead_bytes`` (0: off)
        self._ahead = SetAhead(set_ahead_bytes, OVERLAP_MIN_PAGE_BYTES)
        self._conn = Connection(
            endpoint, namespace, timeout_s=timeout_s, client_name=client_name, spin_s=spin_s,
            token=token or "", release_delay_s=release_delay_s,
            map_table=shared_exists or shared_gets, default_endpoint=default,
            pools=self._pools, recall=self._recall, ahead=self._ahead)
        self._exists = ExistsCalls(self._conn, shared_exists)
        self._gets = GetCalls(self._conn, self._pools, self._recall, shared_gets)
        self._sets = SetCalls(self._conn, self._pools, self._recall, self._ahead)
        self._waits = WaitCalls(self._conn)
        self._admin = ClientAdmin(self._conn, self._recall)

    # ------------------------------------------------------------ what the connection knows

    @property
    def endpoint(self) -> str:
        """Where the daemon listens."""
        return self._conn.endpoint

    @property
    def namespace(self) -> str:
        """This client's namespace."""
        return self._conn.namespace

    @property
    def timeout_s(self) -> float:
        """The deadline of a round trip (seconds)."""
        return self._conn.timeout_s

    @property
    def spin_s(self) -> float:
        """How long a call busy-waits for its answer before sleeping in poll (seconds)."""
        return self._conn.spin_s

    @property
    def client_name(self) -> str:
        """The name this client gave the daemon (its logs and admin listings)."""
        return self._conn.client_name

    @property
    def session(self) -> int:
        """The daemon's id of this client's session (a new one after a daemon restart)."""
        return self._conn.session

    @property
    def arena(self) -> Arena | None:
        """The daemon's arena as this client maps it (a new mapping after a daemon restart)."""
        return self._conn.arena

    @property
    def reservation_ttl_s(self) -> float:
        """How long the daemon keeps a set's reservation (its ``Welcome``)."""
        return self._conn.reservation_ttl_s

    @property
    def lease_ttl_s(self) -> float:
        """How long the daemon keeps a get's lease (its ``Welcome``)."""
        return self._conn.lease_ttl_s

    @property
    def flushes_namespaces(self) -> bool:
        """Whether the daemon can flush one namespace (``flush(namespace=...)``)."""
        return self._conn.flushes_namespaces

    # ------------------------------------------------------------ pools

    def register_mem_host_pool_v2(self, host_pool: Any, pool_name: Any, event_hash: str = "",
                                  tokens_per_page: int = 0) -> None:
        """Register the host pool of ``pool_name`` (any SGLang-shaped pool or a ``HostPool``).
        ``event_hash``: its keys are the engine's block hashes, for KV events (docs/kv-events.md:
        "sglang_int64", "vllm_bytes", "vllm_int64"; "": no events), of ``tokens_per_page``."""
        name = pool_value(pool_name)
        io = make_page_io(host_pool)
        events = (event_hash, tokens_per_page)
        self._conn.register_pool(name, io, events)
        self._pools.add(name, io, events)

    def register_mem_pool_host(self, host_pool: Any) -> None:
        """v1: register the KV host pool."""
        self.register_mem_host_pool_v2(host_pool, KV)

    def pool_io(self, pool_name: Any) -> PageIO:
        """The page path of the registered pool ``pool_name`` (its ``page_size``,
        ``page_bytes``); ``UnknownPool`` naming the registered ones if it is not."""
        return self._pools.io(pool_value(pool_name))

    # ------------------------------------------------------------ exists (exists.py)

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """Number of leading keys whose KV page is stored (L2 or L3)."""
        return self._exists.batch_exists(keys, extra_info)

    def batch_exists_v2(self, keys: Sequence[str], pool_transfers: Sequence[Any] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """Largest prefix every pool can restore (ARCHITECTURE.md hit semantics)."""
        return self._exists.batch_exists_v2(keys, pool_transfers, extra_info)

    # ------------------------------------------------------------ get (get.py)

    def batch_get_v2(self, transfers: Sequence[Any], extra_info: Any = None
                     ) -> dict[str, list[bool]]:
        """Load every pool's pages into their host pools; one bool per key
        (``GetCalls._load_now``: how)."""
        return self._gets.batch_get_v2(transfers, extra_info)

    def batch_get_pages(self, pool_name: Any, keys: Sequence[str],
                        pages: Sequence[torch.Tensor]) -> list[bool]:
        """Fill contiguous flat page tensors (SGLang's generic v0 path): ``pages[i]`` gets the
        bytes of ``keys[i]`` of pool ``pool_name``; one bool per key (False: left untouched)."""
        return self._gets.batch_get_pages(pool_name, keys, pages)

    def batch_get_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """v1: load KV pages into the registered KV host pool."""
        return self._gets.batch_get_v1(keys, host_indices, extra_info)

    # ------------------------------------------------------------ set (sets.py)

    def batch_set_v2(self, transfers: Sequence[Any], extra_info: Any = None, *,
                     parent: str | None = None, depth: int | None = None,
                     anchor_pool: Any = None) -> dict[str, list[bool]]:
        """Store every pool's pages of the call atomically (reserve -> copy -> commit); per
        key True when the page was copied or is already there. ``parent``, ``depth``,
        ``anchor_pool``: where the pages hang (``SetCalls.batch_set_v2``)."""
        return self._sets.batch_set_v2(transfers, extra_info, parent=parent, depth=depth,
                                       anchor_pool=anchor_pool)

    def batch_set_pages(self, pool_name: Any, keys: Sequence[str],
                        pages: Sequence[torch.Tensor], *, parent: str | None = None,
                        depth: int | None = None) -> list[bool]:
        """Store flat page tensors (SGLang's generic v0 path): ``pages[i]`` under ``keys[i]``
        in the registered pool ``pool_name`` (whose page size they must have). ``parent`` and
        ``depth``: as ``batch_set_v2``."""
        return self._sets.batch_set_pages(pool_name, keys, pages, parent=parent, depth=depth)

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None, *,
                     parent: str | None = None, depth: int | None = None) -> list[bool]:
        """v1: store KV pages from the registered KV host pool (``parent`` and ``depth``: as
        ``batch_set_v2``)."""
        return self._sets.batch_set_v1(keys, host_indices, extra_info, parent=parent,
                                       depth=depth)

    # ------------------------------------------------------------ waits (waits.py)

    def wait_committed(self, timeout_s: float | None = None) -> None:
        """Block until the daemon has read every commit this client sent: their pages are
        visible to every client of the daemon (``WaitCalls.wait_committed``)."""
        self._waits.wait_committed(timeout_s)

    def wait_stored(self, transfers: Sequence[Any], timeout_s: float | None = None) -> None:
        """Block until the named pages are stored in the daemon's L3, visible to every daemon
        sharing that store (``WaitCalls.wait_stored``: what it raises)."""
        self._waits.wait_stored(transfers, timeout_s)

    # ------------------------------------------------------------ admin (admin.py)

    def stats(self) -> dict:
        """The daemon's statistics (``hicached stats``)."""
        return self._admin.stats()

    def flush(self, tier: str = "l2", timeout_s: float = 600.0, *,
              namespace: str | None = None) -> None:
        """Drop unpinned L2 pages (``l2``), every L3 page (``l3``) or both (``all``), of
        ``namespace`` or (None) the whole node; waits for the end (``ClientAdmin.flush``)."""
        self._admin.flush(tier, timeout_s, namespace=namespace)

    def ping(self) -> None:
        """One round trip to the daemon."""
        self._admin.ping()

    def attach_backend(self, backend: str, options: dict | None = None, *,
                       write_policy: str | None = None, prefetch: bool | None = None,
                       timeout_s: float = 120.0) -> dict:
        """Attach an L3 backend to the daemon at runtime; returns the tier status. Attaching
        the attached backend only updates the policies; another one raises BackendConflict."""
        return self._admin.attach_backend(backend, options, write_policy=write_policy,
                                          prefetch=prefetch, timeout_s=timeout_s)

    def detach_backend(self) -> dict:
        """Detach the daemon's L3 backend (idempotent); returns the tier status."""
        return self._admin.detach_backend()

    def backend_status(self) -> dict:
        """The daemon's L3 tier status."""
        return self._admin.backend_status()

    # ------------------------------------------------------------ prefetch (prefetch.py)

    def prefetch(self, keys: Sequence[str], host_indices: Any, sidecars: Sequence[Any] = (), *,
                 policy: str | StopPolicy = "best_effort", chunk_pages: int = 128,
                 on_progress: Any = None) -> PrefetchOperation:
        """Start exists + chunked get of ``keys`` into the registered KV pool at
        ``host_indices`` (and the ``sidecars`` transfers' pools) on a background thread.

        ``policy``: when the caller may stop waiting (``hicached.client.prefetch``: "best_effort",
        "wait_complete", "timeout", or a ``StopPolicy``). Returns the running operation."""
        from hicached.client.prefetch import PrefetchOperation, make_policy

        op = PrefetchOperation(self, keys, host_indices, sidecars, make_policy(policy),
                               chunk_pages=chunk_pages, on_progress=on_progress)
        op.start()
        return op

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """End the session (its leases and reservations are freed). Idempotent.

        Sets and gets other threads have under way end first (their commits go out, their
        copies finish), for at most half a TTL (what such a call may take before it gives up
        on its own); new ones raise ``DaemonUnavailable``."""
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
