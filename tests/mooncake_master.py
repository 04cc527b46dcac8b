"""A real ``mooncake_master`` on loopback for tests, and two daemons sharing it (two "nodes").

Tests that use it skip cleanly when the Mooncake client is not importable
(``require_mooncake``); ``tests/backends/test_mooncake.py`` does so at import.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import time

import pytest


def require_mooncake():
    """The ``mooncake`` package, or skip the calling module (the extra is missing, or its
    libibverbs / libnuma)."""
    try:
        import mooncake
        import mooncake.store  # the client the backend uses
    except ImportError as e:
        pytest.skip(f"mooncake client not importable ({e}); pip install -e '.[mooncake]'",
                    allow_module_level=True)
    return mooncake


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port``. A port from
    ``free_port`` is free only until someone binds it: another run's process may take it
    first, and a connect would then reach that one (under xdist, or other runs on the node)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()  # sl local_address rem_address st ... inode
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


class Master:
    """A ``mooncake_master`` on 127.0.0.1 (RPC and metrics), started and stopped by PID."""

    def __init__(self, log_path):
        self.port = free_port()
        self.log_path = log_path
        self.proc = None
        self._told = False  # whether anyone was given the address (then the port stays)

    @property
    def address(self) -> str:
        self._told = True
        return f"127.0.0.1:{self.port}"

    def start(self, tries=5):
        """Start it and wait until it listens on its port. While nobody was given its address,
        it takes another port when another process took this one first; after that (a restart,
        a master started after its clients) the port stays, and a taken one is an error."""
        binary = os.path.join(os.path.dirname(require_mooncake().__file__), "mooncake_master")
        for _ in range(tries):
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                     f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1"],
                    stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.proc.poll() is None:
                if listens(self.proc.pid, self.port):
                    return self
                time.sleep(0.05)
            self.stop()  # (it could not bind: another process took the port meanwhile)
            if self._told:
                break
            self.port = free_port()
        raise RuntimeError(f"mooncake_master did not listen on port {self.port} (taken by another "
                           "process?); its log ends: " + self.log_path.read_text()[-2000:])

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def pause(self, paused=True):
        """Stop it (returns once it is stopped: ``conftest.sigstop``), or let it go on."""
        from conftest import sigstop

        if paused:
            sigstop(self.proc.pid)
        else:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def mooncake_l3(master, **options):
    """Daemon flags for a Mooncake L3 on ``master`` (TCP on loopback, small segments)."""
    opts = {"master_server_address": master.address, "protocol": "tcp",
            "global_segment_size": "32MiB", "local_buffer_size": "4MiB",
            "local_hostname": "127.0.0.1", **options}
    return ["--l3-backend", "mooncake", "--l3-options", json.dumps(opts)]


@contextlib.contextmanager
def two_nodes(tmp, names=("prefill", "decode"), **daemon_kw):
    """A master and two real daemons (``conftest.DaemonProc``) sharing it, on ``ipc://``
    sockets in ``tmp``: yields the daemons; stops them and the master at the end."""
    from conftest import DaemonProc

    master = Master(tmp / "master.log").start()
    made = []
    try:
        for name in names:
            made.append(DaemonProc(tmp, name=name, extra=mooncake_l3(master),
                                   **daemon_kw).start())
        yield tuple(made)
    finally:
        for d in made:
            d.cleanup()
        master.stop()
