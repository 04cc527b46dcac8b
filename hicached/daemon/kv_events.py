"""KV events for routers: which engine blocks this node's L2 and L3 hold, in vLLM's format.

KV-aware routers (SGLang's, vLLM's and Dynamo's KV routers, Mooncake's Conductor) consume
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` batches over a ZeroMQ PUB socket, the
format of vLLM's ``vllm/distributed/kv_events.py`` (docs/kv-events.md). Two halves:

    KVEvents      control loop   collects events as pages become visible or leave a tier
                                 (``PageIndex.commit_many`` / ``_unpublish``, the L3 tier's
                                 finished writes and the removals its backend reports), and
                                 once per turn of the loop (``send``) hands one batch per
                                 namespace to the publisher: a bounded queue, never a wait
    ZmqPublisher  its thread     owns the PUB and replay sockets: numbers the batches, sends
                                 them, keeps the last ``REPLAY_BATCHES`` for the replay socket

Only pools whose client declared an event hash (``RegisterPool.event_hash``) produce events: the
daemon cannot turn its keys into the engine's block hashes alone. Off (no ``kv_events_endpoint``)
the daemon holds a ``NullKVEvents`` and the index no hook.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import msgspec
import zmq

from hicached.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

MEDIUM_L2 = "CPU_PINNED"
L3_MEDIUM = {"file": "DISK", "hf3fs": "DISK", "mooncake": "EXTERNAL"}  # others: EXTERNAL
QUEUE_BATCHES = 4096  # batches waiting for the publisher thread; past it they are dropped
REPLAY_BATCHES = 10_000  # recent batches the replay socket serves (vLLM's buffer_steps)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


def l3_medium(backend: str) -> str:
    """The medium of an L3 backend's blocks in events (one not in ``L3_MEDIUM``: EXTERNAL)."""
    return L3_MEDIUM.get(backend, "EXTERNAL")


# ---------------------------------------------------------------- vLLM's wire format


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a map tagged by its class name in ``type`` (as vLLM's)."""


class BlockStored(KVCacheEvent):
    """Blocks of one chain now in ``medium``: ``parent_block_hash`` is the block before the
    first one (None: a root, or a parent this tier does not hold). ``token_ids`` is always
    empty: clients send no tokens to the daemon."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch`` with one trailing element of hicached's: the namespace (a
    trailing array element, which vLLM's decoder ignores)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
    namespace: str = ""


# ---------------------------------------------------------------- key -> block hash


def _sglang_int64(key: str) -> int:
    """SGLang's ``hash_str_to_int64``: the first 16 hex digits as a signed int64."""
    v = int(key[:16], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


def _vllm_int64(key: str) -> int:
    """vLLM's int block hash (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): the hash's low 64 bits."""
    return int.from_bytes(bytes.fromhex(key)[-8:], "big")


EVENT_HASHES: dict[str, Callable[[str], int | bytes]] = {
    "sglang_int64": _sglang_int64,
    "vllm_bytes": bytes.fromhex,
    "vllm_int64": _vllm_int64,
}


def check_event_hash(name: str, tokens_per_page: int) -> None:
    """ProtocolError unless ``name`` is "" (no events) or one of ``EVENT_HASHES``."""
    if name and name not in EVENT_HASHES:
        raise ProtocolError(f"event_hash {name!r} unknown; valid: \"\" (no events), "
                            f"{', '.join(EVENT_HASHES)}")
    if tokens_per_page < 0:
        raise ProtocolError(f"tokens_per_page must be >= 0, got {tokens_per_page}")


# ---------------------------------------------------------------- publisher


class NullPublisher:
    """No endpoint: nothing is sent."""

    published = dropped = 0

    def publish(self, namespace: str, batch: KVEventBatch, n_events: int) -> bool:
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        pass


class ZmqPublisher:
    """A thread owning a PUB socket at ``endpoint`` and, when given, a ROUTER replay socket.

    PUB frames: (namespace as UTF-8 topic, seq as 8 bytes big-endian, msgpack batch); ``seq``
    counts the batches of this publisher from 0, across namespaces. Replay: a DEALER/REQ sends
    (b"", start seq); it gets (b"", seq, batch) for each buffered batch from ``start`` on, then
    (b"", -1, b""). ``publish`` never blocks: a full queue drops the batch (``dropped`` counts
    its events; ``published`` counts those sent)."""

    def __init__(self, endpoint: str, replay_endpoint: str = "",
                 queue_batches: int = QUEUE_BATCHES, replay_batches: int = REPLAY_BATCHES):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.published = self.dropped = 0
        self._queue: queue.Queue = queue.Queue(queue_batches)
        self._replay_batches = replay_batches
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hicached-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def publish(self, namespace: str, batch: KVEventBatch, n_events: int) -> bool:
        try:
            self._queue.put_nowait((namespace.encode(), batch, n_events))
            return True
        except queue.Full:
            self.dropped += n_events
            return False

    def _run(self) -> None:
        ctx = zmq.Context()
        socks = []
        try:
            pub = ctx.socket(zmq.PUB)
            socks.append(pub)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            replay = None
            if self.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                socks.append(replay)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = ConfigError(f"kv_events_endpoint / kv_events_replay_endpoint "
                                      f"({self.endpoint!r}, {self.replay_endpoint!r}): {e}")
            for s in socks:
                s.close(linger=0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        except Exception:
            log.exception("kv events publisher failed; no more events are sent")
        finally:
            for s in socks:
                s.close(linger=0)
            ctx.term()
            for ep in (self.endpoint, self.replay_endpoint):
                if ep.startswith("ipc://"):
                    try:
                        os.unlink(ep[len("ipc://"):])
                    except FileNotFoundError:
                        pass

    def _serve(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        enc = msgspec.msgpack.Encoder()
        buffer: collections.deque = collections.deque(maxlen=self._replay_batches)
        seq = 0
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                topic, batch, n = self._queue.get(timeout=0.02)
            except queue.Empty:
                pass
            else:
                payload = enc.encode(batch)
                buffer.append((seq, payload))
                self.published += n  # (before a subscriber can see it: the tests count)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                seq += 1
            while replay is not None and replay.poll(0):
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    log.warning("kv events replay: a request of %d frames ignored", len(frames))
                    continue
                client, start = frames[0], int.from_bytes(frames[2], "big")
                for s, payload in buffer:
                    if s >= start:
                        replay.send_multipart((client, b"", s.to_bytes(8, "big"), payload))
                replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), then close the sockets."""
        self._stop.set()
        self._thread.join(timeout_s)


# ---------------------------------------------------------------- control-loop side


class EventPool(NamedTuple):
    """A pool whose pages are blocks: its namespace's name, key -> hash, tokens per page."""

    namespace: str
    encode: Callable[[str], int | bytes]
    block_size: int


class NullKVEvents:
    """Events off: every hook does nothing, and no table has events (``tids``)."""

    publisher = NullPublisher()
    tids: Mapping[int, EventPool] = MappingProxyType({})

    def declare(self, tid: int, table, namespace: str, event_hash: str, tokens: int) -> None:
        pass

    def stored(self, entries: Sequence[Any], chain: Callable[[int, str], Any],
               medium: str = MEDIUM_L2) -> None:
        pass

    def removed_l2(self, pool: EventPool, key: str) -> None:
        pass

    def removed(self, table, key: str, medium: str) -> None:
        pass

    def cleared(self, keys_of: Callable[[Any], Any], medium: str, ns: str | None = None
                ) -> None:
        pass

    def all_cleared(self, ns: str | None = None) -> None:
        pass

    def send(self) -> None:
        pass

    def close(self) -> None:
        pass


class KVEvents(NullKVEvents):
    """Collects the events of a turn of the control loop, per namespace; ``send`` publishes
    them. Only the control loop calls it. Owns the tables whose pages are blocks: ``pools``
    by table, ``tids`` by the index's table id (the index reads ``tids`` to know which pages
    it must tell of; it is built with this object and never writes it)."""

    def __init__(self, publisher: ZmqPublisher, clock: Callable[[], float] = time.time):
        self.publisher = publisher
        self.clock = clock
        self.pools: dict[Any, EventPool] = {}  # TableId -> its events
        self.tids: dict[int, EventPool] = {}  # the index's table id -> its events
        self.pending: dict[str, list[KVCacheEvent]] = {}  # namespace name -> events
        self.unencodable = 0  # keys not in the declared hash's form (no event)

    def declare(self, tid: int, table, namespace: str, event_hash: str, tokens: int) -> None:
        """Pages of ``table`` (index table ``tid``) are blocks, from now on ("": not)."""
        if not event_hash:
            self.pools.pop(table, None)
            self.tids.pop(tid, None)
            return
        self.pools[table] = self.tids[tid] = EventPool(
            namespace, EVENT_HASHES[event_hash], tokens)

    def _hash(self, pool: EventPool, key: str) -> int | bytes | None:
        try:
            return pool.encode(key)
        except ValueError:
            if not self.unencodable:
                log.warning("kv events: key %r is not a hex hash; such keys get no events", key)
            self.unencodable += 1
            return None

    def stored(self, entries: Sequence[Any], chain: Callable[[int, str], Any],
               medium: str = MEDIUM_L2) -> None:
        """Pages of ``entries`` (in chain order) are in ``medium`` now: one ``BlockStored`` per
        run of pages whose chain links each to the one before (``chain(namespace, key)``:
        the index's ``PageIndex.chain``, the key's parent first)."""
        pools, last = self.pools, None
        for e in entries:
            pool = pools.get(e.table)
            if pool is None:
                continue
            h = self._hash(pool, e.key)
            if h is None:
                continue
            parent = chain(e.table[0], e.key)[0]
            if (last is not None and last[0] is pool and last[1] == parent
                    and last[2].medium == medium):
                last[2].block_hashes.append(h)
                last[1] = e.key
                continue
            ph = self._hash(pool, parent) if parent is not None else None
            ev = BlockStored([h], ph, [], pool.block_size, None, medium, None)
            self.pending.setdefault(pool.namespace, []).append(ev)
            last = [pool, e.key, ev]

    def removed_l2(self, pool: EventPool, key: str) -> None:
        """``PageIndex._unpublish``: the page of ``key`` left L2."""
        self._removed(pool, key, MEDIUM_L2)

    def removed(self, table, key: str, medium: str) -> None:
        pool = self.pools.get(table)
        if pool is not None:
            self._removed(pool, key, medium)

    def _removed(self, pool: EventPool, key: str, medium: str) -> None:
        h = self._hash(pool, key)
        if h is None:
            return
        events = self.pending.setdefault(pool.namespace, [])
        if events and type(events[-1]) is BlockRemoved and events[-1].medium == medium:
            events[-1].block_hashes.append(h)
        else:
            events.append(BlockRemoved([h], medium))

    def cleared(self, keys_of: Callable[[Any], Any], medium: str, ns: str | None = None
                ) -> None:
        """An L3 clear (``ns``: of that namespace digest's pages only): the keys of each block
        pool that ``keys_of(table)`` names (those the tier remembers as stored) left
        ``medium``."""
        for table, pool in self.pools.items():
            if ns is None or table[0] == ns:
                for key in list(keys_of(table)):
                    self._removed(pool, key, medium)

    def all_cleared(self, ns: str | None = None) -> None:
        """Every tier was flushed: ``AllBlocksCleared`` to each namespace with block pools
        (``ns``: every tier of that namespace digest: to it alone, on its topic)."""
        names = (p.namespace for t, p in self.pools.items() if ns is None or t[0] == ns)
        for name in dict.fromkeys(names):
            self.pending.setdefault(name, []).append(AllBlocksCleared())

    def send(self) -> None:
        """Hand the turn's events to the publisher: one batch per namespace."""
        if not self.pending:
            return
        pending, self.pending = self.pending, {}
        ts = self.clock()
        for ns, events in pending.items():
            self.publisher.publish(ns, KVEventBatch(ts, events, None, ns), len(events))

    def close(self) -> None:
        self.send()
        self.publisher.close()


def make_kv_events(config) -> NullKVEvents:
    """The daemon's events: ``KVEvents`` publishing at ``config.kv_events_endpoint``, or a
    ``NullKVEvents`` when it is "". Built first: the daemon hands it to the index, the L3 tier
    and the controller as they are built."""
    if not config.kv_events_endpoint:
        return NullKVEvents()
    return KVEvents(ZmqPublisher(config.kv_events_endpoint,
                                        config.kv_events_replay_endpoint))
