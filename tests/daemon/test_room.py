"""``room.py``: whether the node can back an arena. The arithmetic with numbers passed in, the
reading of /proc and the cgroup files from trees written here (v1, v2, hybrid) and from this
machine, and a real ``hicached serve`` asked for more than the machine has: refused in one line,
exit status 2, no arena file left, another process untouched. Nothing here ever tries a
reservation larger than the machine."""

import os
import subprocess
import sys

import pytest

from hicached.daemon.room import (
    MARGIN_BYTES,
    Room,
    allocated_bytes,
    check_room,
    largest_arena,
    read_room,
)
from hicached.errors import ConfigError

GiB = 1 << 30


def test_the_least_figure_less_its_margin_is_what_fits():
    room = Room("/dev/shm", 40 * GiB, 30 * GiB, None, None)
    assert largest_arena(room) == 29 * GiB  # MemAvailable less the 1 GiB margin
    assert largest_arena(room, margin_bytes=0) == 30 * GiB
    assert largest_arena(Room("/dev/shm", 8 * GiB, 30 * GiB, None, None)) == 8 * GiB  # no margin
    cg = Room("/dev/shm", 40 * GiB, 30 * GiB, 16 * GiB, 4 * GiB)
    assert largest_arena(cg) == 11 * GiB  # the cgroup's room: 16 - 4 - 1
    assert largest_arena(cg, credit_bytes=2 * GiB) == 13 * GiB  # an old arena to be replaced
    assert largest_arena(Room("/dev/shm", 40 * GiB, GiB // 2, None, None)) == 0
    assert largest_arena(Room("/x", None, None, None, None)) == 1 << 62  # nothing known
    assert MARGIN_BYTES == GiB


def test_a_refusal_is_one_line_with_every_figure_and_what_fits():
    room = Room("/dev/shm", 23 * GiB, 21 * GiB, 16 * GiB, 4 * GiB)
    check_room(11 * GiB, room)  # fits exactly
    with pytest.raises(ConfigError) as e:
        check_room(11 * GiB + 1, room)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("l2_size (--l2-size): an arena of 11.0 GiB is more")
    assert ("/dev/shm has 23.0 GiB free, MemAvailable is 21.0 GiB, the cgroup's memory limit is "
            "16.0 GiB with 4.0 GiB used; keeping 1.0 GiB of memory free, an arena of at most "
            "11.0 GiB fits: lower --l2-size") in msg

    # the presence table counts too, and what fits is the largest arena whose table fits beside
    def table(n):  # 1/32 of the arena, rounded up to MiB
        return -(-n // 32 // (1 << 20)) * (1 << 20)

    with pytest.raises(ConfigError) as e:
        check_room(100 * (1 << 40), Room("/dev/shm", 200 * GiB, 33 * GiB + MARGIN_BYTES,
                                        None, None), table_bytes_of=table)
    msg = str(e.value)
    assert "an arena of 100.0 TiB (and 3.1 TiB for its presence table)" in msg
    assert "an arena of at most 32.0 GiB fits" in msg  # 32 GiB + its 1 GiB table = 33 GiB
    with pytest.raises(ConfigError, match=r"2\.0 GiB of an old arena to be replaced"):
        check_room(20 * GiB, Room("/dev/shm", 23 * GiB, 10 * GiB, None, None), 2 * GiB)


def _tree(tmp_path, cgroup_lines, files):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    (proc / "meminfo").write_text("MemTotal:       24684096 kB\n"
                                  "MemAvailable:   20971520 kB\n")  # 20 GiB
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(proc), str(root)


def test_read_room_v2_takes_the_tightest_ancestor_less_inactive_file_pages(tmp_path):
    proc, root = _tree(tmp_path, ["0::/user.slice/app.scope"], {
        "user.slice/memory.max": str(12 * GiB),
        "user.slice/memory.current": str(5 * GiB),
        "user.slice/memory.stat": f"anon 1\ninactive_file {GiB}\n",
        "user.slice/app.scope/memory.max": "max",  # no limit of its own
        "user.slice/app.scope/memory.current": str(GiB),
    })
    room = read_room(str(tmp_path), proc, root)
    assert room.mem_available_bytes == 20 * GiB
    assert (room.cgroup_limit_bytes, room.cgroup_used_bytes) == (12 * GiB, 4 * GiB)
    st = os.statvfs(tmp_path)
    assert room.shm_dir == str(tmp_path) and room.shm_free_bytes > 0
    assert abs(room.shm_free_bytes - st.f_bavail * st.f_frsize) < 64 << 20


def test_read_room_v1_and_a_container_without_its_path(tmp_path):
    proc, root = _tree(tmp_path, ["9:pids:/x", "4:memory:/docker/abc", "0::/"], {
        "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "memory/docker/abc/memory.limit_in_bytes": str(8 * GiB),
        "memory/docker/abc/memory.usage_in_bytes": str(3 * GiB),
        "memory/docker/abc/memory.stat": f"cache 5\ntotal_inactive_file {GiB}\n",
    })
    room = read_room(str(tmp_path), proc, root)
    assert (room.cgroup_limit_bytes, room.cgroup_used_bytes) == (8 * GiB, 2 * GiB)
    # a container mounts its own cgroup as the root while /proc names the host's path
    proc, root = _tree(tmp_path / "c", ["4:memory:/docker/abc"], {
        "memory/memory.limit_in_bytes": str(4 * GiB),
        "memory/memory.usage_in_bytes": str(GiB),
    })
    assert read_room(str(tmp_path), proc, root)[3:] == (4 * GiB, GiB)
    proc, root = _tree(tmp_path / "none", ["0::/"], {})  # no limit anywhere, none readable
    assert read_room(str(tmp_path), proc, root)[3:] == (None, None)
    assert read_room(str(tmp_path / "missing"), proc, root).shm_free_bytes is None


def _mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


@pytest.mark.serial  # reads the machine's free memory: no other test may take or free some
def test_read_room_of_this_machine():
    room = read_room("/dev/shm")
    st = os.statvfs("/dev/shm")
    assert abs(room.shm_free_bytes - st.f_bavail * st.f_frsize) < GiB  # (others write there)
    assert abs(room.mem_available_bytes - _mem_available()) < GiB


def test_allocated_bytes_of_an_old_arena(tmp_path):
    path = f"/dev/shm/hicached-test-room-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, 4 << 20)
        assert allocated_bytes(path, path + ".presence", str(tmp_path)) == 4 << 20
    finally:
        os.close(fd)
        os.unlink(path)
    assert allocated_bytes(path) == 0


@pytest.mark.serial  # reads the machine's free memory: no other test may take or free some
def test_serve_refuses_more_than_the_machine_has_and_touches_nobody(tmp_path):
    st = os.statvfs("/dev/shm")
    too_much = _mem_available() + st.f_bavail * st.f_frsize + GiB
    arena = f"/dev/shm/hicached-test-room-{os.getpid()}"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hicached", "serve", "--l2-size", str(too_much),
             "--endpoint", f"ipc://{tmp_path}/d.sock", "--state-dir", str(tmp_path / "state"),
             "--arena-path", arena, "--l3-backend", "none"],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        (line,) = out.stderr.strip().splitlines()
        shown = (f"{too_much / GiB:.1f} GiB" if too_much < 1 << 40 else
                 f"{too_much / (1 << 40):.1f} TiB")
        assert line.startswith(f"hicached: error: l2_size (--l2-size): an arena of {shown}"), line
        assert "MemAvailable is" in line and "/dev/shm has" in line and "lower --l2-size" in line
        assert "reserving the arena" not in out.stderr and "Traceback" not in out.stderr
        assert not os.path.exists(arena) and not os.path.exists(arena + ".presence")
        assert bystander.poll() is None  # nobody was killed for it
    finally:
        bystander.kill()
        bystander.wait()
