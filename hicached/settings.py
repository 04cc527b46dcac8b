"""Config helpers every side reads the same way: byte sizes (``4GiB``, ``512MiB``, ``1e9``), the
default endpoint, and the default directories of a daemon's socket and state (XDG variables).

The daemon's config (``hicached.daemon.config``), the L3 backends' options and the SGLang plugin's
settings all parse sizes here, so "4gb" means the same bytes everywhere; the daemon and the engine
read the one ``WRITE_POLICIES``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hicached.errors import ConfigError

# how committed pages reach L3: the daemon's ``write_policy`` and the engine's
# ``--hicache-write-policy`` (``daemon/l3/tier.py`` says what each does). The one definition.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}


MAX_SIZE = 1 << 56  # 64 PiB: past any machine, and far from what a C long holds


def parse_size(value: object, key: str = "size", allow_zero: bool = False) -> int:
    """Bytes from an int or a string such as ``4GiB``, ``512MiB``, ``1e9`` (> 0, or >= 0 with
    ``allow_zero``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: cannot read {value!r} as a size (e.g. 4GiB, 512MiB, 1e9)")
        try:
            exact = float(m.group(1)) * _UNITS[m.group(2).lower()]
            n = int(exact)
        except (ValueError, OverflowError):
            raise ConfigError(f"{key}: cannot read {value!r} as a size") from None
        if n != exact:
            raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
    if n > MAX_SIZE:
        raise ConfigError(f"{key}: {value!r} is more than {MAX_SIZE >> 50} PiB")
    if n < 0 or (n == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>=' if allow_zero else '>'} 0 bytes, got {value!r}")
    return n


def default_runtime_dir(env: Mapping[str, str]) -> str:
    """Where the default socket lives: ``$XDG_RUNTIME_DIR/hicached``, else a per-user folder
    of ``/tmp`` (``env``: the process environment, read by the entry point)."""
    xdg = env.get("XDG_RUNTIME_DIR")  # (set but empty: as if unset)
    return os.path.join(xdg, "hicached") if xdg else f"/tmp/hicached-{os.getuid()}"


def default_endpoint(env: Mapping[str, str]) -> str:
    """The endpoint ``hicached serve`` listens on by default: ``ipc://`` and the socket
    ``hicached.sock`` in ``default_runtime_dir(env)``. It depends on the user (their
    ``XDG_RUNTIME_DIR``, else their uid): a client of another user than the daemon's, or of the
    systemd unit's daemon (``UNIT_ENDPOINT``), must name the endpoint."""
    return f"ipc://{default_runtime_dir(env)}/hicached.sock"


def process_default_endpoint() -> str:
    """``default_endpoint`` of this process's environment (read here, where settings are read:
    a ``Client`` given no endpoint asks this once)."""
    return default_endpoint(os.environ)


UNIT_ENDPOINT = "ipc:///run/hicached/hicached.sock"  # configs/hicached.service's socket


def default_state_dir(env: Mapping[str, str]) -> str:
    """Where the default state (the file L3, the config) lives: ``$XDG_STATE_HOME/hicached``,
    else ``~/.local/state/hicached``."""
    base = env.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "hicached")
