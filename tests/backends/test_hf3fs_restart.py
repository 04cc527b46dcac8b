"""The 3FS backend at start: the root's format marker and the node file are written whole and
read forgivingly (an empty marker, a damaged node file), and a restart with a smaller
``capacity`` than the node holds retires segments down to it."""

import json
import os
import socket

import pytest
from test_hf3fs import capacity_for, fill, make, same

from hicached.backends.hf3fs.format import MARKER
from hicached.backends.hf3fs.records import write_file_atomic
from hicached.errors import ConfigError

P = 4096


def seg_files(root):
    """(path, bytes) of every segment file under ``root``."""
    return [(os.path.join(d, f), os.path.getsize(os.path.join(d, f)))
            for d, _, fs in os.walk(root / "segments") for f in fs if f.endswith(".seg")]


def pointers(root):
    return sorted(f for _, _, fs in os.walk(root / "index") for f in fs)


# ---------------------------------------------------------------- the format marker


def test_the_marker_is_written_whole_and_an_empty_one_again(arena, tmp_path, backends):
    b = make(tmp_path, arena, node="n1")
    b.close()
    assert (tmp_path / MARKER).read_bytes() == b'{"format": 1}\n'
    assert sorted(os.listdir(tmp_path)) == [MARKER, "nodes", "segments"]  # no temp file left
    (tmp_path / MARKER).write_bytes(b"")  # an older version crashed while writing it in place
    b = make(tmp_path, arena, node="n1")
    backends.append(b)
    assert (tmp_path / MARKER).read_bytes() == b'{"format": 1}\n'
    fill(arena, 0, P, 3)
    assert b.batch_put("ns", "kv", ["k"], [0], P) == [True]


@pytest.mark.parametrize("text", [b'{"format": 2}\n', b'{"format": 10}', b'{"form', b"[1]",
                                  b"\xff\xfe"])
def test_a_marker_of_another_format_or_damaged_is_never_overwritten(arena, tmp_path, text):
    (tmp_path / MARKER).write_bytes(text)
    with pytest.raises(ConfigError, match="does not mark format 1"):
        make(tmp_path, arena, node="n1")
    assert (tmp_path / MARKER).read_bytes() == text
    assert not (tmp_path / "nodes").exists()  # refused before anything was written


def test_a_file_written_atomically_without_replace_keeps_the_first(tmp_path):
    path = str(tmp_path / "f")
    assert write_file_atomic(path, b"first", 0o644, replace=False) is True
    assert write_file_atomic(path, b"second", 0o644, replace=False) is False
    assert write_file_atomic(path, b"third", 0o644) is True
    assert (tmp_path / "f").read_bytes() == b"third" and os.listdir(tmp_path) == ["f"]


# ---------------------------------------------------------------- the node file


def node_file(root, node="n1"):
    return root / "nodes" / f"{node}.json"


@pytest.mark.parametrize("damage", ["empty", "cut", "garbage"])
def test_a_damaged_node_file_starts_the_node_afresh(arena, tmp_path, backends, damage):
    a = make(tmp_path, arena, node="n1")
    other = make(tmp_path, arena, node="n2")
    backends.append(other)
    fill(arena, 0, P, 1)
    fill(arena, P, P, 2)
    assert a.batch_put("ns", "kv", ["a", "b"], [0, P], P) == [True, True]
    assert other.batch_put("ns", "kv", ["c"], [P], P) == [True]
    old_uuid, old_dir = a.space.uuid, a.space.dir
    a.close()
    raw = node_file(tmp_path).read_bytes()
    node_file(tmp_path).write_bytes({"empty": b"", "cut": raw[:len(raw) // 2],
                                     "garbage": b'{"uuid": "zz", "epoch": 3}'}[damage])
    a = make(tmp_path, arena, node="n1")
    backends.append(a)
    info = json.loads(node_file(tmp_path).read_text())
    assert a.space.uuid != old_uuid and (info["uuid"], info["epoch"]) == (a.space.uuid.hex(), 1)
    # the former identity's segments and pointers are gone; the other node's stay
    assert not os.path.exists(old_dir) and a.stats()["pages"] == 0
    assert len(pointers(tmp_path)) == 1
    assert a.exists("ns", "kv", ["a", "b", "c"]) == [False, False, True]
    assert a.batch_get("ns", "kv", ["c"], [4 * P], P) == [True] and same(arena, 4 * P, P)
    assert a.batch_put("ns", "kv", ["a"], [0], P) == [True]
    assert other.batch_get("ns", "kv", ["a"], [5 * P], P) == [True] and same(arena, 5 * P, 0)


def test_a_crash_while_writing_the_node_file_leaves_the_old_one(arena, tmp_path, backends,
                                                                 monkeypatch):
    import hicached.backends.hf3fs.records as rec
    a = make(tmp_path, arena, node="n1")
    fill(arena, 0, P, 4)
    assert a.batch_put("ns", "kv", ["a"], [0], P) == [True]
    a.close()
    before = node_file(tmp_path).read_bytes()

    def crash(src, dst):  # the process dies after writing the temp file, before the rename
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(rec.os, "rename", crash)
    with pytest.raises(OSError):
        make(tmp_path, arena, node="n1")
    monkeypatch.undo()
    assert node_file(tmp_path).read_bytes() == before
    assert os.listdir(tmp_path / "nodes") == ["n1.json", "n1.lock"]  # temp file removed
    a = make(tmp_path, arena, node="n1")
    backends.append(a)
    assert json.loads(node_file(tmp_path).read_text())["epoch"] == 2  # the same node goes on
    assert a.batch_get("ns", "kv", ["a"], [P], P) == [True] and same(arena, P, 0)


def test_a_node_file_of_another_host_is_refused(arena, tmp_path):
    make(tmp_path, arena, node="n1").close()
    info = json.loads(node_file(tmp_path).read_text())
    info["host"] = socket.gethostname() + "-elsewhere"
    node_file(tmp_path).write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="belongs to host"):
        make(tmp_path, arena, node="n1")
    assert json.loads(node_file(tmp_path).read_text()) == info


# ---------------------------------------------------------------- a smaller capacity


def filled(root, arena, n_keys, seg_slots=2, **kw):
    """Node n1 with pages k0..k{n-1} (page i filled with i + 1), one put each (write order)."""
    seg = capacity_for(seg_slots)
    b = make(root, arena, node="n1", capacity=n_keys // seg_slots * seg, segment_bytes=seg,
             grace_s=0, **kw)
    for i in range(n_keys):
        fill(arena, i * P, P, i + 1)
        assert b.batch_put("ns", "kv", [f"k{i}"], [i * P], P) == [True]
    return b


def test_a_restart_with_a_smaller_capacity_retires_segments_down_to_it(arena, tmp_path,
                                                                       backends):
    keys = [f"k{i}" for i in range(8)]
    b = filled(tmp_path, arena, 8)
    reader = make(tmp_path, arena, node="n2")
    backends.append(reader)
    assert reader.batch_get("ns", "kv", keys, [(16 + i) * P for i in range(8)], P) == [True] * 8
    assert len(seg_files(tmp_path)) == 4
    b.close()
    cap = 2 * capacity_for(2)
    b = make(tmp_path, arena, node="n1", capacity=cap, segment_bytes=capacity_for(2), grace_s=0)
    backends.append(b)
    st = b.stats()
    assert (st["pages"], st["segments"], st["bytes"]) == (4, 2, cap)
    assert sum(size for _, size in seg_files(tmp_path)) == cap  # deleted from the disk too
    # the newest pages stay, the oldest are gone (their pointers first)
    assert b.exists("ns", "kv", keys) == [False] * 4 + [True] * 4
    assert len(pointers(tmp_path)) == 4
    got = b.batch_get("ns", "kv", keys, [(16 + i) * P for i in range(8)], P)
    assert got == [False] * 4 + [True] * 4
    assert all(same(arena, (16 + i) * P, i * P) for i in range(4, 8))
    # another node that cached pointers into the retired segments: misses or the right page
    fill(arena, 16 * P, 8 * P, 0)
    got = reader.batch_get("ns", "kv", keys, [(16 + i) * P for i in range(8)], P)
    assert got[4:] == [True] * 4
    assert all(same(arena, (16 + i) * P, i * P) for i in range(8) if got[i])
    reader.keys.clear()
    assert reader.exists("ns", "kv", keys) == [False] * 4 + [True] * 4
    # and the bound holds from here on: new pages evict the oldest of the kept ones
    fill(arena, 8 * P, P, 99)
    assert b.batch_put("ns", "kv", ["new"], [8 * P], P) == [True]
    assert b.stats()["bytes"] == cap and b.exists("ns", "kv", ["k4", "new"]) == [False, True]
    assert sum(size for _, size in seg_files(tmp_path)) == cap


def test_segments_retired_at_restart_are_deleted_after_the_grace_period(arena, tmp_path,
                                                                        backends):
    import time
    filled(tmp_path, arena, 6).close()
    cap = capacity_for(2)
    b = make(tmp_path, arena, node="n1", capacity=cap, segment_bytes=capacity_for(2),
             grace_s=0.3)
    backends.append(b)
    assert b.stats()["pages"] == 2 and len(pointers(tmp_path)) == 2
    assert len(seg_files(tmp_path)) == 3  # unreachable now, on disk until the grace passed
    assert b.batch_get("ns", "kv", ["k4", "k5"], [8 * P, 9 * P], P) == [True, True]
    assert same(arena, 8 * P, 4 * P) and same(arena, 9 * P, 5 * P)
    time.sleep(0.35)
    assert b.batch_put("ns", "kv", ["k5"], [5 * P], P) == [True]  # (stored: nothing written)
    assert sum(size for _, size in seg_files(tmp_path)) == cap
    assert b.stats()["segments"] == 1


def test_a_capacity_below_one_segment_retires_them_all(arena, tmp_path, backends):
    filled(tmp_path, arena, 4).close()
    b = make(tmp_path, arena, node="n1", capacity=capacity_for(1), segment_bytes=capacity_for(2),
             grace_s=0)
    backends.append(b)
    assert (b.stats()["pages"], seg_files(tmp_path), pointers(tmp_path)) == (0, [], [])
    fill(arena, 0, P, 7)
    assert b.batch_put("ns", "kv", ["x"], [0], P) == [True]  # a smaller segment now
    assert sum(size for _, size in seg_files(tmp_path)) <= capacity_for(1)
    assert b.batch_get("ns", "kv", ["x"], [P], P) == [True] and same(arena, P, 0)
