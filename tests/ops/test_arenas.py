"""``hicached arena list | free`` (``hicached/ops/arenas.py``): the arenas stopped daemons kept
in shared memory, with real files, real daemons (one killed, one holding its state lock) and
the CLI as an operator runs it."""

import fcntl
import os
import signal
import subprocess
import sys
import uuid

import pytest

from hicached.ops.arenas import ArenaInUse, free_arenas, kept_arenas, recorded_arena
from hicached.errors import ConfigError


def arena_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hicached", "arena", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def exists(path):
    return os.path.lexists(path)


def test_a_killed_daemons_arena_is_listed_and_freed(make_daemon):
    d = make_daemon(name="killed")
    arena = d.cfg.arena_path
    assert recorded_arena(d.state_dir) == arena  # the record a crash leaves behind
    d.stop(signal.SIGKILL)
    assert exists(arena) and exists(arena + ".presence")  # a crash keeps them: nobody unlinks

    meta = exists(arena + ".meta")  # (a daemon with warm restarts journals there)
    files = [arena, arena + ".presence"] + [arena + ".meta"] * meta
    held = sum(os.stat(p).st_blocks * 512 for p in files)
    out = arena_cli("list", "--state-dir", d.state_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (f"{arena} ({held / (1 << 30):.2f} GiB: arena, presence"
                          + (", meta); daemon stopped\n" if meta else
                             "); daemon stopped; no meta file: a daemon starts cold beside it\n"))
    [kept] = kept_arenas(d.state_dir, arena)
    assert (kept.recorded, kept.daemon_running, kept.made_by_hicached, kept.has_meta) == (
        True, False, True, meta)
    assert kept.held_bytes == held and held >= 16 << 20  # the whole 16 MiB arena is held

    out = arena_cli("free", "--state-dir", d.state_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"freed {arena} (") and (
        "arena, presence, meta)" if meta else "arena, presence)") in out.stdout
    assert not any(exists(p) for p in files)
    assert recorded_arena(d.state_dir) == ""  # a file made there later is nobody's arena
    out = arena_cli("free", "--state-dir", d.state_dir)
    assert (out.returncode, out.stdout) == (0, f"nothing to free for state dir {d.state_dir}\n")
    d.start()  # and a daemon starts there as before
    assert exists(arena)


def test_a_meta_file_is_listed_and_freed_with_its_arena(make_daemon):
    d = make_daemon(name="meta")
    arena = d.cfg.arena_path
    d.stop(signal.SIGKILL)
    with open(arena + ".meta", "wb") as f:  # what a warm-restart daemon keeps beside it
        f.write(os.urandom(8192))
    [kept] = kept_arenas(d.state_dir, arena)
    assert kept.has_meta and [p for p, _ in kept.files] == [arena, arena + ".presence",
                                                             arena + ".meta"]
    out = arena_cli("list", "--state-dir", d.state_dir)
    assert "arena, presence, meta); daemon stopped\n" in out.stdout
    assert [a.path for a in free_arenas(d.state_dir, arena)] == [arena]
    assert not any(exists(arena + s) for s in ("", ".presence", ".meta"))


def test_free_refuses_while_a_daemon_holds_the_state_lock(make_daemon):
    d = make_daemon(name="running")
    arena = d.cfg.arena_path
    out = arena_cli("list", "--state-dir", d.state_dir)
    assert out.returncode == 0 and "; daemon running" in out.stdout, out
    out = arena_cli("free", "--state-dir", d.state_dir)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"hicached arena free: error: a hicached daemon is running on state "
                          f"dir {d.state_dir} (it holds hicached.lock); it frees or keeps its "
                          "arena when it stops (on_stop): stop it first\n")
    assert exists(arena) and exists(arena + ".presence")
    with d.client() as c:  # untouched: the daemon serves on
        c.ping()


def test_free_refuses_a_file_another_process_holds(tmp_path):
    """A daemon of another state dir given the same arena path holds the file's own lock."""
    state = tmp_path / "s"
    state.mkdir()
    arena = f"/dev/shm/hicached-test-held-{uuid.uuid4().hex[:8]}"
    with open(arena, "wb") as f:
        f.write(b"x" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"), arena],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ArenaInUse, match=f"{arena} is in use by a running hicached daemon"):
            free_arenas(str(state), arena)
        assert exists(arena)
    finally:
        holder.communicate(timeout=30)  # (its stdin closed: it exits, the lock goes)
    assert [a.path for a in free_arenas(str(state), arena)] == [arena]
    assert not exists(arena)


def test_free_never_removes_a_file_hicached_did_not_make(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    (state / "hicached.lock").write_bytes(b"")  # a daemon ran here and exited cleanly
    precious = f"/dev/shm/precious-{uuid.uuid4().hex[:8]}"
    link = f"/dev/shm/hicached-test-link-{uuid.uuid4().hex[:8]}"
    with open(precious, "wb") as f:
        f.write(b"someone's data")
    os.symlink(precious, link)
    try:
        for path in (precious, link):
            [kept] = kept_arenas(str(state), path)
            assert not kept.made_by_hicached
            with pytest.raises(ConfigError, match=f"arena_path: {path} was not made by this "
                               "state dir's daemon"):
                free_arenas(str(state), path)
            out = arena_cli("free", "--state-dir", str(state), env={"HICACHED_ARENA_PATH": path})
            assert out.returncode == 2 and out.stderr.startswith("hicached: error: arena_path:")
        with open(precious, "rb") as f:
            assert f.read() == b"someone's data"
        assert os.path.islink(link)
    finally:
        os.unlink(link)
        os.unlink(precious)


def test_a_recorded_custom_path_is_freed_by_its_config(tmp_path):
    """A custom arena_path that the state dir's lock file records (the daemon made it), named
    by a config file, as the systemd unit's ExecStopPost= names it."""
    state = tmp_path / "s"
    state.mkdir()
    arena = f"/dev/shm/custom-arena-{uuid.uuid4().hex[:8]}"
    (state / "hicached.lock").write_bytes(arena.encode() + b"\n")
    for suffix in ("", ".presence"):
        with open(arena + suffix, "wb") as f:
            f.write(b"\0" * 8192)
    config = tmp_path / "hicached.toml"
    config.write_text(f'state_dir = "{state}"\narena_path = "{arena}"\n')
    out = arena_cli("list", "--config", str(config))
    assert out.returncode == 0 and out.stdout.startswith(f"{arena} (0.00 GiB: arena, presence)")
    out = arena_cli("free", "--config", str(config))
    assert out.returncode == 0 and out.stdout.startswith(f"freed {arena} ("), out.stderr
    assert not exists(arena) and not exists(arena + ".presence")


def test_state_dir_and_config_are_exclusive_and_a_verb_is_needed():
    out = arena_cli("list", "--state-dir", "/tmp/x", "--config", "/tmp/y.toml")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
    out = arena_cli()
    assert out.returncode == 2 and "the following arguments are required: verb" in out.stderr


def test_the_lock_is_not_taken_by_list_while_a_daemon_holds_it(make_daemon):
    """``list`` beside a running daemon only looks: the daemon's lock stays its own."""
    d = make_daemon(name="looked-at")
    [kept] = kept_arenas(d.state_dir, d.cfg.arena_path)
    assert kept.daemon_running
    fd = os.open(os.path.join(d.state_dir, "hicached.lock"), os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_kept_arena_is_listed_adopted_and_freed(make_daemon):
    """With the daemon's warm restart (``on_stop = "keep"``): a SIGTERM keeps the arena, its
    presence table and its ``.meta``; ``list`` shows them; the next daemon adopts its pages
    (``/stats``, ``/metrics``, ``hicached status`` say so); after another stop, ``free`` removes
    all three and the daemon after it starts cold."""
    import dataclasses

    import torch
    from admin_helpers import admin_daemon, http, sample, scrape
    from pools import pages

    from hicached import HostPool, PoolTransfer
    from hicached.daemon.config import DaemonConfig
    from hicached.ops.adminctl import format_status

    if "on_stop" not in {f.name for f in dataclasses.fields(DaemonConfig)}:
        pytest.skip("needs the daemon's warm restart (on_stop, the .meta journal)")
    d, url = admin_daemon(make_daemon, key="", name="warm", extra=["--on-stop", "keep", "--l3-backend", "none"])
    arena = d.cfg.arena_path
    keys = [f"warm-{i}" for i in range(4)]
    with d.client() as c:
        kv = HostPool.allocate_mha(8, 4, layers=4, heads=4, head_dim=16, layout="page_first",
                                   dtype=torch.float32)  # 8 KiB pages (journaled: >= 4 KiB)
        c.register_mem_host_pool_v2(kv, "kv")
        assert c.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=keys)])["kv"] == [True] * 4
        c.wait_committed()
    assert d.stop(signal.SIGTERM) == 0
    assert exists(arena) and exists(arena + ".meta"), d.output()  # (+ .presence, if kept)
    out = arena_cli("list", "--state-dir", d.state_dir)
    assert out.stdout.startswith(f"{arena} (") and "meta); daemon stopped\n" in out.stdout, out

    d.start()
    _, stats = http("GET", url + "/stats")
    assert (stats["adoption"]["pages"], stats["adoption"]["cold_reason"]) == (4, None), stats
    samples = scrape(url)
    assert sample(samples, "hicached_adopted_pages_total") == 4
    assert sample(samples, "hicached_adoption_cold") == 0
    assert "  start   warm start: adopted 4 pages (" in format_status(url, {}, {}, stats)

    assert d.stop(signal.SIGTERM) == 0
    out = arena_cli("free", "--state-dir", d.state_dir)
    assert out.returncode == 0 and out.stdout.startswith(f"freed {arena} (") \
        and "meta)" in out.stdout, out
    assert not any(exists(arena + s) for s in ("", ".presence", ".meta"))
    d.start()
    _, stats = http("GET", url + "/stats")
    assert stats["adoption"]["pages"] == 0 and stats["adoption"]["cold_reason"], stats
