"""Gets with no lease (``client/leaseless.py``): known pages are copied from their slots and
checked by the slot tags the daemon publishes (presence.py); every other page is leased.

Real daemons on ipc:// sockets. Slots are made to change hands under the reader (a flush and a
new writer in the middle of its copy, an evicting writer process) and every page a get calls a hit
must hold its own key's bytes."""

import os
import signal
import time

import numpy as np
import pytest
import torch
from admin_helpers import admin_daemon, sample, scrape
from conftest import RacingWriter, age_heartbeat, wait_until
from pools import indexer_pool
from pools import pages as indexer_tokens

from hicached import HostPool, PoolTransfer
from hicached.errors import ArenaError, DaemonUnavailable
from hicached.presence import (
    F_OVERFLOW,
    H_TAGS,
    STALE_S,
    PresenceTable,
    PresenceView,
    fingerprint,
    namespace_seed,
)
from hicached.protocol import MAX_TOUCHED

SEED = namespace_seed("ns-test")
TOKENS = 16  # 16 tokens * 4 layers * 512 * 4 bytes = 128 KiB pages: tagged (>= 64 KiB)


def pool(num_pages=8, fill=None):
    p = HostPool.allocate_mla(num_pages, TOKENS, layers=4, kv_dim=512, dtype=torch.float32)
    if fill is not None:  # page i holds fill + i everywhere
        for i in range(num_pages):
            p.kv_buffer[i * TOKENS:(i + 1) * TOKENS] = fill + i
    return p


def tokens(i, n=1):
    return torch.arange(i * TOKENS, (i + n) * TOKENS)


def page_values(p, n):
    """The value every element of page i holds, or None where the page is not uniform."""
    out = []
    for i in range(n):
        page = p.kv_buffer[i * TOKENS:(i + 1) * TOKENS]
        v = float(page.flatten()[0])
        out.append(v if bool((page == v).all()) else None)
    return out


def with_requests(c, fn):
    """(``fn()``'s result, the requests it sent through the socket, pool registrations aside)."""
    calls = []
    real = c._conn.call

    def call(build, *a, **k):
        msg = build(c.session, 0)
        if type(msg).__name__ != "RegisterPool":
            calls.append(msg)
        return real(build, *a, **k)
    c._conn.call = call
    try:
        return fn(), calls
    finally:
        del c._conn.call


def names(sent):
    return [type(m).__name__ for m in sent]


def store(c, keys, fill):
    src = pool(len(keys), fill)
    c.register_mem_host_pool_v2(src, "kv")
    assert all(c.batch_set_v2([PoolTransfer("kv", tokens(0, len(keys)), keys=keys)])["kv"])
    c.ping()  # the fire-and-forget commit has landed


def load(c, keys, dst=None):
    dst = dst if dst is not None else pool(len(keys))
    c.register_mem_host_pool_v2(dst, "kv")
    res = c.batch_get_v2([PoolTransfer("kv", tokens(0, len(keys)), keys=keys)])["kv"]
    return res, dst


# ---------------------------------------------------------------- the tags in the table


def test_slot_tags_published_cleared_and_read_by_views(tmp_path):
    path = f"/dev/shm/hicached-test-tags-{os.getpid()}-{time.monotonic_ns()}"
    grain = 64 * 1024
    t = PresenceTable(path, 64, epoch=3, arena_bytes=40 * grain + 5, grain=grain)
    try:
        assert t.tag_count == 40 and t.stats()["tag_grain"] == grain
        v = PresenceView(path, 64, epoch=3, seed=SEED)
        assert v.grain == grain and v.tags.size == 40 and v.alive()
        offs = [0, 3 * grain + 64, 39 * grain, 40 * grain, -grain]
        for off, tag in zip(offs[:3], [11, 12, 13]):
            t.publish_tag(off, grain, tag)
        t.publish_tag(5 * grain, grain - 64, 99)  # a page under a grain: never published
        assert v.tags[5] == 0
        # outside the arena (or negative): -1, which no tag equals
        assert [v.tag_of(off) for off in offs] == [11, 12, 13, -1, -1]
        assert v.tag_of(3 * grain) == 12 and v.tag_of(4 * grain) == 0
        t.clear_tag(3 * grain + 64, grain)
        assert [v.tag_of(off) for off in offs] == [11, 0, 13, -1, -1]
        t.set(fingerprint(SEED, "k"), 1)  # a rebuild of the key slots leaves the tags alone
        t._set_flag(F_OVERFLOW)
        assert t.rebuild([]) and v.tags[0] == 11 and v.tags[39] == 13
        t.close()  # readers see CLOSED; the tags are still kept until the daemon exits
        assert not v.alive()
        t.clear_tag(0, grain)
        assert v.tags[0] == 0
    finally:
        t.close()


def test_tables_without_tags_and_bad_tag_headers(tmp_path):
    path = f"/dev/shm/hicached-test-tags-{os.getpid()}-{time.monotonic_ns()}"
    t = PresenceTable(path, 64, epoch=3, arena_bytes=1 << 20, grain=0)
    try:
        v = PresenceView(path, 64, epoch=3, seed=SEED)
        assert v.grain == 0 and v.tags.size == 0
        assert v.tag_of(0) == -1
        t.publish_tag(0, 1 << 20, 5)  # nothing to publish into: ignored
    finally:
        t.close()
    with pytest.raises(ValueError, match="power of 2"):
        PresenceTable(path, 64, epoch=3, arena_bytes=1 << 20, grain=3000)
    small = PresenceTable(path, 64, epoch=3, arena_bytes=1000, grain=4096)  # under one grain
    try:
        assert small.grain == 0 and small.tag_count == 0
        small._w[H_TAGS] = 5  # a header naming tags the file does not hold
        with pytest.raises(ArenaError, match="tags do not fit"):
            PresenceView(path, 64, epoch=3, seed=SEED)
    finally:
        small.close()


# ---------------------------------------------------------------- gets through real daemons


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(extra=["--l3-backend", "none"])


def test_known_pages_are_read_with_no_request(daemon):
    keys = [f"s{i}" for i in range(6)]
    with daemon.client() as w, daemon.client() as r:
        store(w, keys, 100.0)
        # the writer knows its pages from its own set: no request at all
        (res, dst), sent = with_requests(w, lambda: load(w, keys))
        assert res == [True] * 6 and sent == []
        assert page_values(dst, 6) == [100.0 + i for i in range(6)]
        # another client leases them once (it never saw them), then knows them
        (res, dst), sent = with_requests(r, lambda: load(r, keys))
        assert res == [True] * 6 and names(sent) == ["Lease"]
        (res, dst), sent = with_requests(r, lambda: load(r, keys))
        assert res == [True] * 6 and sent == [] and page_values(dst, 6) == [100.0 + i
                                                                          for i in range(6)]
        # a call mixing known and unknown keys leases only the unknown ones
        (res, _), leased = with_requests(r, lambda: load(r, keys[:3] + ["never-set"]))
        assert res == [True, True, True, False]
        assert [t.keys for t in leased[0].transfers] == [["never-set"]]
        # the daemon hears of them within release_delay_s: calls with no request at all
        assert wait_until(lambda: w.stats()["shared_gets"] == 2)


def test_a_slot_reused_during_the_copy_is_caught_by_its_tag(daemon):
    """Between the tag check and the copy, another client flushes L2 and stores a new page in
    the very slot: the copy reads the new bytes, the tag after it differs, and the get leases
    the key instead (a miss: it is gone). It never returns the other page's bytes."""
    with daemon.client() as a, daemon.client() as b:
        store(a, ["old"], 1.0)
        off, _ = a._recall.seen("kv", "old")
        dst = pool(1)
        a.register_mem_host_pool_v2(dst, "kv")
        io = a._pools.io("kv")
        real = io.from_arena
        seen = []

        def racing(starts, arena, offsets):
            if not seen:
                seen.append(list(offsets))
                b.flush("l2")
                store(b, ["new"], 7.0)
                assert b._recall.seen("kv", "new")[0] == off  # the same slot, a new page
            real(starts, arena, offsets)

        io.from_arena = racing
        res, sent = with_requests(a, lambda: a.batch_get_v2(
            [PoolTransfer("kv", tokens(0), keys=["old"])])["kv"])
        assert seen == [[off]]  # the unleased copy ran (and read the new page's bytes) ...
        assert res == [False] and names(sent) == ["Lease"]  # ... and was not believed
        res, sent = with_requests(b, lambda: load(b, ["new"]))
        assert res[0] == [True] and sent == [] and page_values(res[1], 1) == [7.0]
        assert a._recall.seen("kv", "old") is None  # the miss forgot where it was


def test_unleased_reads_count_as_hits_and_keep_pages_recent(make_daemon):
    """The daemon hears of unleased reads (one Release per release_delay_s): the page read stays
    in L2 while an older one is evicted, and the metrics count the hits and the calls. (LRU:
    the pages are one call's chain, which the default policy would take from its deep end.)"""
    daemon, url = admin_daemon(make_daemon, l2_size="1MiB", slab_size="1MiB",
                               extra=["--l3-backend", "none", "--eviction", "lru"])
    keys = [f"r{i}" for i in range(8)]  # 8 pages of 128 KiB fill the arena
    with daemon.client() as c:
        store(c, keys, 0.0)
        res, sent = with_requests(c, lambda: load(c, keys[:1])[0])  # the oldest page
        assert res == [True] and sent == []
        assert wait_until(lambda: c.stats()["shared_gets"] == 1)
        store(c, ["late"], 50.0)  # evicts the least recently used page: r1, not r0
        assert c.batch_exists_v2(keys[:2], []).extra_pool_hit_pages == {"kv": 1}
        assert c.batch_exists_v2(keys[1:2], []).kv_hit_pages == 0
        for _ in range(3):
            assert load(c, keys[:1])[0] == [True]
    # the last reads went out with the client's Bye
    assert wait_until(lambda: sample(scrape(url), "hicached_requests_total", op="lease",
                                     outcome="shared") == 4)
    m = scrape(url)
    assert sample(m, "hicached_hits_total", tier="l2", pool="kv") == 4
    assert sample(m, "hicached_bytes_moved_total", direction="l2_to_client") == 4 * 128 * 1024


def test_reported_reads_count_only_pages_of_the_senders_namespace(daemon):
    with daemon.client() as a, daemon.client("model-b") as b:
        store(a, ["t0"], 1.0)
        off, tag = a._recall.seen("kv", "t0")
        hits = a.stats()["hits"]
        b._conn.send_release([], [off, tag, off], 0)  # another namespace's page (and an odd int)
        b.ping()
        assert a.stats()["hits"] == hits
        stale = [off, tag + 1] * (MAX_TOUCHED - 1) + [-5, tag]
        a._conn.send_release([], stale + [off, tag], 1)  # past what one Release may report: unread
        a.ping()
        st = a.stats()
        assert st["hits"] == hits and st["shared_gets"] == 1
        a._conn.send_release([], [off, tag], 0)
        a.ping()
        assert a.stats()["hits"] == hits + 1


def test_small_pages_and_daemons_without_tags_lease(make_daemon):
    on = make_daemon(name="on", extra=["--l3-backend", "none"])
    with on.client() as c:  # an indexer pool of small pages (no tag) beside tagged kv pages
        ix_src, ix_dst = indexer_pool(seed=4), indexer_pool()
        store(c, ["m0", "m1"], 3.0)
        c.register_mem_host_pool_v2(ix_src, "indexer")
        assert all(c.batch_set_v2([PoolTransfer("indexer", indexer_tokens(0, 2), keys=["m0", "m1"])])
                   ["indexer"])
        c.register_mem_host_pool_v2(ix_dst, "indexer")
        dst = pool(2)
        c.register_mem_host_pool_v2(dst, "kv")
        res, leased = with_requests(c, lambda: c.batch_get_v2(
            [PoolTransfer("kv", tokens(0, 2), keys=["m0", "m1"]),
             PoolTransfer("indexer", indexer_tokens(0, 2), keys=["m0", "m1"])]))
        assert res == {"kv": [True, True], "indexer": [True, True]}
        assert [t.pool for t in leased[0].transfers] == ["indexer"]
        assert page_values(dst, 2) == [3.0, 4.0]
        assert torch.equal(ix_dst.buffers[0][:2], ix_src.buffers[0][:2])
    with on.client(shared_gets=False) as c:  # a client that does not want them
        store(c, ["n0"], 5.0)
        (res, dst), sent = with_requests(c, lambda: load(c, ["n0"]))
        assert res == [True] and names(sent) == ["Lease"] and page_values(dst, 1) == [5.0]
    off = make_daemon(name="off", extra=["--l3-backend", "none", "--no-shared-gets"])
    with off.client() as c:
        assert c._conn.shared is not None and c._conn.shared.view.grain == 0
        store(c, ["o0"], 6.0)
        (res, dst), sent = with_requests(c, lambda: load(c, ["o0"]))
        assert res == [True] and names(sent) == ["Lease"] and page_values(dst, 1) == [6.0]


def store_with_indexer(c, keys, fill):
    """One call storing ``keys``' tagged KV pages (page i: fill + i) and their small INDEXER
    pages (never tagged: always leased); the host pools to read them into, registered."""
    src, ix_src = pool(len(keys), fill), indexer_pool(seed=int(fill))
    c.register_mem_host_pool_v2(src, "kv")
    c.register_mem_host_pool_v2(ix_src, "indexer")
    res = c.batch_set_v2([PoolTransfer("kv", tokens(0, len(keys)), keys=keys),
                          PoolTransfer("indexer", indexer_tokens(0, len(keys)), keys=keys)])
    assert all(res["kv"]) and all(res["indexer"])
    c.ping()  # committed
    dst, ix_dst = pool(len(keys)), indexer_pool()
    c.register_mem_host_pool_v2(dst, "kv")
    c.register_mem_host_pool_v2(ix_dst, "indexer")
    return ix_src, dst, ix_dst


def get_both(c, keys):
    return c.batch_get_v2([PoolTransfer("kv", tokens(0, len(keys)), keys=keys),
                           PoolTransfer("indexer", indexer_tokens(0, len(keys)), keys=keys)])


def before_each_lease(c, fn):
    """Run ``fn()`` whenever ``c`` is about to send a ``Lease`` (between its unleased reads and
    its lease request)."""
    real = c._conn.call

    def call(build, *a, **k):
        if type(build(c.session, 0)).__name__ == "Lease":
            fn()
        return real(build, *a, **k)
    c._conn.call = call


def test_a_key_gone_between_its_unleased_page_and_the_lease_is_a_miss_in_every_pool(daemon):
    """A get reads the KV pages it knows with no lease, then leases their INDEXER pages. L2
    loses the keys in between (a flush here; an eviction takes a key's pages all at once the
    same way): the lease calls the INDEXER pages misses, and so must the get call the KV pages
    it read, whose tags are gone by then. Every hit of a get was in L2 at the instant the
    daemon answered it: never a KV page without the INDEXER page stored with it (issue 45)."""
    keys = [f"g{i}" for i in range(4)]
    with daemon.client() as c, daemon.client() as other:
        ix_src, dst, ix_dst = store_with_indexer(c, keys, 10.0)  # c knows its KV pages
        got, sent = with_requests(c, lambda: get_both(c, keys))
        assert got == {"kv": [True] * 4, "indexer": [True] * 4}
        assert [t.pool for t in sent[0].transfers] == ["indexer"]  # KV: no lease
        assert page_values(dst, 4) == [10.0, 11.0, 12.0, 13.0]
        assert torch.equal(ix_dst.buffers[0][:4], ix_src.buffers[0][:4])
        c.ping()  # (the INDEXER lease ends: a flush leaves leased pages, and their keys)
        before_each_lease(c, lambda: other.flush("l2"))
        got, sent = with_requests(c, lambda: get_both(c, keys))
        assert got == {"kv": [False] * 4, "indexer": [False] * 4}
        assert [t.pool for t in sent[0].transfers] == ["indexer"]  # (the KV pages were read)


def test_unleased_pages_still_in_their_slots_after_the_lease_stay_hits(daemon):
    """The check after the lease demotes only pages that left: KV pages stored without their
    INDEXER pages (another call's, not yet stored) stay hits beside the INDEXER misses, and a
    set between the unleased reads and the lease changes nothing the get read."""
    keys = [f"h{i}" for i in range(3)]
    with daemon.client() as w, daemon.client() as r:
        store(w, keys, 20.0)  # KV pages only
        ix_dst, dst = indexer_pool(), pool(3)
        r.register_mem_host_pool_v2(dst, "kv")
        r.register_mem_host_pool_v2(ix_dst, "indexer")
        assert get_both(r, keys) == {"kv": [True] * 3, "indexer": [False] * 3}  # (learns)
        before_each_lease(r, lambda: store(w, ["other"], 30.0))
        got, sent = with_requests(r, lambda: get_both(r, keys))
        assert got == {"kv": [True] * 3, "indexer": [False] * 3}
        assert [t.pool for t in sent[0].transfers] == ["indexer"]
        assert page_values(dst, 3) == [20.0, 21.0, 22.0]


def test_a_dead_daemons_slots_are_not_read_once_its_heartbeat_is_stale(daemon):
    with daemon.client(timeout_s=1.0) as c:
        store(c, ["d0"], 2.0)
        assert load(c, ["d0"])[0] == [True]
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)
        age_heartbeat(daemon, STALE_S + 0.1)  # (dead: nothing beats; as if that long passed)
        assert not c._conn.shared.view.alive()
        with pytest.raises(DaemonUnavailable):
            load(c, ["d0"])


WRITER = """
import os, sys, time, torch
sys.path.insert(0, %r)  # tests/, and tests/client/ where this module lives
sys.path.insert(0, os.path.join(sys.path[0], "client"))
from test_leaseless import pool, tokens
from hicached import Client, PoolTransfer
""" + RacingWriter.KEEP_UP + """
c = Client(sys.argv[1], "model-a")
end = time.monotonic() + float(sys.argv[2])
out = os.open(sys.argv[3], os.O_RDWR)
r = 0
while time.monotonic() < end:  # round r: keys w{r}-{i}, page i filled with r * 16 + i
    keep_up(out, r, 2, end)  # at most 2 rounds (8 slots) past the one being read
    keys = [f"w{r}-{i}" for i in range(4)]
    src = pool(4, float(r * 16))
    c.register_mem_host_pool_v2(src, "kv")
    c.batch_set_v2([PoolTransfer("kv", tokens(0, 4), keys=keys)])
    c.ping()
    os.pwrite(out, r.to_bytes(8, "little"), 0)  # committed: the reader may ask for them
    r += 1
print(r)
c.close()
"""


def test_readers_racing_evictions_only_ever_get_their_own_keys_bytes(make_daemon, tmp_path):
    """A writer process keeps a 1 MiB arena (8 slots) evicting while this process gets recent
    pages again and again: the ones it knows with no request, checked by tags. Every page a get
    calls a hit holds exactly its key's bytes, whatever the race."""
    daemon = make_daemon(l2_size="1MiB", slab_size="1MiB", extra=["--l3-backend", "none"])
    gets = hits = unleased = 0
    rng = np.random.default_rng(3)
    with RacingWriter(WRITER, daemon.endpoint, 4, tmp_path) as writer, daemon.client() as c:
        dst = pool(4)
        c.register_mem_host_pool_v2(dst, "kv")
        while time.monotonic() < writer.end:
            r = writer.round() - int(rng.integers(0, 2))
            if r < 0:
                continue
            writer.asked(r)
            keys = [f"w{r}-{i}" for i in range(4)]
            dst.kv_buffer.fill_(-1.0)
            res, sent = with_requests(c, lambda k=keys: c.batch_get_v2(
                [PoolTransfer("kv", tokens(0, 4), keys=k)])["kv"])
            values = page_values(dst, 4)
            for i, ok in enumerate(res):
                if ok:
                    assert values[i] == r * 16 + i, (r, i, values[i])
            gets += 1
            hits += sum(res)
            unleased += not sent and any(res)
    assert writer.finish() > 10
    # (here: 1000-1400 gets of ~2000 rounds, 400-1350 pages served, 100-200 with no request)
    assert gets > 100 and hits > gets // 10  # some pages asked for were still there
    assert unleased >= 10  # and some were read with no request while the writer evicted
