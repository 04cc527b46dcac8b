"""Open files of the 3FS backend: any number of segments through a bounded fd table (an fd in
use is never closed), under a low RLIMIT_NOFILE, and the daemon raising its soft limit."""

import json
import os
import resource
import subprocess
import sys

from test_hf3fs import capacity_for, fill, make, same

from hicached.backends.hf3fs.fds import FdTable, fd_budget
from hicached.backends.hf3fs.io import PosixIO

P = 4096


def test_an_fd_in_use_is_never_closed(tmp_path):
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"s{i}"))
        with open(paths[-1], "wb") as f:
            f.write(bytes([i]) * 8)
    t = FdTable(PosixIO(), max_open=1)
    h0 = t.acquire(("n", 0), paths[0])
    h1 = t.acquire(("n", 1), paths[1])  # over the cap: h0 is in use, so it stays open
    assert len(t) == 2 and os.pread(h0.fd, 1, 0) == b"\0" and os.pread(h1.fd, 1, 0) == b"\1"
    t.release(h0)
    t.release(h1)
    h2 = t.acquire(("n", 2), paths[2])  # room made: both unused ones closed, oldest first
    assert len(t) == 1 and t.closes == 2 and os.pread(h2.fd, 1, 0) == b"\2"
    t.release(h2)
    again = t.acquire(("n", 0), paths[0])  # closed before: opened again on use
    assert os.pread(again.fd, 1, 0) == b"\0" and t.opens == 4
    t.drop(("n", 0))  # a retired segment: closed once its user releases it
    os.fstat(again.fd)
    t.release(again)
    assert len(t) == 0
    t.drop_all()


def test_many_segments_through_a_few_open_files(arena, tmp_path, backends):
    seg = capacity_for(2)
    keys = [f"k{i}" for i in range(40)]
    a = make(tmp_path, arena, node="A", capacity=20 * seg, segment_bytes=seg, max_open_files=4,
             grace_s=0)
    backends.append(a)
    for start in range(0, 40, 8):  # batches spanning several segments each
        for i in range(start, start + 8):
            fill(arena, i * P, P, i + 1)
        assert a.batch_put("ns", "kv", keys[start:start + 8], [i * P for i in range(start,
                                                                                   start + 8)],
                           P) == [True] * 8
        assert len(a.fds) <= 4
    st = a.stats()
    assert (st["segments"], st["pages"], st["evictions"], st["max_open_files"]) == (20, 40, 0, 4)
    assert st["fd_closes"] >= 16
    reader = make(tmp_path, arena, node="B", max_open_files=3)
    backends.append(reader)
    for b in (a, reader):
        for order in (range(40), reversed(range(40))):
            order = list(order)
            got = b.batch_get("ns", "kv", [keys[i] for i in order],
                              [(48 + j) * P for j in range(40)], P)
            assert got == [True] * 40
            assert all(same(arena, (48 + j) * P, i * P) for j, i in enumerate(order))
            assert len(b.fds) <= b.fds.max_open
    a.close()
    a = make(tmp_path, arena, node="A", capacity=20 * seg, segment_bytes=seg, max_open_files=4)
    backends.append(a)
    assert a.stats()["pages"] == 40 and len(a.fds) <= 4
    assert a.batch_get("ns", "kv", keys, [(48 + i) * P for i in range(40)], P) == [True] * 40
    assert all(same(arena, (48 + i) * P, i * P) for i in range(40))


# Under a soft RLIMIT_NOFILE of 64: 100 segments of one slot each, written, read back, and the
# node reopened, with "auto" (32 open at most).
LOW_LIMIT = r"""
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from hicached.arena import Arena
from hicached.backends.hf3fs.backend import Hf3fsBackend
from hicached.backends.hf3fs.format import SegmentHeader, slot_bytes_for
root, shm = sys.argv[1], sys.argv[2]
P, N = 4096, 100
arena = Arena.create(shm, 1 << 20)
seg = SegmentHeader.layout(slot_bytes_for(P), 1, bytes(16), 0).file_bytes
opts = dict(io="posix", capacity=N * seg, segment_bytes=seg, grace_s=0, lookup_budget_ms=2000)
out = {}
b = Hf3fsBackend(root, node="A", **opts)
b.open(arena)
ok = 0
for i in range(N):
    arena.tensor[0:P] = i % 251
    ok += b.batch_put("ns", "kv", [f"k{i}"], [0], P) == [True]
good = 0
for i in range(N):
    good += (b.batch_get("ns", "kv", [f"k{i}"], [P], P) == [True]
             and bool(arena.tensor[P:2 * P].eq(i % 251).all()))
st = b.stats()
out["run1"] = [ok, good, st["segments"], st["evictions"], st["open_files"], st["max_open_files"]]
b.close()
b = Hf3fsBackend(root, node="A", **opts)
b.open(arena)
keys = [f"k{i}" for i in range(N)]
got = b.batch_get("ns", "kv", keys, [(2 + i) * P for i in range(N)], P)
good = sum(g and bool(arena.tensor[(2 + i) * P:(3 + i) * P].eq(i % 251).all())
           for i, g in enumerate(got))
out["run2"] = [b.stats()["pages"], good]
b.close()
arena.close()
print(json.dumps(out))
"""

# FdTable with a cap far above the limit: the open that finds EMFILE closes the unused fds,
# lowers the cap and goes on.
EMFILE = r"""
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from hicached.backends.hf3fs.fds import FdTable
from hicached.backends.hf3fs.io import PosixIO
t = FdTable(PosixIO(), max_open=1000)
good = 0
for i in range(200):
    path = os.path.join(sys.argv[1], f"f{i}")
    fd = t.open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) if i % 2 else -1
    if fd < 0:
        with open(path, "wb") as f:
            f.write(i.to_bytes(2, "little"))
    h = t.acquire(("n", i), path, writable=True, fd=fd)
    if fd >= 0:
        os.pwrite(h.fd, i.to_bytes(2, "little"), 0)
    good += os.pread(h.fd, 2, 0) == i.to_bytes(2, "little")
    t.release(h)
print(json.dumps([good, len(t), t.max_open, t.closes]))
"""


def run_script(script, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         timeout=120, env=env, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_hundred_segments_under_a_limit_of_64_open_files(tmp_path, shm_path):
    out = run_script(LOW_LIMIT, str(tmp_path / "root"), shm_path)
    ok, good, segments, evictions, open_files, cap = out["run1"]
    assert (ok, good, segments, evictions, cap) == (100, 100, 100, 0, 32)
    assert open_files <= 32
    assert out["run2"] == [100, 100]


def test_an_open_at_emfile_closes_unused_fds_and_lowers_the_cap(tmp_path):
    good, held, cap, closes = run_script(EMFILE, str(tmp_path))
    assert good == 200 and 16 <= cap < 64 and held <= cap and closes > 0


def test_fd_budget_is_half_the_soft_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fd_budget() == max(16, soft // 2)
    assert fd_budget(0.25, 1) == max(1, soft // 4)


def test_the_daemon_raises_its_open_files_limit(make_daemon, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opts = {"root": str(tmp_path / "mnt"), "node": "n1", "io": "posix"}
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:  # the daemon inherits the low soft limit
        d = make_daemon(extra=["--l3-backend", "hf3fs", "--l3-options", json.dumps(opts)])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with open(f"/proc/{d.proc.pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max open files"))
    with open("/proc/sys/fs/nr_open") as f:
        want = hard if hard != resource.RLIM_INFINITY else int(f.read())
    assert line.split()[3:5] == [str(want), str(hard if hard != resource.RLIM_INFINITY
                                                 else "unlimited")]
    with d.client() as c:
        assert c.stats()["l3"]["max_open_files"] == want // 2
