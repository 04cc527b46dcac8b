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


class Master:
    """A ``mooncake_master`` on 127.0.0.1 (RPC and metrics), started and stopped by PID."""

    def __init__(self, log_path):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc = None

    def start(self):
        binary = os.path.join(os.path.dirname(require_mooncake().__file__), "mooncake_master")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                 f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                assert self.proc.poll() is None, self.log_path.read_text()[-2000:]
                time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not listen on {self.port}")

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def pause(self, paused=True):
        os.kill(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

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
