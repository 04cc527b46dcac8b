"""No L3 backend serves a corrupted or misplaced page (``backends/integrity.py``), through real
daemons: the file L3 with real files, Mooncake with a real ``mooncake_master`` whose stored
object another client of the store replaces. (3FS: ``test_hf3fs_integrity.py``.)

Each corruption, after an L2 flush and after a daemon restart: the corrupted key misses, its
uncorrupted neighbours of the same call hit with their exact bytes, the failure is counted, the
bad copy is gone, and a set stores the page again."""

import json
import os
import pathlib
import shutil
import struct

import pytest
import torch
from conftest import DaemonProc, wait_until
from pools import kv_pool, kv_tokens, pages

from hicached import PoolTransfer
from hicached.daemon.sessions import namespace_digest

KEYS = [f"k{i}" for i in range(4)]
BAD = 1  # the key corrupted; its neighbours must still hit

# a corruption: (page bytes, trailer or None, the other key's page bytes) -> new stored bytes
CORRUPTIONS = {
    "flip a byte in the middle": lambda page, other: _flip(page, len(page) // 2),
    "flip the first payload byte": lambda page, other: _flip(page, 0),
    "truncate": lambda page, other: page[:len(page) // 2],
    "another key's payload": lambda page, other: other,
    "zero the page": lambda page, other: bytes(len(page)),
}


def _flip(b: bytes, i: int) -> bytes:
    return b[:i] + bytes([b[i] ^ 0x5A]) + b[i + 1:]


def store_pages(d, keys=KEYS, seed=1):
    """Set ``keys`` (KV pages) through a client and wait until L3 has them; returns the pool."""
    src = kv_pool(seed=seed)
    with d.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, len(keys)), keys=keys)]) == {
            "kv": [True] * len(keys)}
        # (stats is answered after the commit, whose write-through job it then counts)
        assert wait_until(lambda: c.stats()["l3_tier"]["jobs_in_flight"] == 0, 20)
    return src


def get_all(d, src, keys=KEYS):
    """A fresh client's get of ``keys`` after an L2 flush: per key hit, bytes checked for hits."""
    with d.client() as c:
        c.flush("l2")
        dst = kv_pool()
        c.register_mem_host_pool_v2(dst, "kv")
        got = c.batch_get_v1(keys, pages(0, len(keys)))
        for i, hit in enumerate(got):
            if hit:  # a hit is always the exact page
                assert torch.equal(kv_tokens(dst, i, 1), kv_tokens(src, i, 1)), keys[i]
        return got, c.stats()["l3"]


# ---------------------------------------------------------------- file L3


def page_files(l3: pathlib.Path, key: str) -> list[pathlib.Path]:
    return [p for p in l3.rglob(key) if p.is_file()]


def split_file(path: pathlib.Path) -> tuple[bytes, bytes]:
    raw = path.read_bytes()
    header_len = struct.unpack_from("<4sH", raw)[1]
    return raw[:header_len], raw[header_len:]


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("when", ["l2 flush", "restart"])
def test_file_l3_never_serves_a_corrupted_page(make_daemon, tmp_path, how, when):
    d = make_daemon()
    l3 = pathlib.Path(d.state_dir) / "l3"
    src = store_pages(d)
    (path,) = page_files(l3, KEYS[BAD])
    head, page = split_file(path)
    _, other = split_file(page_files(l3, KEYS[2])[0])
    path.write_bytes(head + CORRUPTIONS[how](page, other))  # the header and its digest stay
    if when == "restart":
        d.stop()
        d.start()
    got, l3_stats = get_all(d, src)
    assert got == [True, False, True, True]
    if how != "truncate":  # (a cut file is a short read: a miss, counted as one too)
        assert l3_stats["integrity_failures"] == 1
        assert l3_stats["integrity_failures_by_pool"] == {"kv": 1}
    assert l3_stats["integrity_failures"] >= 1
    assert not path.exists()  # dropped: the next set stores the page again
    store_pages(d)
    assert get_all(d, src)[0] == [True] * 4
    log = d.output()
    assert "does not verify" in log and f"key {KEYS[BAD]} " not in log  # its digest, not it


def test_file_l3_refuses_a_page_copied_from_another_namespace(make_daemon):
    d = make_daemon()
    l3 = pathlib.Path(d.state_dir) / "l3"
    src = store_pages(d)
    with d.client("model-b") as c:  # model-b stores the same keys, other bytes
        other = kv_pool(seed=9)
        c.register_mem_host_pool_v2(other, "kv")
        c.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=KEYS)])
        assert wait_until(lambda: c.stats()["l3_writes"] >= 8, 20)
        ns_b = namespace_digest(c.namespace)
    # an operator copies model-a's files over model-b's (same keys, headers intact)
    for key in KEYS:
        a, b = sorted(page_files(l3, key), key=lambda p: ns_b in str(p))
        assert ns_b in str(b) and ns_b not in str(a)
        shutil.copyfile(a, b)
    with d.client("model-b") as c:
        c.flush("l2")
        dst = kv_pool()
        c.register_mem_host_pool_v2(dst, "kv")
        assert c.batch_get_v1(KEYS, pages(0, 4)) == [False] * 4  # not model-b's pages
        assert c.stats()["l3"]["integrity_failures"] == 4
    assert get_all(d, src)[0] == [True] * 4  # model-a's own copies are fine


def test_file_l3_pages_of_the_format_before_checksums_miss_and_go(make_daemon):
    d = make_daemon()
    l3 = pathlib.Path(d.state_dir) / "l3"
    src = store_pages(d)
    (path,) = page_files(l3, KEYS[BAD])
    head, page = split_file(path)
    key = KEYS[BAD].encode()  # the old header: b"HCP1" | len | key len | page bytes | key
    path.write_bytes(struct.pack("<4sHHQ", b"HCP1", 16 + len(key), len(key), len(page))
                     + key + page)
    d.stop()
    d.start()  # the restart scan only stats: the file is still counted as a page
    got, l3_stats = get_all(d, src)
    assert got == [True, False, True, True]
    assert l3_stats["unchecked_copies"] == 1 and l3_stats["integrity_failures"] == 0
    assert not path.exists()


def test_an_l2_hit_is_never_hashed(make_daemon):
    d = make_daemon()
    src = store_pages(d)
    with d.client() as c:
        dst = kv_pool()
        c.register_mem_host_pool_v2(dst, "kv")
        for _ in range(3):
            assert c.batch_get_v1(KEYS, pages(0, 4)) == [True] * 4  # from L2
        assert c.stats()["l3"]["verified_loads"] == 0
        c.flush("l2")
        assert c.batch_get_v1(KEYS, pages(0, 4)) == [True] * 4  # from L3: verified
        assert c.stats()["l3"]["verified_loads"] == 4
        assert c.batch_get_v1(KEYS, pages(0, 4)) == [True] * 4  # L2 again
        assert c.stats()["l3"]["verified_loads"] == 4
        assert torch.equal(kv_tokens(dst, 0, 4), kv_tokens(src, 0, 4))


# ---------------------------------------------------------------- Mooncake


@pytest.fixture
def mooncake_parts(tmp_path):
    """A real master, and a client of the store (in this process) holding the segment the
    daemon's pages live in: it stays up while the daemon restarts, and it is the other client
    that replaces stored objects."""
    mc = pytest.importorskip("test_mooncake")
    master = mc.Master(tmp_path / "master.log").start()
    arenas, backends = [], []
    try:
        from hicached.arena import Arena
        from hicached.backends.base import create_backend

        arena = Arena.create(f"/dev/shm/hicached-test-int-{os.getpid()}", 8 << 20)
        arenas.append(arena)
        other = create_backend("mooncake", env={}, master_server_address=master.address,
                               protocol="tcp", global_segment_size="64MiB",
                               local_buffer_size="4MiB", local_hostname="127.0.0.1")
        other.open(arena)
        backends.append(other)
        yield master, other, arena
    finally:
        for b in backends:
            b.close()
        for a in arenas:
            a.close()
        master.stop()


def mooncake_daemon(tmp_path, master):
    opts = {"master_server_address": master.address, "protocol": "tcp",
            "global_segment_size": 0, "local_buffer_size": "4MiB",
            "local_hostname": "127.0.0.1"}
    return DaemonProc(tmp_path, extra=["--l3-backend", "mooncake", "--l3-options",
                                       json.dumps(opts), "--l3-audit-s", "0"])


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("when", ["l2 flush", "restart"])
def test_mooncake_never_serves_a_replaced_object(mooncake_parts, tmp_path, how, when):
    from hicached.backends.mooncake.trailer import FORMAT_PART, TRAILER_BYTES
    from hicached.backends.mooncake.transfers import object_key

    master, other, arena = mooncake_parts
    d = mooncake_daemon(tmp_path, master).start()
    try:
        src = store_pages(d)
        ns = namespace_digest("model-a")
        page_bytes = src.page_bytes
        whole = page_bytes + TRAILER_BYTES
        names = [object_key(f"hicached/{FORMAT_PART}", ns, "kv", k) for k in KEYS]
        store, base = other._store, arena.tensor.data_ptr()
        # read the stored objects (page | trailer) of the bad key and a neighbour
        assert store.batch_get_into(names[BAD:BAD + 1], [base], [whole]) == [whole]
        assert store.batch_get_into(names[2:3], [base + 65536], [whole]) == [whole]
        obj = arena.tensor[:whole].numpy().tobytes()
        nb = arena.tensor[65536:65536 + whole].numpy().tobytes()
        page, trailer = obj[:page_bytes], obj[page_bytes:]
        new = CORRUPTIONS[how](page, nb[:page_bytes])
        new = new + trailer if how != "truncate" else new  # (a cut object has no trailer)
        # another client replaces the object: removed (force) and put again, its length kept
        assert store.batch_remove(names[BAD:BAD + 1], True) == [0]
        arena.tensor[:len(new)] = torch.frombuffer(bytearray(new), dtype=torch.uint8)
        assert store.batch_put_from(names[BAD:BAD + 1], [base], [len(new)]) == [0]
        if when == "restart":
            d.stop()
            d.start()
        got, l3_stats = get_all(d, src)
        assert got == [True, False, True, True]
        if how == "truncate":
            assert l3_stats["size_mismatches"] >= 1
        else:
            assert l3_stats["integrity_failures_by_pool"] == {"kv": 1}
            # the bad copy was removed (force), so the next set stores the page again
            assert store.batch_is_exist(names[BAD:BAD + 1]) == [0]
            store_pages(d)
            assert get_all(d, src)[0] == [True] * 4
    finally:
        d.cleanup()


def test_the_failure_is_a_prometheus_counter(make_daemon):
    from admin_helpers import admin_daemon, sample, scrape

    d, url = admin_daemon(make_daemon)
    l3 = pathlib.Path(d.state_dir) / "l3"
    src = store_pages(d)
    (path,) = page_files(l3, KEYS[BAD])
    head, page = split_file(path)
    path.write_bytes(head + CORRUPTIONS["zero the page"](page, b""))
    assert get_all(d, src)[0] == [True, False, True, True]
    m = scrape(url)
    assert sample(m, "hicached_l3_integrity_failures_total", backend="file", pool="kv") == 1
    assert sample(m, "hicached_hits_total", tier="l3", pool="kv") == 3  # the good neighbours
