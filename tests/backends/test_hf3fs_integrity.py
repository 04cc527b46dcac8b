"""The 3FS backend never serves a corrupted or misplaced page: page bytes changed inside a
segment file under intact stamps (a flipped byte, a cut file, another key's page, zeros) or a
slot of the format before page hashes is a miss, counted, and the key is stored again by the
next put; on this node, another node, after a restart, and through the USRBIO path."""

import logging
import os
import struct
import sys
import zlib

import pytest
import torch
from test_hf3fs import FakeUsrbio, fill, make, same

from hicached.backends.hf3fs.format import (
    HAS_HASH,
    HEAD_MAGIC,
    PAGE_OFF,
    STAMP_BYTES,
    TRAIL_MAGIC,
    key_hash,
    unpack_stamp,
)
from hicached.backends.integrity import identity_seed, page_digest

P = 4096
KEYS = ["k0", "k1", "k2"]


def put_random(b, arena, keys=KEYS, pool="kv"):
    """Store ``keys`` with distinct random pages at arena offsets 0, P, 2P, ..."""
    for i in range(len(keys)):
        arena.tensor[i * P:(i + 1) * P] = torch.randint(0, 256, (P,), dtype=torch.uint8)
    assert b.batch_put("ns", pool, keys, [i * P for i in range(len(keys))], P) == \
        [True] * len(keys)


def page_at(owner, key, pool="kv"):
    """(segment path, file offset of the page bytes) of ``key``'s slot on node ``owner``."""
    slot = owner.space.lookup(key_hash("ns", pool, key))
    return slot.seg.path, slot.seg.head.slot_off(slot.index) + PAGE_OFF


def rw(path, off, data=None, n=P):
    """Read ``n`` bytes at ``off`` of ``path``, or write ``data`` there."""
    with open(path, "r+b") as f:
        f.seek(off)
        if data is None:
            return f.read(n)
        f.write(data)


def flip(path, off):
    rw(path, off, bytes([rw(path, off, n=1)[0] ^ 0x01]))


def damage(how, owner, key, other):
    """Damage ``key``'s page in its segment file on node ``owner`` (``other``: a key of the
    same page size, whose page goes there for "misplaced"); every stamp stays as it was."""
    path, off = page_at(owner, key)
    if how == "flip_middle":
        flip(path, off + P // 2 + 3)
    elif how == "flip_first":
        flip(path, off)
    elif how == "truncate":
        os.truncate(path, off + P // 2)
    elif how == "misplaced":  # another key's page written over this one's (a misdirected write)
        rw(path, off, rw(*page_at(owner, other)))
    elif how == "zeroed":
        rw(path, off, bytes(P))
    else:
        raise AssertionError(how)


HOWS = ["flip_middle", "flip_first", "truncate", "misplaced", "zeroed"]


def check_damaged(b, arena, how, failures_before=0):
    """A get of all three keys: k2 (damaged) misses, its neighbours hit with their bytes."""
    fill(arena, 8 * P, 3 * P, 0)
    got = b.batch_get("ns", "kv", ["k0", "k2", "k1"], [8 * P, 9 * P, 10 * P], P)
    assert got == [True, False, True]
    assert same(arena, 8 * P, 0) and same(arena, 10 * P, P)
    st = b.stats()
    if how == "truncate":  # the file ends inside the page: a read failure, and the slot dead
        assert st["read_failures"] >= 1 and st["dead_pointers"] >= 1
        assert st["integrity_failures"] == failures_before
    else:
        assert st["integrity_failures"] == failures_before + 1
        assert st["integrity_failures_by_pool"] == {"kv": failures_before + 1}
    assert st["unchecked_copies"] == 0


def check_stored_again(b, arena):
    """After the miss: k2 is missing to exists, a put really writes it, a get serves it."""
    assert b.exists("ns", "kv", KEYS) == [True, True, False]
    puts, failures = b.stats()["puts"], b.stats()["integrity_failures"]
    assert b.batch_put("ns", "kv", ["k0", "k2"], [0, 2 * P], P) == [True, True]
    assert b.stats()["puts"] == puts + 1  # k2 written (k0 skipped: stored)
    assert b.exists("ns", "kv", KEYS) == [True] * 3
    fill(arena, 9 * P, P, 0)
    assert b.batch_get("ns", "kv", ["k2"], [9 * P], P) == [True] and same(arena, 9 * P, 2 * P)
    assert b.stats()["integrity_failures"] == failures


# ---------------------------------------------------------------- one node


def test_every_stamp_carries_the_identity_bound_page_hash(arena, tmp_path, backends):
    b = make(tmp_path, arena)
    backends.append(b)
    put_random(b, arena)
    path, off = page_at(b, "k1")
    head = unpack_stamp(HEAD_MAGIC, rw(path, off - STAMP_BYTES, n=STAMP_BYTES))
    trail = unpack_stamp(TRAIL_MAGIC, rw(path, off + P, n=STAMP_BYTES))
    assert head == trail and head.flags & HAS_HASH
    page = arena.view(P, P)
    assert head.data_hash == page_digest(identity_seed("ns", "kv", "k1", P), page)
    assert head.data_hash != page_digest(identity_seed("ns", "kv", "k0", P), page)
    st = b.stats()
    assert (st["integrity_failures"], st["integrity_failures_by_pool"],
            st["unchecked_copies"]) == (0, {}, 0)


@pytest.mark.parametrize("how", HOWS)
def test_a_damaged_page_is_a_miss_and_is_stored_again(arena, tmp_path, backends, how):
    b = make(tmp_path, arena)
    backends.append(b)
    put_random(b, arena)  # k2 is in the last slot: a cut file leaves k0 and k1 whole
    assert b.batch_get("ns", "kv", KEYS, [8 * P, 9 * P, 10 * P], P) == [True] * 3
    damage(how, b, "k2", "k0")
    check_damaged(b, arena, how)
    assert b.batch_get("ns", "kv", ["k2"], [9 * P], P) == [False]  # still a miss
    check_stored_again(b, arena)


def test_a_damaged_page_is_never_served_after_a_restart(arena, tmp_path, backends):
    b = make(tmp_path, arena, node="n1")
    backends.append(b)
    put_random(b, arena)
    damage("flip_middle", b, "k2", "k0")
    b.close()
    b = make(tmp_path, arena, node="n1")  # the slot is live in the directory
    backends.append(b)
    check_damaged(b, arena, "flip_middle")
    b.close()  # before a put replaced it: the damaged slot is still live on disk
    b = make(tmp_path, arena, node="n1")
    backends.append(b)
    check_damaged(b, arena, "flip_middle")
    check_stored_again(b, arena)
    b.close()
    b = make(tmp_path, arena, node="n1")
    backends.append(b)
    fill(arena, 8 * P, 3 * P, 0)
    assert b.batch_get("ns", "kv", KEYS, [8 * P, 9 * P, 10 * P], P) == [True] * 3
    assert all(same(arena, (8 + i) * P, i * P) for i in range(3))
    assert b.stats()["integrity_failures"] == 0


_OLD_STAMP = struct.Struct("<4sIQQ16sQII4x")  # the stamp before page hashes (+ crc32)


def old_stamp(magic, s, page):
    """A stamp as the format before page hashes wrote it, with ``checksum`` on (a CRC-32 of
    the page, flag 1): it cannot be verified now."""
    body = _OLD_STAMP.pack(magic, s.slot, s.gen, s.page_bytes, s.key_hash, s.seg_tag,
                           zlib.crc32(page), 1)
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_slot_of_the_format_before_hashes_is_a_miss_and_is_stored_again(arena, tmp_path,
                                                                          backends):
    b = make(tmp_path, arena)
    backends.append(b)
    put_random(b, arena)
    path, off = page_at(b, "k2")
    head = unpack_stamp(HEAD_MAGIC, rw(path, off - STAMP_BYTES, n=STAMP_BYTES))
    page = rw(path, off)
    rw(path, off - STAMP_BYTES, old_stamp(HEAD_MAGIC, head, page))
    rw(path, off + P, old_stamp(TRAIL_MAGIC, head, page))
    old = unpack_stamp(HEAD_MAGIC, rw(path, off - STAMP_BYTES, n=STAMP_BYTES))
    assert old is not None and old.flags == 0  # decodes, and carries no hash
    fill(arena, 8 * P, 3 * P, 0)
    got = b.batch_get("ns", "kv", ["k0", "k2", "k1"], [8 * P, 9 * P, 10 * P], P)
    assert got == [True, False, True]
    assert same(arena, 8 * P, 0) and same(arena, 10 * P, P)
    st = b.stats()
    assert (st["unchecked_copies"], st["integrity_failures"]) == (1, 0)
    check_stored_again(b, arena)
    assert b.stats()["unchecked_copies"] == 1


# ---------------------------------------------------------------- another node's page


def test_a_damaged_page_of_another_node_is_a_miss_and_stored_here(arena, tmp_path, backends):
    b1 = make(tmp_path, arena, node="n1")
    b2 = make(tmp_path, arena, node="n2", negative_ttl_s=0)  # the put reads the record itself
    backends += [b1, b2]
    put_random(b1, arena)
    assert b2.batch_get("ns", "kv", KEYS, [8 * P, 9 * P, 10 * P], P) == [True] * 3  # cached
    damage("misplaced", b1, "k2", "k1")
    check_damaged(b2, arena, "misplaced")  # through the cached pointer, then the record
    assert b2.stats()["dead_pointers"] == 1
    assert b2.batch_get("ns", "kv", ["k2"], [9 * P], P) == [False]  # the record: known bad
    assert b2.stats()["integrity_failures"] == 1  # (not read again)
    check_stored_again(b2, arena)  # n2's own copy, its pointer replaces n1's
    assert b2.stats()["pages"] == 1
    # n1 still holds its damaged slot: one miss, then it reads n2's copy
    fill(arena, 9 * P, P, 0)
    assert b1.batch_get("ns", "kv", ["k2"], [9 * P], P) == [False]
    assert b1.stats()["integrity_failures"] == 1
    assert b1.batch_get("ns", "kv", ["k2"], [9 * P], P) == [True] and same(arena, 9 * P, 2 * P)
    assert b1.stats()["remote_hits"] == 1


# ---------------------------------------------------------------- USRBIO path, options


def test_a_damaged_page_is_a_miss_through_usrbio(arena, tmp_path, monkeypatch, backends):
    (tmp_path / "3fs-virt" / "iovs").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "hf3fs_py_usrbio", FakeUsrbio(str(tmp_path)))
    b = make(tmp_path / "kv", arena, io="auto", batch_entries=2)  # batches of two: chunks
    backends.append(b)
    assert b.io.name == "usrbio"
    put_random(b, arena)
    damage("flip_first", b, "k2", "k0")
    check_damaged(b, arena, "flip_first")
    check_stored_again(b, arena)


def test_checksum_false_is_ignored_with_a_warning(arena, tmp_path, backends, caplog):
    with caplog.at_level(logging.WARNING, logger="hicached.backends.hf3fs.backend"):
        b = make(tmp_path, arena, checksum=False)
    backends.append(b)
    assert [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()] == [
        "hf3fs: checksum=false is ignored: page checksums are always on"]
    put_random(b, arena)
    damage("flip_middle", b, "k2", "k0")
    check_damaged(b, arena, "flip_middle")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hicached.backends.hf3fs.backend"):
        backends.append(make(tmp_path / "other", arena, checksum=True))
    assert not [r for r in caplog.records if "checksum" in r.getMessage()]
