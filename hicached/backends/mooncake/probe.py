"""Checks of a Mooncake master made before the daemon's own ``setup``, which holds the GIL for
its whole duration: ~90 s against a dead master and minutes against a hung one or a port that
is no Mooncake master (Mooncake retries its RPC 20 times at 30 s), freezing every thread of the
daemon. So first the master's port must accept a connection (``probe_master``), then a child
process must get through ``setup`` (no segment, no buffer) and ``health_check`` within
``probe_timeout_s`` (``probe_setup``); the child is killed at the deadline, and waiting for it
holds nothing.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from hicached.backends.guard import StoreUnavailable
from hicached.backends.mooncake.options import MooncakeOptions, redact
from hicached.errors import ConfigError

INVALID_PARAMS = -600  # Mooncake's answer to options it refuses

# argv[1]: the JSON of setup's arguments. Prints setup's and health_check's return codes as
# the last line of stdout (Mooncake logs to stderr).
PROBE_SCRIPT = """
import json, os, sys
from mooncake.store import MooncakeDistributedStore
a = json.loads(sys.argv[1])
s = MooncakeDistributedStore()
rc = s.setup(a["host"], a["meta"], 0, 0, a["protocol"], a["device"], a["master"], **a["extra"])
print(json.dumps({"setup": rc, "health": s.health_check() if rc == 0 else None}), flush=True)
os._exit(0)  # no close(): it can take seconds, and the process ends anyway
"""


def probe_master(o: MooncakeOptions) -> None:
    """StoreUnavailable unless the master's port accepts a connection within
    ``connect_timeout_s`` (an HA address such as ``etcd://...`` is not probed)."""
    addr = o.master_server_address
    if "://" in addr:
        return
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                 o.connect_timeout_s).close()
    except (OSError, ValueError) as e:
        raise StoreUnavailable(f"master {redact(addr)} not reachable: {e}") from None


def probe_setup(o: MooncakeOptions, extra: dict[str, object]) -> None:
    """StoreUnavailable unless a trial ``setup`` and ``health_check`` in a child process both
    succeed within ``probe_timeout_s``; ConfigError when Mooncake refuses the options."""
    where = f"master {redact(o.master_server_address)}"
    args = json.dumps({"host": o.local_hostname, "meta": o.metadata_server,
                       "protocol": o.protocol, "device": o.device_name,
                       "master": o.master_server_address, "extra": extra})
    try:
        child = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, args], check=False,
                               capture_output=True, text=True, timeout=o.probe_timeout_s)
    except subprocess.TimeoutExpired:
        raise StoreUnavailable(f"{where}: a trial setup did not finish within "
                               f"{o.probe_timeout_s:g} s (a hung master, or a port that is not "
                               "a Mooncake master)") from None
    except OSError as e:
        raise StoreUnavailable(f"{where}: a trial setup could not run: {e}") from None
    lines = child.stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if lines else {}
    except ValueError:
        got = {}
    if not isinstance(got, dict):
        got = {}
    if got.get("setup") == INVALID_PARAMS:
        raise ConfigError(f"mooncake L3: setup() refused the options ({INVALID_PARAMS} "
                          f"INVALID_PARAMS): check protocol and device_name ({o.describe()})")
    if got.get("setup") != 0 or got.get("health") != 0:
        detail = (f"setup {got.get('setup')}, health_check {got.get('health')}" if got
                  else f"exit {child.returncode}: {child.stderr.strip()[-300:]}")
        raise StoreUnavailable(f"{where}: trial setup failed ({detail})")
