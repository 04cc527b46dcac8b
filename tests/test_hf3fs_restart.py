"""The 3FS backend at start: the root's format marker and the node file are written whole and
read forgivingly (an empty marker, a damaged node file)."""

import json
import os
import socket

import pytest
from test_hf3fs import fill, make, same

from hicached.backends.hf3fs_format import MARKER
from hicached.backends.hf3fs_records import write_file_atomic
from hicached.errors import ConfigError

P = 4096


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
    import hicached.backends.hf3fs_records as rec
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
