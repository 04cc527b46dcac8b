"""The embedded file L3: atomic page files, restart scan, header checks, misses not errors."""

import json
import os
import pathlib
import time

import pytest
import torch

from hicached.backends import create_backend
from hicached.backends.file import FileBackend, file_bytes, file_name, pool_dir
from hicached.errors import ConfigError


def fill(arena, offset, n, value):
    arena.tensor[offset : offset + n] = value


def test_put_get_roundtrip_and_restart(arena, tmp_path):
    b = FileBackend(str(tmp_path))
    b.open(arena)
    fill(arena, 0, 256, 3)
    fill(arena, 256, 256, 4)
    assert b.batch_put("ns", "kv", ["k0", "k1"], [0, 256], 256) == [True, True]
    assert b.exists("ns", "kv", ["k0", "k1", "k2"]) == [True, True, False]
    assert b.exists("ns", "mamba", ["k0"]) == [False]
    assert not any(".tmp-" in f for _, _, fs in os.walk(tmp_path) for f in fs)

    b2 = FileBackend(str(tmp_path))  # a restarted daemon scans the directory
    b2.open(arena)
    assert b2.exists("ns", "kv", ["k0", "k1"]) == [True, True]
    assert b2.batch_get("ns", "kv", ["k1", "k0", "zz"], [1024, 2048, 4096], 256) == [
        True, True, False]
    assert arena.tensor[1024:1280].eq(4).all() and arena.tensor[2048:2304].eq(3).all()


def test_wrong_page_size_is_a_miss(arena, tmp_path):
    b = FileBackend(str(tmp_path))
    b.open(arena)
    fill(arena, 0, 256, 9)
    b.batch_put("ns", "kv", ["k"], [0], 256)
    fill(arena, 4096, 512, 0)
    assert b.batch_get("ns", "kv", ["k"], [4096], 512) == [False]
    assert arena.tensor[4096:4608].eq(0).all()
    # (the namespace came back with another page size) the stale file is removed, so the put
    # that follows stores the page at its size: left there, a put skips keys the store has
    # and the key would miss for good
    assert b.exists("ns", "kv", ["k"]) == [False] and b.stats()["pages"] == 0
    fill(arena, 0, 512, 7)
    assert b.batch_put("ns", "kv", ["k"], [0], 512) == [True]
    assert b.batch_get("ns", "kv", ["k"], [4096], 512) == [True]
    assert arena.tensor[4096:4608].eq(7).all()


def test_odd_keys_are_hashed_and_found_after_restart(arena, tmp_path):
    b = FileBackend(str(tmp_path))
    b.open(arena)
    key = "tenant a/../../etc/passwd"
    assert file_name(key).startswith("h-")
    fill(arena, 0, 128, 5)
    assert b.batch_put("ns", "kv", [key], [0], 128) == [True]
    b2 = FileBackend(str(tmp_path))
    b2.open(arena)
    assert b2.exists("ns", "kv", [key]) == [True]
    assert b2.batch_get("ns", "kv", [key], [512], 128) == [True]
    assert arena.tensor[512:640].eq(5).all()


def test_pool_names_never_lead_outside_the_root(arena, tmp_path):
    """Clients name pools: "../.." or an absolute path put the daemon's page files anywhere
    it could write (now refused), and a name longer than a path component failed every write
    of its pool (now a digest directory)."""
    root = tmp_path / "l3"
    b = FileBackend(str(root))
    b.open(arena)
    refused = ["../../escaped", "/" + str(tmp_path / "abs"), "..", ".", "a/b", "a\\b"]
    digested = ["p" * 300, "h-x"]  # not a path, but not a plain directory name either
    fill(arena, 0, 128, 7)
    for pool in refused:
        assert pool_dir(pool).startswith("h-") and "/" not in pool_dir(pool)
        assert b.batch_put("ns", pool, ["k"], [0], 128) == [False], pool
        assert b.batch_get("ns", pool, ["k"], [512], 128) == [False]
    for pool in digested:
        assert pool_dir(pool).startswith("h-")
        assert b.batch_put("ns", pool, ["k"], [0], 128) == [True], pool
        assert b.batch_get("ns", pool, ["k"], [512], 128) == [True]
    assert {p.name for p in tmp_path.iterdir()} == {"l3"}
    assert b.exists("ns", "kv@tp0of2", ["k"]) == [False]
    assert pool_dir("kv@tp0of2") == "kv@tp0of2" and pool_dir("kv") == "kv"  # as before


def test_longest_keys_round_trip_and_longer_ones_fail_alone(arena, tmp_path):
    """A key of MAX_KEY_LEN 4-byte characters fits a header and is read back; one no header
    can hold fails on its own: the batch's other pages are stored, no temp file is left."""
    from hicached.protocol import MAX_KEY_LEN
    b = FileBackend(str(tmp_path))
    b.open(arena)
    longest, too_long = "\U0001F600" * MAX_KEY_LEN, "x" * 70000
    fill(arena, 0, 128, 6)
    fill(arena, 128, 128, 7)
    assert b.batch_put("ns", "kv", [longest, too_long, "short"], [0, 128, 128], 128) == [
        True, False, True]
    assert not any(".tmp-" in f for _, _, fs in os.walk(tmp_path) for f in fs)
    b2 = FileBackend(str(tmp_path))
    b2.open(arena)
    assert b2.exists("ns", "kv", [longest, too_long, "short"]) == [True, False, True]
    assert b2.batch_get("ns", "kv", [longest, "short"], [1024, 2048], 128) == [True, True]
    assert arena.tensor[1024:1152].eq(6).all() and arena.tensor[2048:2176].eq(7).all()


def test_leftover_temp_files_are_removed(arena, tmp_path):
    d = tmp_path / "ns" / "kv" / "ab"
    d.mkdir(parents=True)
    (d / "xab.tmp-1-2").write_bytes(b"half a page")
    FileBackend(str(tmp_path))
    assert not (d / "xab.tmp-1-2").exists()


def test_deleted_file_becomes_a_miss(arena, tmp_path):
    b = FileBackend(str(tmp_path))
    b.open(arena)
    b.batch_put("ns", "kv", ["gone"], [0], 64)
    for root, _, files in os.walk(tmp_path):
        for f in files:
            os.unlink(os.path.join(root, f))
    assert b.batch_get("ns", "kv", ["gone"], [0], 64) == [False]
    assert b.exists("ns", "kv", ["gone"]) == [False]


def test_clear_and_registry(arena, tmp_path):
    b = create_backend("file", root=str(tmp_path))
    b.open(arena)
    b.batch_put("ns", "kv", ["a", "b"], [0, 64], 64)
    assert b.clear() == 2
    assert b.exists("ns", "kv", ["a", "b"]) == [False, False]
    with pytest.raises(ValueError, match="unknown L3 backend 'tape'"):
        create_backend("tape")
    none = create_backend("none")
    assert none.exists("ns", "kv", ["a"]) == [False]


def test_clear_namespace_deletes_that_namespaces_files_only(arena, tmp_path):
    b = create_backend("file", root=str(tmp_path))
    b.open(arena)
    fill(arena, 0, 64, 1)
    for ns in ("nsA", "nsB"):
        assert b.batch_put(ns, "kv", ["a", "b"], [0, 64], 64) == [True, True]
    assert b.batch_put("nsA", "mamba", ["a"], [128], 64) == [True]
    per_page = b.used // 5
    assert b.clears_namespaces and b.clear_namespace("nsA") == 3
    assert b.exists("nsA", "kv", ["a", "b"]) + b.exists("nsA", "mamba", ["a"]) == [False] * 3
    assert b.exists("nsB", "kv", ["a", "b"]) == [True, True]
    assert (b.stats()["pages"], b.used) == (2, 2 * per_page)
    assert sum(len(fs) for _, _, fs in os.walk(tmp_path / "nsA")) == 0
    assert b.clear_namespace("nobody") == 0
    fill(arena, 0, 64, 7)
    assert b.batch_get("nsB", "kv", ["a"], [0], 64) == [True]
    assert arena.tensor[:64].eq(1).all()  # B's page came back over it
    assert create_backend("none").clears_namespaces is False


# ---------------------------------------------------------------- bounded space

PB = 256  # page bytes in these tests: each page file counts as one 4 KiB block
ONE = file_bytes("k0", PB)


def page_files(root):
    return sorted(f for _, _, fs in os.walk(root) for f in fs)


def put(b, arena, key, value, offset=0):
    fill(arena, offset, PB, value)
    return b.batch_put("ns", "kv", [key], [offset], PB)


def tick():
    time.sleep(0.02)  # file times move in kernel ticks: order the pages' mtimes


def test_capacity_evicts_the_least_recently_used_page(arena, tmp_path):
    b = FileBackend(str(tmp_path), capacity=3 * ONE, min_free=0)
    b.open(arena)
    for i in range(3):
        assert put(b, arena, f"k{i}", i) == [True]
    assert b.batch_get("ns", "kv", ["k0"], [4096], PB) == [True]  # k0 is used again
    assert put(b, arena, "k3", 3) == [True]
    assert b.exists("ns", "kv", ["k0", "k1", "k2", "k3"]) == [True, False, True, True]
    assert page_files(tmp_path) == ["k0", "k2", "k3"]
    st = b.stats()
    assert st["pages"] == 3 and st["bytes"] == 3 * ONE <= st["capacity"]
    assert st["evictions"] == 1 and st["refused"] == 0
    assert b.batch_get("ns", "kv", ["k1", "k3"], [0, 4096], PB) == [False, True]
    assert arena.tensor[4096:4096 + PB].eq(3).all()


def test_a_restart_keeps_the_lru_order_and_a_smaller_capacity(arena, tmp_path):
    b = FileBackend(str(tmp_path), capacity=4 * ONE, min_free=0)
    b.open(arena)
    for i in range(4):
        put(b, arena, f"k{i}", i)
        tick()
    b.batch_get("ns", "kv", ["k1"], [4096], PB)  # order now k0 k2 k3 k1
    tick()
    b2 = FileBackend(str(tmp_path), capacity=4 * ONE, min_free=0)  # restart: order from mtimes
    b2.open(arena)
    assert put(b2, arena, "k4", 4) == [True]
    assert page_files(tmp_path) == ["k1", "k2", "k3", "k4"]
    b3 = FileBackend(str(tmp_path), capacity=2 * ONE, min_free=0)  # restart with less room
    b3.open(arena)
    assert page_files(tmp_path) == ["k1", "k4"]
    assert b3.stats()["bytes"] == 2 * ONE and b3.stats()["evictions"] == 2
    assert b3.batch_get("ns", "kv", ["k1", "k4"], [0, 4096], PB) == [True, True]
    assert arena.tensor[0:PB].eq(1).all() and arena.tensor[4096:4096 + PB].eq(4).all()


def test_a_page_larger_than_the_capacity_is_refused_and_nothing_is_left(arena, tmp_path):
    b = FileBackend(str(tmp_path), capacity=ONE, min_free=0)
    b.open(arena)
    assert put(b, arena, "small", 1) == [True]
    fill(arena, 0, 8192, 2)
    assert b.batch_put("ns", "kv", ["big"], [0], 8192) == [False]
    assert b.exists("ns", "kv", ["big", "small"]) == [False, True]  # nothing evicted for it
    assert b.stats()["refused"] == 1
    assert not any(".tmp-" in f for f in page_files(tmp_path))


def test_min_free_gives_the_disk_back_before_storing(arena, tmp_path):
    """A filesystem with less free space than ``min_free``: pages already stored are deleted to
    make room, and when that is not enough nothing is stored (puts fail; gets miss)."""
    b = FileBackend(str(tmp_path), capacity="100%", min_free=0)
    b.open(arena)
    for i in range(3):
        put(b, arena, f"k{i}", i)
    fs = os.statvfs(tmp_path)
    b.min_free = fs.f_blocks * fs.f_frsize  # more than the whole filesystem: never fits
    assert put(b, arena, "k3", 3) == [False]
    assert page_files(tmp_path) == []
    assert b.exists("ns", "kv", ["k0", "k3"]) == [False, False]
    st = b.stats()
    assert st["pages"] == 0 and st["bytes"] == 0 and st["evictions"] == 3 and st["refused"] == 1
    b.min_free = 0  # room again: stored again
    assert put(b, arena, "k3", 3) == [True]


def test_capacity_and_min_free_take_sizes_or_shares_of_the_filesystem(tmp_path):
    fs = os.statvfs(tmp_path)
    total = fs.f_blocks * fs.f_frsize
    b = FileBackend(str(tmp_path))
    assert b.capacity == int(total * 0.25) and b.min_free == int(total * 0.05)
    b = FileBackend(str(tmp_path), capacity="1GiB", min_free="0")
    assert b.capacity == 1 << 30 and b.min_free == 0
    for bad in ({"capacity": "150%"}, {"capacity": "x%"}, {"capacity": "0%"},
                {"capacity": 0}, {"min_free": "-1%"}, {"capacity": "lots"}):
        with pytest.raises(ConfigError):
            FileBackend(str(tmp_path), **bad)


def test_a_daemon_keeps_its_file_l3_within_capacity(make_daemon, tmp_path):
    """Write-through of more pages than the file L3 holds: the directory stays within its
    capacity, the newest pages come back after L2 is flushed, the oldest are clean misses."""
    import json

    import torch
    from conftest import wait_until
    from pools import kv_pool, kv_tokens, pages

    from hicached import PoolTransfer

    l3 = tmp_path / "l3"
    src, dst = kv_pool(seed=5), kv_pool()
    page_bytes = src.get_dummy_flat_data_page().numel() * src.get_dummy_flat_data_page().element_size()
    cap = 4 * file_bytes("cap-0", page_bytes)
    d = make_daemon(extra=["--l3-dir", str(l3), "--l3-options",
                           json.dumps({"capacity": cap, "min_free": 0})])
    keys = [f"cap-{i}" for i in range(8)]
    with d.client() as c:
        c.register_mem_host_pool_v2(src, "kv")
        for i in range(0, 8, 2):  # one batch at a time: written in this order
            assert c.batch_set_v1(keys[i:i + 2], pages(i, 2)) == [True, True]
            assert wait_until(lambda i=i: c.stats()["l3_writes"] == i + 2)
        st = c.stats()["l3"]
        assert st["pages"] == 4 and st["bytes"] <= cap and st["evictions"] == 4
        assert len(page_files(l3)) == 4
        c.flush("l2")
        assert c.batch_exists(keys[:4]) == 0
        c.register_mem_host_pool_v2(dst, "kv")
        got = c.batch_get_v2([PoolTransfer("kv", pages(0, 4), keys=keys[4:])])
        assert got == {"kv": [True] * 4}
        assert torch.equal(kv_tokens(dst, 0, 4), kv_tokens(src, 4, 4))
        assert c.batch_get_v1(keys[:2], pages(8, 2)) == [False, False]


def test_a_pool_name_never_leaves_its_namespace_directory(arena, tmp_path):
    """A pool named like a path ("../<other namespace>/kv") is refused by the backend itself:
    it would otherwise write over, and read, another namespace's page files."""
    b = FileBackend(str(tmp_path / "l3"))
    b.open(arena)
    fill(arena, 0, 256, 1)
    assert b.batch_put("nsB", "kv", ["k"], [0], 256) == [True]
    fill(arena, 256, 256, 7)
    for pool in ("../nsB/kv", "..", ".", "a/b", "a\\b", "a\0b", ""):
        assert b.batch_put("nsA", pool, ["k"], [256], 256) == [False]
        assert b.exists("nsA", pool, ["k"]) == [False]
        assert b.batch_get("nsA", pool, ["k"], [512], 256) == [False]
    assert b.batch_get("nsB", "kv", ["k"], [1024], 256) == [True]
    assert arena.tensor[1024:1280].eq(1).all()  # nsB's page, not nsA's
    assert sorted(os.listdir(tmp_path)) == ["l3"]


def test_a_client_cannot_reach_another_namespace_through_a_pool_name(daemon):
    """Tenant A registering the pool "../<B's namespace digest>/kv" is refused, so A's pages
    never replace B's in L3 (before the fix, B read A's bytes once L2 was flushed)."""
    import torch
    from conftest import wait_until
    from pools import kv_pool, kv_tokens, pages

    from hicached.daemon.sessions import namespace_digest
    from hicached.errors import ProtocolError

    keys = [f"p{i}" for i in range(4)]
    own = kv_pool(seed=1)
    with daemon.client("tenant-b") as b:
        b.register_mem_host_pool_v2(own, "kv")
        assert b.batch_set_v1(keys, pages(0, 4)) == [True] * 4
        assert wait_until(lambda: b.stats()["l3_writes"] == 4)
    with daemon.client("tenant-a") as a:
        for pool in (f"../{namespace_digest('tenant-b')}/kv", "..", ".", "x/y", "x\\y"):
            with pytest.raises(ProtocolError, match="pool name"):
                a.register_mem_host_pool_v2(kv_pool(seed=99), pool)
        a.flush("l2")
    dst = kv_pool()
    with daemon.client("tenant-b") as b:
        b.register_mem_host_pool_v2(dst, "kv")
        assert b.batch_get_v1(keys, pages(0, 4)) == [True] * 4
        assert torch.equal(kv_tokens(dst, 0, 4), kv_tokens(own, 0, 4))


def test_bad_options_are_config_errors_and_an_empty_root_is_l3_dir(make_daemon, tmp_path):
    """An unknown or mistyped option named itself only through a Python TypeError; an empty
    root ({"root": ""} over the admin API) put the L3 in the daemon's working directory (under
    systemd: /), whose every file it would scan as a page. Now: ConfigError naming the option,
    and "" means the default, l3_dir, as an empty l3_dir does in the config."""
    from admin_helpers import KEY, admin_daemon, http

    with pytest.raises(ConfigError, match=r"file: unknown option 'capasity'; valid: \['root'"):
        FileBackend(str(tmp_path), capasity="1GiB")
    for root in (5, "", None):
        with pytest.raises(ConfigError, match="file: option 'root' must name a directory"):
            FileBackend(root)
    d, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    attach = "/hicache/storage-backend"
    for opts, error in (({"root": 5}, "option 'root' must name a directory, got 5"),
                        ({"capasity": 1}, "unknown option 'capasity'")):
        status, body = http("PUT", url + attach, {"hicache_storage_backend": "file",
                            "hicache_storage_backend_extra_config_json": json.dumps(opts)}, KEY)
        assert (status, body["code"]) == (400, "config") and error in body["error"], body
    status, body = http("PUT", url + attach, {"hicache_storage_backend": "file",
                        "hicache_storage_backend_extra_config_json": '{"root": ""}'}, KEY)
    assert status == 200, body
    with d.client() as c:
        assert c.stats()["l3"]["pages"] == 0
    assert os.path.isdir(os.path.join(d.state_dir, "l3"))  # l3_dir: <state_dir>/l3


def test_a_restart_deletes_the_pages_of_digest_named_pools(arena, tmp_path):
    """Their directory does not name the pool, so after a restart they are never found again,
    and evictions and clears (which go by pool name) would never delete them: the file L3
    grew past its capacity on disk."""
    def page_files():
        return sorted(f for _, _, fs in os.walk(tmp_path) for f in fs if not f.startswith("."))

    cap = 2 * file_bytes("k0", 256)
    b = FileBackend(str(tmp_path), capacity=cap, min_free=0)
    b.open(arena)
    assert b.batch_put("ns", "p" * 200, ["k0"], [0], 256) == [True]  # a long name: digest dir
    assert b.batch_put("ns", "h-x", ["k1"], [0], 256) == [True]  # ("h-..." too)
    b2 = FileBackend(str(tmp_path), capacity=cap, min_free=0)
    b2.open(arena)
    assert b2.used == 0 and page_files() == []
    assert b2.batch_put("ns", "kv", ["n0", "n1"], [0, 256], 256) == [True, True]
    assert page_files() == ["n0", "n1"]


def test_a_batch_with_changed_pages_misses_those_only(arena, tmp_path):
    """16 pages of 64 KiB, two changed on disk: exactly those miss (counted, removed); every
    other page is verified and lands whole."""
    page, n = 64 << 10, 16
    b = FileBackend(str(tmp_path))
    b.open(arena)
    src = torch.randint(0, 256, (n * page,), dtype=torch.uint8)
    arena.tensor[: n * page] = src
    keys = [f"k{i}" for i in range(n)]
    offsets = [i * page for i in range(n)]
    assert b.batch_put("ns", "kv", keys, offsets, page) == [True] * n
    for i in (3, 12):  # one byte of the page changed on disk
        path = pathlib.Path(b._path("ns", "kv", keys[i]))
        raw = bytearray(path.read_bytes())
        raw[-1 - i] ^= 0x40
        path.write_bytes(bytes(raw))
    arena.tensor[: n * page] = 0
    assert b.batch_get("ns", "kv", keys, offsets, page) == [i not in (3, 12) for i in range(n)]
    for i in range(n):
        if i not in (3, 12):
            assert torch.equal(arena.tensor[i * page : (i + 1) * page],
                               src[i * page : (i + 1) * page])
    st = b.stats()
    assert (st["integrity_failures"], st["verified_loads"], st["pages"]) == (2, 14, 14)
    assert b.exists("ns", "kv", keys) == [i not in (3, 12) for i in range(n)]
    b.close()
