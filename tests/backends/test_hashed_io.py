"""How L3 copies are hashed as they move: ``read_hashed`` / ``write_hashed`` (a page in pieces,
each hashed while in cache) give the whole page's digest at every size, and ``HashAhead`` (a
batch's digests on a helper thread while the writer writes) gives every page its own."""

import os

import numpy as np
import pytest
import torch

from hicached.arena import Arena
from hicached.backends.file import FileBackend, file_name
from hicached.backends.integrity import (
    HASH_AHEAD_MIN,
    HASH_PIECE,
    HashAhead,
    HashedBatch,
    digests,
    page_digest,
    read_hashed,
    write_hashed,
)

SIZES = [1, 4096, HASH_PIECE - 1, HASH_PIECE, HASH_PIECE + 1, 3 * HASH_PIECE + 7]


def _page(n: int, seed: int) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("size", SIZES)
def test_write_then_read_gives_the_page_and_its_digest(tmp_path, size):
    page, seed, pos = _page(size, size), 0x5EED + size, 37
    fd = os.open(tmp_path / "p", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert write_hashed(fd, memoryview(page), pos, seed) == page_digest(seed, page)
        assert os.fstat(fd).st_size == pos + size  # the bytes went at pos, nothing more
        out = bytearray(size)
        n, digest = read_hashed(fd, memoryview(out), pos, seed)
        assert (n, digest) == (size, page_digest(seed, page))
        assert out == page
        assert read_hashed(fd, memoryview(out), pos, seed + 1)[1] != page_digest(seed, page)
    finally:
        os.close(fd)


def test_a_short_file_reads_short_and_its_digest_is_of_what_was_read(tmp_path):
    page = _page(2 * HASH_PIECE + 100, 3)
    (tmp_path / "p").write_bytes(bytes(page[: HASH_PIECE + 10]))
    fd = os.open(tmp_path / "p", os.O_RDONLY)
    try:
        out = bytearray(len(page))
        n, digest = read_hashed(fd, memoryview(out), 0, 9)
    finally:
        os.close(fd)
    assert n == HASH_PIECE + 10
    assert digest == page_digest(9, page[:n]) != page_digest(9, page)


def test_hash_ahead_gives_each_page_its_digest_in_order():
    hasher = HashAhead()
    try:
        pages = [_page(HASH_AHEAD_MIN + i, i) for i in range(5)]
        batch = hasher.start([(i, memoryview(p)) for i, p in enumerate(pages)])
        assert [batch.get(i) for i in (4, 0, 2, 1, 3)] == [
            page_digest(i, pages[i]) for i in (4, 0, 2, 1, 3)]
        assert hasher.start() is None  # one batch at a time: that caller hashes its own
        batch.cancel()
        # the next batch on the same thread, its pages added as they are read
        again = hasher.start()
        assert [again.add(7, memoryview(pages[0])), again.add(8, memoryview(pages[1]))] == [0, 1]
        assert again.get(1) == page_digest(8, pages[1])
        assert again.get(0) == page_digest(7, pages[0])
        again.cancel()
        # one cancelled before its hashes: no wait, None
        stopped = HashedBatch([(1, memoryview(pages[1]))])  # never started
        stopped.cancel()
        assert stopped.get(0) is None
    finally:
        hasher.close()


@pytest.mark.parametrize("page_bytes", [4096, 2 * HASH_AHEAD_MIN + 64])
def test_a_batch_hashed_ahead_verifies_and_a_flipped_byte_still_misses(tmp_path, shm_path,
                                                                        page_bytes):
    arena = Arena.create(shm_path, 16 * page_bytes)
    b = FileBackend(str(tmp_path))
    try:
        b.open(arena)
        keys = [f"k{i}" for i in range(4)] + ["k1"]  # k1 twice: stored once
        src = torch.randint(0, 256, (4 * page_bytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(page_bytes))
        arena.tensor[: 4 * page_bytes] = src
        offsets = [i * page_bytes for i in range(4)] + [page_bytes]
        assert b.batch_put("ns", "kv", keys, offsets, page_bytes) == [True] * 5
        assert b.stats()["pages"] == 4
        path = next(p for p in tmp_path.rglob("*") if p.is_file() and p.name == file_name("k2"))
        raw = bytearray(path.read_bytes())
        raw[-page_bytes // 2] ^= 1
        path.write_bytes(bytes(raw))
        back = [8 * page_bytes + i * page_bytes for i in range(4)]
        assert b.batch_get("ns", "kv", keys[:4], back, page_bytes) == [True, True, False, True]
        for i in (0, 1, 3):
            assert torch.equal(arena.tensor[back[i]:back[i] + page_bytes],
                               src[i * page_bytes:(i + 1) * page_bytes])
        assert b.integrity.failures == 1
    finally:
        b.close()
        arena.close()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_digests_in_two_halves_are_each_pages_own(n):
    pages = [_page(HASH_AHEAD_MIN, 40 + i) for i in range(n)]
    items = [(i, memoryview(p)) for i, p in enumerate(pages)]
    want = [page_digest(i, p) for i, p in enumerate(pages)]
    hasher = HashAhead()
    try:
        assert digests(hasher, items) == want
        assert digests(hasher, items) == want  # the helper free again after a batch
        assert digests(None, items) == want
    finally:
        hasher.close()
