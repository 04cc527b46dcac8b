"""KV events for routers (issue 27, ``daemon/kv_events.py``): a real daemon publishing on ipc://,
read by a plain ZeroMQ SUB that decodes with structs of vLLM's format written here (and by
vLLM's own classes where vLLM is importable), and its replay socket."""

import contextlib
import hashlib
import time
import typing

import msgspec
import pytest
import torch
import zmq
from inproc_daemon import inproc_daemon
from pools import PAGE, kv_pool, pages

from hicached import Client, HostPool, PoolTransfer
from hicached import protocol as P
from hicached.daemon.kv_events import KVEventBatch, ZmqPublisher
from hicached.errors import ConfigError, ProtocolError
from hicached.daemon.config import load_config
from hicached.daemon.metrics import make_metrics

NS = "model-a|tp0of1"


# ---------------------------------------------------------------- vLLM's format, as a router has it


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


decode_batch = msgspec.msgpack.Decoder(EventBatch).decode


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def h(k: str) -> int:  # SGLang's hash_str_to_int64
    v = int(k[:16], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


class Router:
    """A SUB socket on the daemon's events and a DEALER on its replay socket."""

    def __init__(self, tmp_path):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"ipc://{tmp_path}/events.sock")
        self.replay_ep = f"ipc://{tmp_path}/replay.sock"
        time.sleep(0.3)  # ZeroMQ's slow joiner: the subscription reaches the PUB first
        self.seen: list[tuple[str, int, EventBatch, bytes]] = []

    def batches(self, until, timeout_s=10.0) -> list:
        """Batches received until ``until(all seen)`` holds. As a router does, a gap in the
        sequence numbers (or silence: ZeroMQ's slow joiner may lose the first batches) is
        filled from the replay socket."""
        deadline = time.monotonic() + timeout_s
        while not until(self.seen):
            assert time.monotonic() < deadline, self.seen
            nxt = self.seen[-1][1] + 1 if self.seen else 0
            if not self.sub.poll(200):
                self._add(self.replay(nxt))
                continue
            topic, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > nxt:
                self._add([(s, p) for s, p in self.replay(nxt) if s < seq])
            if seq == (self.seen[-1][1] + 1 if self.seen else 0):
                self._add([(seq, payload)], topic.decode())
        return self.seen

    def _add(self, batches, topic=None):
        for seq, payload in batches:
            batch = decode_batch(payload)
            ns = topic or msgspec.msgpack.decode(payload, type=KVEventBatch).namespace
            self.seen.append((ns, seq, batch, payload))

    def events(self, until=None, timeout_s=10.0) -> list:
        self.batches(lambda seen: until(flat(seen)), timeout_s)
        return flat(self.seen)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        s = self.ctx.socket(zmq.DEALER)
        s.connect(self.replay_ep)
        s.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert s.poll(5000)
            _, seq, payload = s.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                s.close(linger=0)
                return out
            out.append((int.from_bytes(seq, "big"), payload))

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()


def flat(seen):
    return [ev for _, _, batch, _ in seen for ev in batch.events]


@contextlib.contextmanager
def listening(tmp_path):
    """A ``Router`` on the events of a daemon started already (the ipc socket exists)."""
    r = Router(tmp_path)
    try:
        yield r
    finally:
        r.close()


def events_daemon(tmp_path, **overrides):
    return inproc_daemon(tmp_path, kv_events_endpoint=f"ipc://{tmp_path}/events.sock",
                         kv_events_replay_endpoint=f"ipc://{tmp_path}/replay.sock", **overrides)


def client(d, pool=None):
    c = Client(d.endpoint, NS)
    c.register_mem_host_pool_v2(pool if pool is not None else kv_pool(seed=1), "kv",
                                event_hash="sglang_int64", tokens_per_page=PAGE)
    return c


def stored(events, medium):
    return [e for e in events if type(e) is BlockStored and e.medium == medium]


# ---------------------------------------------------------------- L2


def test_sets_are_block_stored_in_l2_in_chain_order_with_parents(tmp_path):
    keys = [key(i) for i in range(5)]
    with events_daemon(tmp_path, l3_backend="none") as d:
        r = Router(tmp_path)
        try:
            with client(d) as c:
                mamba = HostPool.allocate_mamba(num_slots=2, mamba_layers=1,
                                                temporal_shape=(2, 4), conv_shapes=[(3, 4)])
                c.register_mem_host_pool_v2(mamba, "mamba")  # no event hash: no events
                assert c.batch_set_v2([PoolTransfer("kv", pages(0, 3), keys=keys[:3]),
                                       PoolTransfer("mamba", torch.tensor([0]),
                                                    keys=keys[2:3])])["kv"] == [True] * 3
                assert c.batch_set_v2([PoolTransfer("kv", pages(3, 2), keys=keys[3:])],
                                      parent=keys[2], depth=3)["kv"] == [True] * 2
            seen = r.batches(lambda s: len(flat(s)) >= 2)
        finally:
            r.close()
    # one batch per turn of the daemon's loop: the two calls may share one
    assert [(topic, seq) for topic, seq, _, _ in seen] == [(NS, i) for i in range(len(seen))]
    assert flat(seen) == [
        BlockStored([h(k) for k in keys[:3]], None, [], PAGE, None, "CPU_PINNED", None),
        BlockStored([h(k) for k in keys[3:]], h(keys[2]), [], PAGE, None, "CPU_PINNED", None)]
    assert [b.ts for _, _, b, _ in seen] == sorted(b.ts for _, _, b, _ in seen)
    # the namespace travels in the batch too (a trailing element vLLM's decoder ignores)
    assert msgspec.msgpack.decode(seen[0][3], type=KVEventBatch).namespace == NS


def test_eviction_and_flushes_are_removals(tmp_path):
    big = HostPool.allocate_mha(32, PAGE, layers=2, heads=8, head_dim=128, layout="page_first",
                                dtype=torch.float32)  # 64 KiB pages: 16 fill the arena
    first, second = [key(i) for i in range(12)], [key(100 + i) for i in range(8)]
    with events_daemon(tmp_path, l3_backend="none", l2_size=1 << 20, slab_size=256 << 10,
                       evict_ahead=0) as d, \
            listening(tmp_path) as router, client(d, big) as c:  # (only the sets evict)
        assert all(c.batch_set_v2([PoolTransfer("kv", pages(0, 12), keys=first)])["kv"])
        assert all(c.batch_set_v2([PoolTransfer("kv", pages(12, 8), keys=second)])["kv"])
        held = [k for k in first + second
                if c.batch_exists_v2([k], []).kv_hit_pages]
        gone = [k for k in first if k not in held]
        assert gone and set(second) <= set(held)
        events = router.events(lambda ev: len(ev) >= 3)
        assert events[0] == BlockStored([h(k) for k in first], None, [], PAGE, None,
                                        "CPU_PINNED", None)
        removed = [e for e in events if type(e) is BlockRemoved]
        assert all(e.medium == "CPU_PINNED" for e in removed)
        assert sorted(x for e in removed for x in e.block_hashes) == sorted(map(h, gone))
        assert stored(events[1:], "CPU_PINNED")[-1].block_hashes == [h(k) for k in second]
        n = len(router.seen)

        c.flush("l2")

        def flushed(seen):
            return [x for e in flat(seen[n:]) for x in e.block_hashes]

        router.batches(lambda seen: len(flushed(seen)) >= len(held))
        assert {type(e) for e in flat(router.seen[n:])} == {BlockRemoved}
        assert sorted(flushed(router.seen)) == sorted(map(h, held))
        c.flush("all")
        router.events(lambda ev: type(ev[-1]) is AllBlocksCleared)
        stats = d.daemon.call(d.daemon.operations.loop_stats)["kv_events"]
        text = make_metrics(d.daemon, True).render().decode()
    seqs = [seq for _, seq, _, _ in router.seen]
    assert seqs == list(range(len(seqs)))
    assert stats["dropped"] == 0 and stats["published"] == len(flat(router.seen))
    assert "hicached_kv_events_dropped_total 0.0" in text
    assert f"hicached_kv_events_published_total {float(stats['published'])}" in text


def test_replay_serves_the_batches_after_a_gap(tmp_path):
    keys = [key(i) for i in range(6)]
    with events_daemon(tmp_path, l3_backend="none") as d:
        r = Router(tmp_path)
        try:
            with client(d) as c:
                for i in range(3):  # one batch each: the next set once this one's is out
                    c.batch_set_v2([PoolTransfer("kv", pages(2 * i, 2),
                                                 keys=keys[2 * i:2 * i + 2])])
                    seen = r.batches(lambda s, n=i + 1: len(s) >= n)
                replayed = r.replay(1)  # a router that lost batch 1 on
                assert r.replay(99) == []
        finally:
            r.close()
    assert replayed == [(seq, payload) for _, seq, _, payload in seen[1:]]
    assert [decode_batch(p).events[0].block_hashes for _, p in replayed] == [
        [h(k) for k in keys[2:4]], [h(k) for k in keys[4:]]]


# ---------------------------------------------------------------- L3


def test_a_write_through_to_the_file_l3_is_block_stored_on_disk(tmp_path):
    keys = [key(i) for i in range(3)]
    with events_daemon(tmp_path) as d, listening(tmp_path) as router, client(d) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 3), keys=keys)])
        events = router.events(lambda ev: stored(ev, "DISK"))
    assert stored(events, "CPU_PINNED")[0].block_hashes == [h(k) for k in keys]
    assert stored(events, "DISK") == [
        BlockStored([h(k) for k in keys], None, [], PAGE, None, "DISK", None)]
    assert events.index(stored(events, "CPU_PINNED")[0]) < events.index(stored(events, "DISK")[0])


def test_the_file_l3s_evictions_and_an_l3_flush_are_removals_from_disk(tmp_path):
    keys = [key(i) for i in range(5)]
    # 4 KiB a page file (file.file_bytes): 3 fit; the write of 5 evicts the 2 oldest
    with events_daemon(tmp_path, l3_options={"capacity": 3 * 4096}) as d, \
            listening(tmp_path) as router, client(d) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 5), keys=keys)])
        events = router.events(lambda ev: [e for e in ev if type(e) is BlockRemoved])
        disk = [e for e in events if e.medium == "DISK"]
        assert [type(e) for e in disk] == [BlockStored, BlockRemoved]  # stored, then evicted
        assert disk[0].block_hashes == [h(k) for k in keys]
        evicted = disk[1].block_hashes
        assert len(evicted) == 2 and set(evicted) < set(disk[0].block_hashes)
        n = len(router.seen)
        c.flush("l3")
        router.batches(lambda seen: len(seen) > n)
    # the pages the tier remembers as stored: here all 5 (the 2 the store evicted while their
    # own write ran count as written), a removal a router already had is harmless
    assert flat(router.seen[n:]) == [BlockRemoved([h(k) for k in keys], "DISK")]


def test_a_namespace_flush_is_told_on_that_namespaces_topic_only(tmp_path):
    keys, other_ns = [key(i) for i in range(3)], "model-b|tp0of1"
    with events_daemon(tmp_path) as d, listening(tmp_path) as router, client(d) as a, \
            Client(d.endpoint, other_ns) as b:
        b.register_mem_host_pool_v2(kv_pool(seed=2), "kv", event_hash="sglang_int64",
                                    tokens_per_page=PAGE)
        for c in (a, b):  # the same keys in both namespaces, in L2 and on disk
            c.batch_set_v2([PoolTransfer("kv", pages(0, 3), keys=keys)])

        def on_disk(seen):
            return {t for t, _, batch, _ in seen for e in batch.events
                    if type(e) is BlockStored and e.medium == "DISK"}

        router.batches(lambda seen: on_disk(seen) == {NS, other_ns})
        n = len(router.seen)
        a.flush("all", namespace=NS)
        b.batch_set_v2([PoolTransfer("kv", pages(3, 1), keys=[key(9)])], parent=keys[-1],
                       depth=3)  # after the flush: B's next events follow A's
        router.batches(lambda seen: any(t == other_ns for t, _, _, _ in seen[n:]))
        after = router.seen[n:]
    flushed = [(t, e) for t, _, batch, _ in after for e in batch.events if t == NS]
    assert [type(e) for _, e in flushed] == [BlockRemoved, BlockRemoved, AllBlocksCleared]
    assert [(sorted(e.block_hashes), e.medium) for _, e in flushed[:2]] == [
        (sorted(map(h, keys)), "CPU_PINNED"), (sorted(map(h, keys)), "DISK")]
    theirs = [e for t, _, batch, _ in after for e in batch.events if t == other_ns]
    assert theirs and all(type(e) is BlockStored for e in theirs)  # B's new page alone
    assert [x for e in theirs for x in e.block_hashes] == [h(key(9))] * len(theirs)


# ---------------------------------------------------------------- the publisher, the wire


def test_a_full_queue_drops_and_counts(tmp_path):
    pub = ZmqPublisher(f"ipc://{tmp_path}/p.sock", queue_batches=1)
    pub.close()  # nobody reads the queue now
    batch = KVEventBatch(0.0, [], None, NS)
    assert pub.publish(NS, batch, 3) and not pub.publish(NS, batch, 5)
    assert (pub.dropped, pub.published) == (5, 0)


def test_register_pool_fields_are_trailing_and_checked(tmp_path):
    class OldRegisterPool(msgspec.Struct, array_like=True, tag_field="op", tag="register_pool"):
        req_id: int
        session: int
        pool: str
        page_bytes: int

    old = msgspec.msgpack.encode(OldRegisterPool(1, 2, "kv", 64))
    assert P.request_decoder.decode(old) == P.RegisterPool(1, 2, "kv", 64, "", 0)
    new = P.encode(P.RegisterPool(1, 2, "kv", 64, "vllm_bytes", 16))
    assert msgspec.msgpack.decode(new, type=OldRegisterPool) == OldRegisterPool(1, 2, "kv", 64)
    with inproc_daemon(tmp_path) as d, Client(d.endpoint, NS) as c, \
            pytest.raises(ProtocolError, match="event_hash 'md5' unknown"):
        c.register_mem_host_pool_v2(kv_pool(), "kv", event_hash="md5")


def test_an_endpoint_that_cannot_be_bound_stops_the_start(tmp_path):
    with pytest.raises(ConfigError, match="kv_events_endpoint"), \
            inproc_daemon(tmp_path, kv_events_endpoint=f"ipc://{tmp_path}/no/such/dir/ev"):
        pass
    with inproc_daemon(tmp_path, kv_events_endpoint=f"ipc://{tmp_path}/ev") as d, \
            Client(d.endpoint, NS) as c:  # the failed start freed everything
        c.ping()


def test_config_checks_the_endpoints():
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        load_config(None, {}, {"kv_events_endpoint": "http://x"})
    with pytest.raises(ConfigError, match="kv_events_replay_endpoint"):
        load_config(None, {}, {"kv_events_replay_endpoint": "ipc:///tmp/r"})


def test_vllm_decodes_the_batches(tmp_path):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    with events_daemon(tmp_path, l3_backend="none") as d, listening(tmp_path) as router, \
            client(d) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 2), keys=[key(0), key(1)])])
        c.flush("all")
        router.batches(lambda s: any(b"AllBlocksCleared" in b[-1] for b in s))
    dec = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    got = [dec.decode(p) for _, _, _, p in router.seen]
    ev = [e for b in got for e in b.events]
    assert type(ev[0]).__name__ == "BlockStored" and ev[0].block_hashes == [h(key(0)), h(key(1))]
    assert ev[0].medium == "CPU_PINNED" and ev[0].block_size == PAGE
    assert type(ev[-1]).__name__ == "AllBlocksCleared"
    assert typing.get_type_hints(kv_events.KVEventBatch)  # (the module is vLLM's own)
