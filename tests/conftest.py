"""Shared fixtures: arenas in /dev/shm with unique names, removed after the test."""

import contextlib
import os
import uuid

# Mooncake's C++ logs (glog) go to stderr, and a store client torn down at the interpreter's
# exit logs after pytest's summary line, which CI reads as the run's last word: errors only,
# here and in every daemon and process the tests start (they inherit the environment).
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import signal

# A suite started as a background job by a non-interactive shell (``cmd &``, as a CI script may)
# inherits SIGINT ignored, and so would every daemon it starts: the Ctrl-C tests (a daemon's
# SIGINT at each phase of its start) would send signals nobody takes. Python's own handler here,
# so the processes the tests start get SIGINT's default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest
import zmq

from hicached.arena import Arena

# the session-end check of /dev/shm, and the ``serial`` marker (tests that run alone under xdist)
pytest_plugins = ["shm_leftovers", "serial_marker"]

# The reference engine's tests run their models here: `HICACHED_TEST_DEVICE=cuda pytest
# tests/engine/` on a GPU machine (CPU by default; CI has no GPU).
TEST_DEVICE = os.environ.get("HICACHED_TEST_DEVICE", "cpu")


@pytest.fixture
def shm_path():
    path = f"/dev/shm/hicached-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def arena(shm_path):
    a = Arena.create(shm_path, 1 << 20)
    yield a
    a.close()


# ---------------------------------------------------------------- real daemons

import struct
import subprocess
import sys
import time

from hicached.client.api import Client
from hicached.errors import DaemonUnavailable
from hicached.daemon.config import load_config


class DaemonProc:
    """A real ``hicached serve`` process on an ipc:// socket in a temp dir."""

    def __init__(self, tmp, name="d", l2_size="16MiB", slab_size="1MiB", extra=(), state=None,
                 env=None, token=""):
        self.tmp = tmp
        self.token = token  # the daemon's client_token, for the probe and client()
        self.endpoint = f"ipc://{tmp}/{name}.sock"
        self.state_dir = str(state or tmp / f"{name}-state")
        self.args = ["--endpoint", self.endpoint, "--l2-size", l2_size, "--state-dir",
                     self.state_dir, "--slab-size", slab_size, *extra]
        self.cfg = load_config(None, {}, {"state_dir": self.state_dir})
        self.log = open(tmp / f"{name}.log", "ab")
        self.proc = None
        # tests/ on the path: daemons can load test backends such as l3_doubles:SlowFileBackend
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
        self.env = {**os.environ, "PYTHONPATH": path, **(env or {})}  # env: extra variables

    def start(self, timeout_s=30.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hicached", "serve", *self.args],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        from shm_leftovers import spawned  # (a plugin: imported once pytest loaded it)

        spawned(self.proc.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.output()}")
            try:
                with Client(self.endpoint, "probe", timeout_s=1.0, token=self.token) as c:
                    c.ping()
                return self
            except DaemonUnavailable:
                time.sleep(0.05)
        raise RuntimeError(f"daemon did not come up: {self.output()}")

    def output(self):
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def client(self, namespace="model-a", **kw):
        kw.setdefault("token", self.token)
        return Client(self.endpoint, namespace, **kw)

    def stop(self, sig=signal.SIGTERM, timeout_s=20.0):
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cleanup(self):
        self.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        for path in (self.cfg.arena_path, self.cfg.arena_path + ".presence",
                     self.cfg.arena_path + ".meta"):
            try:
                os.unlink(path)  # left behind only by a SIGKILLed daemon (or a kept arena)
            except FileNotFoundError:
                pass
        self.log.close()


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. The signal alone does not
    stop it at once: the thread the kernel picks to take it must run first, and on a loaded
    machine another thread of the process may answer a request meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return  # (gone)
        states = []
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # (a thread that ended)
        if all(st in "TtZX" for st in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped {timeout_s} s after SIGSTOP: "
                                 f"thread states {states}")
        time.sleep(0.001)


def age_heartbeat(d: DaemonProc, by_s: float) -> None:
    """Make the presence table's heartbeat of ``d``, a daemon stopped (SIGSTOP) or killed, so
    that nothing writes it, ``by_s`` seconds older: what its readers see once that long passed
    (``presence.STALE_S``), without waiting it out."""
    from hicached.presence import H_HEARTBEAT

    fd = os.open(d.cfg.arena_path + ".presence", os.O_RDWR)
    try:
        at = H_HEARTBEAT * 8
        beat = struct.unpack("d", os.pread(fd, 8, at))[0]
        os.pwrite(fd, struct.pack("d", beat - by_s), at)
    finally:
        os.close(fd)


@pytest.fixture
def make_daemon(tmp_path):
    made = []

    def make(**kw):
        d = DaemonProc(tmp_path, **kw)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon()


@pytest.fixture(scope="session")
def two_node_daemons(tmp_path_factory):
    """Two real daemons sharing one real ``mooncake_master`` on loopback (the PD prefill's
    node and the decode's): one pair for the whole session (each starts in seconds), so every
    test of it uses namespaces or keys of its own and restores what it changes. Skips when
    the Mooncake client is missing."""
    from mooncake_master import require_mooncake, two_nodes

    require_mooncake()
    with two_nodes(tmp_path_factory.mktemp("two-nodes")) as pair:
        yield pair


class RacingWriter:
    """A writer process racing a test's reader for ``seconds``: ``python -c script`` (``script``
    formatted with the tests directory) with argv (endpoint, seconds, progress file); it writes
    the round it is at into that file as 8 little-endian bytes (``round()``), and the reader
    the round it asks about next at offset 8 (``asked``), so that a writer running on a loaded
    machine can wait for the reader instead of evicting everything before it asks (the
    scripts' ``keep_up``). ``end``: when the reader should stop, ``seconds`` after the writer
    wrote its first rounds (a loaded machine may take seconds to start it); ``finish()`` waits
    for the writer and returns its rounds. Leaving the ``with`` block on an exception kills
    the writer."""

    DONE = 1 << 62  # asked once the reader stopped: the writer no longer waits for it

    # for the writer scripts: wait while the reader is more than ``lead`` rounds behind
    KEEP_UP = """
def keep_up(fd, r, lead, end):
    while r - int.from_bytes(os.pread(fd, 8, 8), "little") > lead and time.monotonic() < end:
        time.sleep(0.0005)
"""

    def __init__(self, script: str, endpoint: str, seconds: float, tmp_path):
        progress = tmp_path / "round"
        progress.write_bytes(bytes(16))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script % os.path.dirname(__file__), endpoint, str(seconds),
             str(progress)], stdout=subprocess.PIPE, text=True)
        self.fd = os.open(progress, os.O_RDWR)
        self.seconds = seconds
        self._end: float | None = None

    @property
    def end(self) -> float:
        if self._end is None:
            deadline = time.monotonic() + 60
            while self.round() < 1 and self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            self._end = time.monotonic() + self.seconds
        return self._end

    def round(self) -> int:
        return int.from_bytes(os.pread(self.fd, 8, 0), "little")

    def asked(self, r: int) -> None:
        os.pwrite(self.fd, max(0, r).to_bytes(8, "little"), 8)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.asked(self.DONE)
        os.close(self.fd)
        self.fd = -1
        if exc_type is not None and self.proc.poll() is None:
            self.proc.kill()  # the reader failed early

    def finish(self) -> int:
        if self.fd >= 0:
            self.asked(self.DONE)
        out, _ = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, f"writer exited {self.proc.returncode}"
        return int(out)


def run_client_proc(script: str, *args: str, timeout_s: float = 60.0) -> str:
    """Run ``script`` in a fresh Python process; returns its stdout (raises on failure)."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise AssertionError(f"client process failed ({out.returncode}):\n{out.stderr}")
    return out.stdout


@contextlib.contextmanager
def raw_socket(endpoint: str, timeout_ms: int = 5000):
    """A bare DEALER connected to ``endpoint``, for messages a ``Client`` would never send."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.connect(endpoint)
    try:
        yield s
    finally:
        s.close()
        ctx.term()


@pytest.fixture
def backends():
    """L3 backends a test made: closed at its end."""
    made = []
    yield made
    for b in made:
        b.close()


def wait_until(pred, timeout_s=10.0):
    """Poll ``pred`` until it is true or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# ---------------------------------------------------------------- SGLang plugin


@pytest.fixture
def sg():
    """SGLang's modules the plugin tests use (the test skips, naming the install, without)."""
    from sglang_env import require_sglang
    return require_sglang()


@pytest.fixture
def plugin(sg):
    """``plugin(endpoint, pools, extra=..., **config)``: a plugin attached as SGLang does."""
    from sglang_env import plugins
    with plugins(sg) as make:
        yield make
