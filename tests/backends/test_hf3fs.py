"""The 3FS backend on a temp dir: slots, pointers, restart, two nodes, eviction, torn slots,
I/O path selection (a fake USRBIO module), and two real daemons sharing one root."""

import json
import os
import sys
import threading
import time
import types

import pytest
import torch

from hicached.backends import create_backend
from hicached.backends.hf3fs.backend import Hf3fsBackend
from hicached.backends.hf3fs.format import HEAD_OFF, SegmentHeader, slot_bytes_for
from hicached.errors import ConfigError

P = 4096  # page bytes used by most tests


def make(root, arena, **kw):
    kw.setdefault("io", "posix")
    kw.setdefault("lookup_budget_ms", 2000)  # lookups finish within the call on a busy VM
    b = Hf3fsBackend(str(root), **kw)
    b.open(arena)
    return b


def fill(arena, offset, n, value):
    arena.tensor[offset:offset + n] = value


def same(arena, a, b, n=P):
    return torch.equal(arena.tensor[a:a + n], arena.tensor[b:b + n])


def capacity_for(num_slots, page_bytes=P):
    """Capacity of exactly one segment of ``num_slots`` slots of ``page_bytes`` pages."""
    return SegmentHeader.layout(slot_bytes_for(page_bytes), num_slots, b"\0" * 16, 0).file_bytes


# ---------------------------------------------------------------- one node


def test_roundtrip_exists_and_skip(arena, tmp_path, backends):
    b = make(tmp_path, arena)
    backends.append(b)
    for i in range(3):
        arena.tensor[i * P:(i + 1) * P] = torch.randint(0, 256, (P,), dtype=torch.uint8)
    keys = ["k0", "k1", "a key/with odd ../chars" + "x" * 300]
    assert b.batch_put("ns", "kv", keys, [0, P, 2 * P], P) == [True] * 3
    assert b.exists("ns", "kv", keys + ["k3"]) == [True, True, True, False]
    assert b.exists("ns", "mamba", ["k0"]) == [False]
    assert b.exists("other", "kv", ["k0"]) == [False]
    got = b.batch_get("ns", "kv", [keys[2], "k3", keys[0]], [8 * P, 9 * P, 10 * P], P)
    assert got == [True, False, True]
    assert same(arena, 8 * P, 2 * P) and same(arena, 10 * P, 0)
    assert b.batch_put("ns", "kv", keys + ["k0"], [0, P, 2 * P, 0], P) == [True] * 4
    st = b.stats()
    assert (st["puts"], st["pages"], st["page_bytes"], st["io"]) == (3, 3, 3 * P, "posix")
    assert st["verify_failures"] == st["read_failures"] == 0
    assert st["bytes"] <= st["capacity"] == 64 << 30


def test_wrong_size_is_a_miss(arena, tmp_path, backends):
    b = make(tmp_path, arena)
    backends.append(b)
    fill(arena, 0, P, 9)
    assert b.batch_put("ns", "kv", ["k"], [0], P) == [True]
    fill(arena, 4 * P, 2 * P, 0)
    assert b.batch_get("ns", "kv", ["k"], [4 * P], 2 * P) == [False]
    assert b.batch_get("ns", "kv", ["k"], [4 * P], P // 2) == [False]
    assert arena.tensor[4 * P:6 * P].eq(0).all()
    assert b.stats()["size_mismatches"] == 2


def test_restart_finds_pages_from_the_segment_directory(arena, tmp_path, backends):
    b = make(tmp_path, arena, node="n1")
    fill(arena, 0, P, 1)
    fill(arena, P, P, 2)
    assert b.batch_put("ns", "kv", ["a", "b"], [0, P], P) == [True, True]
    b.close()
    b.close()  # idempotent
    b2 = make(tmp_path, arena, node="n1")
    backends.append(b2)
    st = b2.stats()
    assert (st["pages"], st["lookups"]) == (2, 0)  # known from the directory, no lookups
    assert b2.exists("ns", "kv", ["a", "b", "c"]) == [True, True, False]
    assert b2.batch_get("ns", "kv", ["b", "a"], [4 * P, 5 * P], P) == [True, True]
    assert same(arena, 4 * P, P) and same(arena, 5 * P, 0)
    with open(tmp_path / "nodes" / "n1.json") as f:
        assert json.load(f)["epoch"] == 2  # generations of the new run never repeat old ones


def test_same_node_twice_on_one_host_is_an_error(arena, tmp_path, backends):
    first = make(tmp_path, arena, node="n1")
    backends.append(first)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="in use by another daemon"):
        make(tmp_path, arena, node="n1", lock_wait_s=0.5)
    assert time.monotonic() - t0 >= 0.45  # it waited for a holder that might be closing
    threading.Timer(0.3, first.close).start()  # a detached backend, closed a moment later
    backends.append(make(tmp_path, arena, node="n1"))


# ---------------------------------------------------------------- two nodes on one root


def test_two_nodes_see_each_others_pages(arena, tmp_path, backends):
    b1, b2 = make(tmp_path, arena, node="n1"), make(tmp_path, arena, node="n2")
    backends += [b1, b2]
    fill(arena, 0, P, 7)
    fill(arena, P, P, 8)
    assert b1.batch_put("ns", "kv", ["x"], [0], P) == [True]
    assert b2.exists("ns", "kv", ["x", "y"]) == [True, False]
    assert b2.batch_get("ns", "kv", ["x"], [4 * P], P) == [True]
    assert same(arena, 4 * P, 0)
    assert b2.stats()["remote_hits"] == 1
    # a key the other node stored is skipped; a new one is written by this node
    assert b2.batch_put("ns", "kv", ["x", "y"], [0, P], P) == [True, True]
    assert (b2.stats()["puts"], b2.stats()["pages"]) == (1, 1)
    assert b1.batch_get("ns", "kv", ["y"], [5 * P], P) == [True]
    assert same(arena, 5 * P, P)
    segs = sorted(os.listdir(tmp_path / "segments"))
    assert segs == sorted([b1.space.uuid.hex(), b2.space.uuid.hex()])


def test_clear_removes_every_nodes_pages(arena, tmp_path, backends):
    b1, b2 = make(tmp_path, arena, node="n1"), make(tmp_path, arena, node="n2")
    backends += [b1, b2]
    b1.batch_put("ns", "kv", ["a", "b"], [0, P], P)
    b2.batch_put("ns", "kv", ["c"], [0], P)
    assert b1.clear() == 3
    assert b1.exists("ns", "kv", ["a", "b", "c"]) == [False] * 3
    assert b1.stats()["pages"] == 0
    b2.wipe_check_s = 0
    assert b2.batch_get("ns", "kv", ["c"], [4 * P], P) == [False]  # b2 notices and resets
    assert b2.stats()["pages"] == 0
    assert b2.batch_put("ns", "kv", ["c"], [0], P) == [True]  # and keeps working
    assert b1.batch_get("ns", "kv", ["c"], [4 * P], P) == [True]


# ---------------------------------------------------------------- capacity and eviction


def test_eviction_keeps_the_bound_in_lru_order(arena, tmp_path, backends):
    cap = capacity_for(4)
    b = make(tmp_path, arena, capacity=cap, grace_s=0)
    backends.append(b)
    for i in range(6):
        fill(arena, i * P, P, i + 1)
    assert b.batch_put("ns", "kv", ["k0", "k1", "k2", "k3"], [0, P, 2 * P, 3 * P], P) == [True] * 4
    assert b.batch_get("ns", "kv", ["k0"], [8 * P], P) == [True]  # k0 is now the newest
    assert b.batch_put("ns", "kv", ["k4", "k5"], [4 * P, 5 * P], P) == [True, True]
    st = b.stats()
    assert (st["pages"], st["evictions"], st["segments"]) == (4, 2, 1)
    assert st["bytes"] == cap
    assert b.exists("ns", "kv", [f"k{i}" for i in range(6)]) == [True, False, False, True,
                                                                True, True]
    assert b.batch_get("ns", "kv", ["k1", "k2"], [8 * P, 9 * P], P) == [False, False]
    got = b.batch_get("ns", "kv", ["k0", "k3", "k4", "k5"], [8 * P, 9 * P, 10 * P, 11 * P], P)
    assert got == [True] * 4
    assert all(same(arena, (8 + j) * P, i * P) for j, i in enumerate([0, 3, 4, 5]))
    index = [f for _, _, fs in os.walk(tmp_path / "index") for f in fs]
    assert len(index) == 4  # evicted pages' pointers are gone


def test_eviction_waits_out_the_grace_period(arena, tmp_path, backends):
    b = make(tmp_path, arena, capacity=capacity_for(2), grace_s=0.3)
    backends.append(b)
    assert b.batch_put("ns", "kv", ["a", "b"], [0, P], P) == [True, True]
    t0 = time.monotonic()
    assert b.batch_put("ns", "kv", ["c"], [2 * P], P) == [True]
    assert time.monotonic() - t0 >= 0.25  # the evicted slot was not reused at once
    # at capacity one more slot is kept in quarantine ahead of the next write
    assert b.exists("ns", "kv", ["a", "b", "c"]) == [False, False, True]
    assert (b.stats()["evictions"], b.stats()["alloc_waits"]) == (2, 1)
    time.sleep(0.3)
    assert b.batch_put("ns", "kv", ["d"], [3 * P], P) == [True]
    assert b.stats()["alloc_waits"] == 1  # its quarantine had passed: no wait


def test_a_new_page_size_takes_space_from_another_class(arena, tmp_path, backends):
    b = make(tmp_path, arena, capacity=capacity_for(3), grace_s=0)
    backends.append(b)
    assert b.batch_put("ns", "kv", ["a", "b", "c"], [0, P, 2 * P], P) == [True] * 3
    fill(arena, 4 * P, 2 * P, 5)
    assert b.batch_put("ns", "mamba", ["m"], [4 * P], 2 * P) == [True]
    st = b.stats()
    assert st["bytes"] <= st["capacity"] and st["pages"] == 1
    assert b.exists("ns", "kv", ["a", "b", "c"]) == [False] * 3
    assert b.batch_get("ns", "mamba", ["m"], [8 * P], 2 * P) == [True]
    assert same(arena, 8 * P, 4 * P, 2 * P)


def test_a_page_larger_than_the_capacity_is_not_stored(arena, tmp_path, backends):
    b = make(tmp_path, arena, capacity=capacity_for(1))
    backends.append(b)
    assert b.batch_put("ns", "kv", ["big"], [0], 4 * P) == [False]
    assert b.stats()["no_space"] == 1


# ---------------------------------------------------------------- torn and recycled slots


def _slot_file_off(b, key, pool="kv"):
    from hicached.backends.hf3fs.format import key_hash

    slot = b.space.lookup(key_hash("ns", pool, key))
    return slot.seg.path, slot.seg.head.slot_off(slot.index)


def test_a_recycled_slot_behind_a_cached_pointer_is_a_miss(arena, tmp_path, backends):
    b1 = make(tmp_path, arena, node="n1", capacity=capacity_for(1), grace_s=0)
    b2 = make(tmp_path, arena, node="n2")
    backends += [b1, b2]
    fill(arena, 0, P, 1)
    fill(arena, P, P, 2)
    assert b1.batch_put("ns", "kv", ["a"], [0], P) == [True]
    assert b2.batch_get("ns", "kv", ["a"], [4 * P], P) == [True]  # b2 caches a's pointer
    assert b1.batch_put("ns", "kv", ["b"], [P], P) == [True]  # evicts a, reuses its slot
    fill(arena, 4 * P, P, 0)
    assert b2.batch_get("ns", "kv", ["a"], [4 * P], P) == [False]
    assert b2.stats()["verify_failures"] == 1
    assert b2.exists("ns", "kv", ["a"]) == [False]  # the re-read pointer is gone
    assert b2.batch_get("ns", "kv", ["b"], [4 * P], P) == [True]
    assert same(arena, 4 * P, P)


def test_a_torn_head_stamp_is_a_miss(arena, tmp_path, backends):
    b = make(tmp_path, arena)
    backends.append(b)
    b.batch_put("ns", "kv", ["a"], [0], P)
    path, off = _slot_file_off(b, "a")
    with open(path, "r+b") as f:
        f.seek(off + HEAD_OFF + 8)
        f.write(b"\xff")  # a head stamp half overwritten by a new generation
    assert b.batch_get("ns", "kv", ["a"], [4 * P], P) == [False]
    assert b.stats()["verify_failures"] == 1


def test_checksum_catches_page_bytes_changed_under_intact_stamps(arena, tmp_path, backends):
    b = make(tmp_path, arena, checksum=True)
    backends.append(b)
    fill(arena, 0, P, 3)
    b.batch_put("ns", "kv", ["a"], [0], P)
    assert b.batch_get("ns", "kv", ["a"], [4 * P], P) == [True]
    path, off = _slot_file_off(b, "a")
    with open(path, "r+b") as f:
        f.seek(off + 4096 + 100)
        f.write(b"\x00")
    assert b.batch_get("ns", "kv", ["a"], [4 * P], P) == [False]


def test_overwrite_between_read_and_recheck_is_a_miss(arena, tmp_path, backends):
    """The slot is recycled after the page read but before the head is read again: the page
    read looked consistent, the second head read catches it (the seqlock step)."""
    b1 = make(tmp_path, arena, node="n1", capacity=capacity_for(1), grace_s=0)
    b2 = make(tmp_path, arena, node="n2")
    backends += [b1, b2]
    fill(arena, 0, P, 1)
    fill(arena, P, P, 2)
    b1.batch_put("ns", "kv", ["a"], [0], P)
    real = b2.io.submit
    calls = []

    def submit(lane, write, ops):
        res = real(lane, write, ops)
        calls.append(len(ops[0].parts) if ops else 0)
        if lane == "get" and ops and len(ops[0].parts) == 3:
            assert b1.batch_put("ns", "kv", ["b"], [P], P) == [True]  # recycles a's slot
        return res

    b2.io.submit = submit
    assert b2.batch_get("ns", "kv", ["a"], [4 * P], P) == [False]
    assert calls[:2] == [3, 1]  # page read, then the head read again
    assert b2.stats()["verify_failures"] == 1


def test_concurrent_overwrites_never_yield_wrong_bytes(arena, tmp_path, backends):
    page = 128 << 10
    b1 = make(tmp_path, arena, node="n1", capacity=capacity_for(1, page), grace_s=0)
    b2 = make(tmp_path, arena, node="n2")
    backends += [b1, b2]
    fill(arena, 0, page, 0xAA)
    fill(arena, page, page, 0xBB)
    expect = {"a": 0xAA, "b": 0xBB}
    stop = threading.Event()
    wrong, hits, writes = [], [0], [0]

    def writer():  # one slot: every put evicts the other key and recycles the slot
        while not stop.is_set():
            for k, off in (("a", 0), ("b", page)):
                writes[0] += sum(b1.batch_put("ns", "kv", [k], [off], page))
                time.sleep(0.0005)  # a stable moment now and then, so reads also hit

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for k in ("a", "b"):
                fill(arena, 4 * page, page, 0)
                if b2.batch_get("ns", "kv", [k], [4 * page], page) == [True]:
                    hits[0] += 1
                    if not arena.tensor[4 * page:5 * page].eq(expect[k]).all():
                        wrong.append(k)
    finally:
        stop.set()
        t.join()
    assert wrong == []
    assert writes[0] > 10 and hits[0] > 0


# ---------------------------------------------------------------- options and I/O selection


def test_bad_options(arena, tmp_path):
    with pytest.raises(ConfigError, match="'root'.*required"):
        create_backend("hf3fs")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a writable directory"):
        create_backend("hf3fs", root=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="unknown option 'capacty'"):
        create_backend("hf3fs", root=str(tmp_path), capacty="1GiB")
    with pytest.raises(ConfigError, match="io must be"):
        create_backend("hf3fs", root=str(tmp_path), io="tape")
    with pytest.raises(ConfigError, match="capacity"):
        create_backend("hf3fs", root=str(tmp_path), capacity="lots")
    with pytest.raises(ConfigError, match="grace_s"):
        create_backend("hf3fs", root=str(tmp_path), grace_s=-1)
    b = create_backend("hf3fs", root=str(tmp_path), io="posix", capacity="1MiB",
                       file_mode="0o640")
    assert b.stats()["capacity"] == 1 << 20
    b.close()


def test_usrbio_missing_falls_back_to_posix(arena, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hf3fs_py_usrbio", None)  # import raises ImportError
    with pytest.raises(ConfigError, match="io='usrbio' needs the hf3fs_py_usrbio module"):
        create_backend("hf3fs", root=str(tmp_path), io="usrbio")
    b = create_backend("hf3fs", root=str(tmp_path))  # io="auto"
    assert (b.io.name, b.io_reason) == ("posix", "hf3fs_py_usrbio not importable")
    b.close()


class FakeUsrbio(types.ModuleType):
    """The slice of ``hf3fs_py_usrbio`` the backend uses, served by pread/pwrite: Iovs need
    their /dev/shm symlink, fds must be registered, rings run ops at ``wait``."""

    def __init__(self, mount):
        super().__init__("hf3fs_py_usrbio")
        self.mount, self.registered, self.ios = mount, set(), 0
        fake = self

        class iovec:
            def __init__(self, buf, iov_id, mount, block_size=0, numa=-1, _view=None):
                if _view is None:
                    link = os.path.join(mount, "3fs-virt", "iovs", iov_id)
                    assert os.readlink(link).startswith("/dev/shm/"), link
                self.view = memoryview(buf).cast("B") if _view is None else _view

            def __getitem__(self, s):
                return iovec(None, "", "", _view=self.view[s])

        class ioring:
            def __init__(self, mount, entries, for_read=True, *args):
                self.entries, self.for_read, self.queued = entries, for_read, []

            def prepare(self, iov, read, fd, off, userdata=None):
                assert read == self.for_read and fd in fake.registered
                assert len(self.queued) < self.entries
                self.queued.append((iov.view, fd, off, userdata))

            def submit(self):
                return self

            def wait(self, max_results=0, min_results=0, timeout=None):
                done, self.queued = self.queued, []
                fake.ios += len(done)
                out = []
                for view, fd, off, ud in done:
                    n = os.preadv(fd, [view], off) if self.for_read else os.pwritev(fd, [view],
                                                                                     off)
                    out.append(types.SimpleNamespace(result=n, userdata=ud))
                return out

        self.iovec, self.ioring = iovec, ioring

    def extract_mount_point(self, path):
        return self.mount if self.mount and path.startswith(self.mount) else None

    def register_fd(self, fd, flags=0):
        self.registered.add(fd)

    def deregister_fd(self, fd):
        self.registered.discard(fd)


def test_usrbio_selected_when_importable_and_on_a_mount(arena, tmp_path, monkeypatch, backends):
    (tmp_path / "3fs-virt" / "iovs").mkdir(parents=True)
    fake = FakeUsrbio(str(tmp_path))
    monkeypatch.setitem(sys.modules, "hf3fs_py_usrbio", fake)
    b = make(tmp_path / "kv", arena, io="auto", batch_entries=2)
    backends.append(b)
    assert (b.io.name, b.stats()["io"]) == ("usrbio", "usrbio")
    assert len(os.listdir(tmp_path / "3fs-virt" / "iovs")) == 3  # arena + two scratch lanes
    for i in range(3):
        fill(arena, i * P, P, 10 + i)
    assert b.batch_put("ns", "kv", ["a", "b", "c"], [0, P, 2 * P], P) == [True] * 3
    assert b.batch_get("ns", "kv", ["c", "a", "b"], [8 * P, 9 * P, 10 * P], P) == [True] * 3
    assert same(arena, 8 * P, 2 * P) and same(arena, 9 * P, 0) and same(arena, 10 * P, P)
    # put: head, then page + trail; get: head + page + trail, then head again (one io a part)
    assert fake.ios == 3 * (3 + 4)
    b.close()
    assert os.listdir(tmp_path / "3fs-virt" / "iovs") == []
    # the same module, a root outside its mount: POSIX
    fake.mount = str(tmp_path / "elsewhere")
    b2 = create_backend("hf3fs", root=str(tmp_path / "kv"))
    assert (b2.io.name, b2.io_reason) == ("posix", f"{tmp_path / 'kv'} is not on a 3FS mount")
    b2.close()
    with pytest.raises(ConfigError, match="not on a 3FS mount"):
        create_backend("hf3fs", root=str(tmp_path / "kv"), io="usrbio")


# ---------------------------------------------------------------- two real daemons


def test_direct_io_is_chosen_for_fuse_mounts():
    from hicached.backends.hf3fs.io import mount_fstype, wants_direct

    info = ("22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
            "90 22 0:50 / /mnt/3fs rw,nosuid shared:40 - fuse.hf3fs_fuse_main hf3fs.stage rw\n"
            "91 22 0:51 / /mnt/3fs\\040b rw shared:41 - tmpfs tmpfs rw\n")
    assert mount_fstype("/mnt/3fs/kv/index", info) == "fuse.hf3fs_fuse_main"
    assert mount_fstype("/mnt/3fs b/x", info) == "tmpfs"
    assert mount_fstype("/mnt/3fsx", info) == "ext4"
    assert wants_direct(True, "/") and not wants_direct(False, "/")
    assert wants_direct("auto", "/proc") is False  # procfs, not FUSE


def test_a_failed_write_gives_its_slot_back(arena, tmp_path, backends):
    b = make(tmp_path, arena, capacity=capacity_for(1), grace_s=0)
    backends.append(b)
    real = b.io.submit
    b.io.submit = lambda lane, write, ops: [-5] * len(ops) if write else real(lane, write, ops)
    assert b.batch_put("ns", "kv", ["a"], [0], P) == [False]
    assert b.exists("ns", "kv", ["a"]) == [False]
    b.io.submit = real
    assert b.batch_put("ns", "kv", ["a"], [0], P) == [True]  # the only slot was returned
    st = b.stats()
    assert (st["put_failures"], st["puts"], st["pages"]) == (1, 1, 1)


def test_restart_after_eviction_keeps_free_slots_free(arena, tmp_path, backends):
    b = make(tmp_path, arena, node="n1", capacity=capacity_for(2), grace_s=0)
    for i, k in enumerate("abc"):
        fill(arena, i * P, P, i + 1)
        assert b.batch_put("ns", "kv", [k], [i * P], P) == [True]
    b.close()
    b2 = make(tmp_path, arena, node="n1", capacity=capacity_for(2), grace_s=0)
    backends.append(b2)
    assert b2.stats()["pages"] == 2
    assert b2.exists("ns", "kv", ["a", "b", "c"]) == [False, True, True]
    assert b2.batch_put("ns", "kv", ["d"], [3 * P], P) == [True]  # evicts b, the oldest
    assert b2.exists("ns", "kv", ["b", "c", "d"]) == [False, True, True]
    got = b2.batch_get("ns", "kv", ["c", "d"], [8 * P, 9 * P], P)
    assert got == [True, True] and same(arena, 8 * P, 2 * P) and same(arena, 9 * P, 3 * P)
