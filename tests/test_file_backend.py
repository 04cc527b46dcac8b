"""The embedded file L3: atomic page files, restart scan, header checks, misses not errors."""

import os

import pytest

from hicached.backends import create_backend
from hicached.backends.file import FileBackend, file_name


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
