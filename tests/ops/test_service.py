"""The daemon as a service: the systemd unit, sd_notify (READY / WATCHDOG / STOPPING under a
test NOTIFY_SOCKET), SIGHUP reload, the SIGTERM drain, and --print-config."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from conftest import wait_until
from pools import kv_pool, pages

from hicached import protocol as P
from hicached.errors import ShuttingDown
from hicached.daemon.config import load_config
from hicached.ops.sdnotify import NullNotifier, SystemdNotifier

UNIT = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "hicached.service")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: apt-get install systemd; "
                    ".ci/run installs it)")
def test_systemd_unit_verifies(tmp_path):
    with open(UNIT) as f:
        text = f.read()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "RuntimeDirectory=hicached",
                 "LimitMEMLOCK=infinity", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "PrivateTmp=no", "ExecReload=/bin/kill -HUP $MAINPID", "RemoveIPC=no",
                 "--on-stop keep",  # warm restarts: the stop's ExecStopPost= decides
                 "ExecStopPost=-/usr/local/bin/hicached arena free --config "
                 "/etc/hicached/hicached.toml --after-stop %n"):
        assert line in text, line
    # systemd-analyze checks that ExecStart's binary exists: point it at this venv's hicached
    exe = shutil.which("hicached") or os.path.join(os.path.dirname(sys.executable), "hicached")
    if not os.access(exe, os.X_OK):
        exe = sys.executable
    unit = tmp_path / "hicached.service"
    unit.write_text(text.replace("/usr/local/bin/hicached", exe))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], check=False, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "", out.stderr  # unknown keys / bad values only warn


class NotifyListener:
    """A test NOTIFY_SOCKET: collects the datagrams a daemon sends."""

    def __init__(self, address: str):
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.messages: list[str] = []

    def pump(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                return self.messages

    def states(self) -> list[str]:
        """The first line of every message (READY=1, WATCHDOG=1, ...)."""
        return [m.split("\n")[0] for m in self.pump()]

    def close(self):
        self.sock.close()


def _env(**extra):
    return {**os.environ, **extra}


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_ready_watchdog_stopping_in_order(make_daemon, tmp_path, abstract):
    address = f"@hicached-test-{uuid.uuid4().hex[:8]}" if abstract else str(tmp_path / "n.sock")
    listener = NotifyListener(address)
    try:
        d = make_daemon(env=_env(NOTIFY_SOCKET=address, WATCHDOG_USEC="400000"))
        assert wait_until(lambda: listener.states().count("WATCHDOG=1") >= 3, 10)
        assert d.stop() == 0
        states = listener.states()
        assert states[0] == "READY=1"
        assert "STATUS=serving" in listener.messages[0]
        assert states[-1] == "STOPPING=1"
        assert set(states[1:-1]) == {"WATCHDOG=1"}  # nothing else in between
        assert len(states) >= 5
    finally:
        listener.close()


def test_watchdog_only_when_asked(make_daemon, tmp_path):
    listener = NotifyListener(str(tmp_path / "n.sock"))
    try:  # WATCHDOG_PID names another process: the watchdog is not ours to feed
        d = make_daemon(env=_env(NOTIFY_SOCKET=listener.address, WATCHDOG_USEC="200000",
                                 WATCHDOG_PID="1"))
        time.sleep(0.6)
        assert d.stop() == 0
        assert listener.states() == ["READY=1", "STOPPING=1"]
    finally:
        listener.close()
    assert type(SystemdNotifier.from_env({})) is NullNotifier
    n = SystemdNotifier.from_env({"NOTIFY_SOCKET": "/nonexistent/sock", "WATCHDOG_USEC": "3e"})
    assert n.watchdog_interval_s is None and n.ready() is False  # a lost message never raises
    n.close()


def _backend_status(c):
    return c._conn.call(lambda s, r: P.GetBackend(r)).status


def test_sighup_reloads_policy_keys(make_daemon, tmp_path):
    conf = tmp_path / "h.toml"
    conf.write_text('write_policy = "write_through"\nget_wait_s = 5.0\n')
    listener = NotifyListener(str(tmp_path / "n.sock"))
    try:
        d = make_daemon(extra=["--config", str(conf)],
                        env=_env(NOTIFY_SOCKET=listener.address))
        with d.client() as c:
            assert _backend_status(c)["write_policy"] == "write_through"
            conf.write_text('write_policy = "write_through_selective"\n'
                            'write_through_threshold = 3\nprefetch = false\nget_wait_s = 1.5\n'
                            'log_level = "debug"\nl2_size = "32MiB"\nio_queue_depth = 8\n'
                            'namespace_quotas = { "model-a" = "1MiB" }\nset_ahead_bytes = 0\n'
                            'eviction_alpha = 2.5\neviction = "lru"\nevict_ahead = 0.05\n')
            d.proc.send_signal(signal.SIGHUP)
            assert wait_until(lambda: _backend_status(c)["write_policy"]
                              == "write_through_selective")
            st = _backend_status(c)
            assert st["write_through_threshold"] == 3 and st["prefetch"] is False
            assert wait_until(lambda: "reloaded:" in d.output())
            out = d.output()
            assert "get_wait_s=1.5" in out and "log_level='debug'" in out
            assert "set_ahead_bytes=0" in out
            # l2_size comes from the command line (flags beat the file): unchanged
            assert "eviction_alpha=2.5" in out  # the hybrid policy's weight: applied
            assert "evict_ahead=0.05" in out
            # (logged right after the "reloaded:" line: waited for, not read with it)
            assert wait_until(lambda: "reload: io_queue_depth, eviction changed; restart "
                              "hicached to apply" in d.output())
            conf.write_text('write_policy = "sometimes"\n')
            d.proc.send_signal(signal.SIGHUP)
            assert wait_until(lambda: "reload failed; the running config stays" in d.output())
            assert "write_policy" in d.output().split("reload failed")[-1]
            assert _backend_status(c)["write_policy"] == "write_through_selective"
            c.ping()
        assert d.stop() == 0
        assert listener.states() == ["READY=1", "RELOADING=1", "READY=1", "RELOADING=1",
                                     "READY=1", "STOPPING=1"]
    finally:
        listener.close()


def test_sigterm_drains_work_in_flight(make_daemon):
    d = make_daemon()
    keys = ["drain0", "drain1"]
    writer, other = d.client(), d.client()
    try:
        writer.register_mem_host_pool_v2(kv_pool(seed=4), "kv")
        res = writer._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", keys)]))
        assert all(off >= 0 for off in res.offsets[0])
        d.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "draining" in d.output())
        # new work during the drain: a clean "shutting down", not a timeout
        with pytest.raises(ShuttingDown, match="shutting down"):
            other.ping()
        with pytest.raises(ShuttingDown):
            other.batch_exists(keys)
        assert d.proc.poll() is None  # still draining: a reservation is open
        done = writer._conn.call(lambda s, r: P.Commit(r, s, res.reservation_id, [[True, True]]))
        assert done.stored == [[True, True]]  # work in flight finishes
        assert d.proc.wait(20) == 0
    finally:
        writer.close()
        other.close()
    assert "unfinished" not in d.output()
    d.start()  # same state dir: the committed pages were written through before exit
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        assert c.batch_exists(keys) == 2
        assert c.batch_get_v1(keys, pages(0, 2)) == [True, True]


def test_drain_deadline_bounds_a_stalled_client(make_daemon):
    d = make_daemon(extra=["--drain-timeout-s", "1"])
    with d.client() as c:
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        c._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", ["stall"])]))  # never committed
        t = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - t < 8
    assert "drain deadline: 1 reservations, 0 waiting requests, 0 L3 jobs unfinished" in d.output()


def test_print_config_hides_secrets_and_reads_back_as_the_same_config(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HICACHED_", "MOONCAKE_"))}
    env["HICACHED_CLIENT_TOKEN"] = "token-from-env"
    env["MOONCAKE_PROTOCOL"] = "tcp"
    flags = ["--state-dir", str(tmp_path), "--admin-port", "8470", "--admin-api-key",
             "key-from-flag", "--namespace-quotas", '{"model-a": "1GiB", "m\\"b": 4096}',
             "--l3-options", '{"node": "n1", "grace_s": 0.5, "direct": false}',
             "--socket-mode", "0640", "--get-wait-s", "1e-3"]

    def print_config(*args):
        out = subprocess.run([sys.executable, "-m", "hicached", "serve", "--print-config",
                              *args], check=False, capture_output=True, text=True, env=env,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    text = print_config(*flags)
    assert "key-from-flag" not in text and "token-from-env" not in text
    assert "# admin_api_key = <set, not printed>" in text
    assert "# client_token = <set, not printed>" in text
    assert "admin_port = 8470" in text and "socket_mode = 0o640" in text
    assert 'namespace_quotas = {"model-a" = 1073741824, "m\\"b" = 4096}' in text
    assert "# from the environment (not a key): MOONCAKE_PROTOCOL=tcp" in text
    (tmp_path / "printed.toml").write_text(text)
    cfg = load_config(str(tmp_path / "printed.toml"))
    assert cfg.namespace_quotas == {"model-a": 1 << 30, 'm"b': 4096}
    assert cfg.l3_options == {"node": "n1", "grace_s": 0.5, "direct": False}
    assert cfg.socket_mode == 0o640 and cfg.get_wait_s == 1e-3 and cfg.admin_api_key == ""
    assert print_config("--config", str(tmp_path / "printed.toml")) == text.replace(
        "admin_api_key = <set", "admin_api_key = <unset")  # the token comes from env again


def test_a_second_daemon_never_takes_a_running_ones_arena_or_socket(daemon, tmp_path):
    """Another state dir but the running daemon's arena path, or its ipc endpoint: refused at
    start with a clear error (exit 2), and the running daemon keeps serving."""
    import subprocess
    import sys

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB",
                               "--slab-size", "1MiB", *args], capture_output=True, text=True,
                              timeout=60)

    out = serve("--endpoint", f"ipc://{tmp_path}/other.sock", "--state-dir",
                str(tmp_path / "other1"), "--arena-path", daemon.cfg.arena_path)
    assert out.returncode == 2 and "in use by a running hicached daemon" in out.stderr
    out = serve("--endpoint", daemon.endpoint, "--state-dir", str(tmp_path / "other2"))
    assert out.returncode == 2 and "is in use by a running process" in out.stderr
    assert os.path.exists(daemon.cfg.arena_path) and os.path.exists(daemon.endpoint[6:])
    with daemon.client() as c:  # a new client maps the same arena and is served
        c.ping()
        assert c.arena.path == daemon.cfg.arena_path


def test_unusable_state_dir_or_endpoint_is_a_clear_startup_error(tmp_path):
    import subprocess
    import sys
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cases = ((["--state-dir", str(blocker)], "state_dir: cannot use"),
             (["--state-dir", str(tmp_path / "s1"), "--endpoint", "ipc://"],
              "endpoint: cannot listen"),
             (["--state-dir", str(tmp_path / "s2"), "--endpoint", f"ipc://{blocker}/x.sock"],
              "endpoint: cannot listen"))
    for args, message in cases:
        out = subprocess.run([sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB",
                              "--slab-size", "1MiB", *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_an_arena_path_that_is_a_directory_is_a_clear_startup_error(tmp_path):
    """--arena-path naming a directory: one line, exit 2 (was a traceback from unlink)."""
    import subprocess
    import sys
    arena_dir = tmp_path / "arena-dir"
    arena_dir.mkdir()
    out = subprocess.run([sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB",
                          "--slab-size", "1MiB", "--state-dir", str(tmp_path / "s"),
                          "--endpoint", f"ipc://{tmp_path}/d.sock", "--arena-path",
                          str(arena_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"arena path {arena_dir} is a directory" in out.stderr
    assert "Traceback" not in out.stderr and arena_dir.is_dir()


def test_an_arena_path_naming_someone_elses_file_never_deletes_it(tmp_path):
    """A mistyped --arena-path naming an existing file that no daemon locks: it was deleted
    and replaced. Now only files named hicached-* or recorded by the state dir's last daemon
    (a crash left them) are replaced; anything else is a one-line startup error, untouched."""
    precious = f"/dev/shm/precious-{uuid.uuid4().hex[:8]}"
    arena = f"/dev/shm/custom-arena-{uuid.uuid4().hex[:8]}"
    with open(precious, "wb") as f:
        f.write(b"someone's data")

    def serve(path, state):
        return subprocess.Popen(
            [sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB", "--slab-size",
             "1MiB", "--state-dir", str(tmp_path / state), "--l3-backend", "none",
             "--endpoint", f"ipc://{tmp_path}/{state}.sock", "--arena-path", path],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def ready(state):
        return wait_until(lambda: os.path.exists(f"{tmp_path}/{state}.sock"), timeout_s=60)

    procs = []
    try:
        p = serve(precious, "s1")
        procs.append(p)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 2 and "holds a file hicached did not make" in err, err
        assert "Traceback" not in err
        with open(precious, "rb") as f:
            assert f.read() == b"someone's data"
        # a custom path this state dir's daemon used: after a crash it is adopted
        p = serve(arena, "s2")
        procs.append(p)
        assert ready("s2") and os.path.getsize(arena) == 16 * 1024**2
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
        os.unlink(f"{tmp_path}/s2.sock")
        assert os.path.exists(arena)  # left by the crash
        p = serve(arena, "s2")
        procs.append(p)
        assert ready("s2"), p.communicate()[1] if p.poll() is not None else "not ready"
        # but another state dir's daemon does not replace it (it never recorded that path)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
        q = serve(arena, "s3")
        procs.append(q)
        _, err = q.communicate(timeout=60)
        assert q.returncode == 2 and "holds a file hicached did not make" in err, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
        for path in (precious, arena, arena + ".presence", arena + ".meta"):
            if os.path.exists(path):
                os.unlink(path)


def test_after_a_clean_exit_a_file_made_later_at_the_arena_path_is_not_replaced(tmp_path):
    """A clean exit removes the arena's files, so the state dir's record of its path goes too:
    a file someone makes there afterwards is not a crashed daemon's arena (it was deleted)."""
    arena = f"/dev/shm/custom-arena-{uuid.uuid4().hex[:8]}"
    sock = f"{tmp_path}/d.sock"
    cmd = [sys.executable, "-m", "hicached", "serve", "--l2-size", "16MiB", "--slab-size",
           "1MiB", "--state-dir", str(tmp_path / "s"), "--l3-backend", "none", "--endpoint",
           f"ipc://{sock}", "--arena-path", arena]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: os.path.exists(sock), timeout_s=60)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0 and not os.path.exists(arena), err
        with open(arena, "wb") as f:
            f.write(b"someone's data")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "holds a file hicached did not make" in out.stderr, \
            out.stderr
        with open(arena, "rb") as f:
            assert f.read() == b"someone's data"
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        for path in (arena, arena + ".presence", arena + ".meta"):
            if os.path.exists(path):
                os.unlink(path)
