"""The daemon's one frozen config object, resolved once at the edge (``ops/cli.py`` calls
``load_config``; ``hicached.ops.config`` re-exports this module for older imports).

Precedence: CLI flags > ``HICACHED_*`` environment > TOML file (``--config``) > defaults.
Unknown keys (file, flags) and bad values raise ``ConfigError`` naming the key; an unknown
``HICACHED_*`` variable is logged and ignored (the engine plugin's ``HICACHED_CLIENT_TOKEN`` and
others share the prefix). Library code receives a ``DaemonConfig``; the defaults of paths
(``hicached.settings.default_runtime_dir``, ``default_state_dir``: XDG variables) come from the
environment ``load_config`` is given.
Every key is documented, with its default, in ``configs/hicached.toml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import hashlib
import json
import logging
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

log = logging.getLogger(__name__)

from hicached.errors import ConfigError
from hicached.settings import WRITE_POLICIES, default_endpoint, default_state_dir, parse_size


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``hicached serve`` needs. Sizes in bytes, times in seconds."""

    endpoint: str = ""  # "" -> ipc://<runtime dir>/hicached.sock
    l2_size: int = 4 * 1024**3
    state_dir: str = ""  # "" -> $XDG_STATE_HOME/hicached, else ~/.local/state/hicached
    arena_path: str = ""  # "" -> /dev/shm/hicached-<digest of state_dir>
    slab_size: int = 64 * 1024**2
    l3_backend: str = "file"  # a name of hicached.backends.base.BACKENDS
    l3_dir: str = ""  # "" -> <state_dir>/l3
    l3_options: Mapping = field(default_factory=dict)  # keyword options of the backend
    store_env: Mapping = field(default_factory=dict)  # MOONCAKE_* etc. from the environment
    write_policy: str = "write_through"  # | write_through_selective | write_back
    write_through_threshold: int = 2  # write_through_selective: hits before a page goes to L3
    prefetch: bool = True  # exists that finds pages only in L3 starts pulling them into L2
    l3_load_chunk: int = 64 * 1024**2  # bytes an L3 load job moves at most (streamed gets)
    get_wait_s: float = 2.0  # longest a get / exists waits for L3 loads / lookups before missing
    l3_audit_s: float = 10.0  # ask L3 about the copies of the pages L2 evicts next (0: never)
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 30.0
    set_ahead_bytes: int = 128 * 1024**2  # set-ahead slots one client may hold (0: none)
    io_queue_depth: int = 256
    busy_poll_ms: float = 0.0  # after a request, poll without sleeping this long (0: never)
    shared_exists: bool = True  # publish L2 presence in shared memory (clients answer exists)
    presence_slots: int = 0  # slots of that table, a power of 2, 16 B each (0: l2_size / 4 KiB)
    shared_gets: bool = True  # publish slot tags there too (clients get known pages leaselessly)
    socket_mode: int = 0o600
    log_level: str = "info"
    # operations (docs/operating.md)
    admin_host: str = "127.0.0.1"  # admin HTTP API address
    admin_port: int = 0  # admin HTTP API port (0: no admin API)
    admin_api_key: str = field(default="", repr=False)  # Bearer key of mutating admin endpoints
    status_sample_s: float = 2.0  # the status page (GET /) samples /stats this often, 300 kept
    drain_timeout_s: float = 10.0  # SIGTERM: longest wait for in-flight work before exiting
    unchecked_idle_s: float = 600.0  # a client the daemon cannot check (tcp, other pid
    # namespace): its session ends after this long without a request (it joins again)
    socket_group: str = ""  # group of the ipc socket and the arena (mode 0660 then)
    client_token: str = field(default="", repr=False)  # clients must present it in the handshake
    kv_events_endpoint: str = ""  # ZeroMQ PUB of KV events for routers ("": off; kv-events.md)
    kv_events_replay_endpoint: str = ""  # ROUTER serving recent event batches ("": none)
    allow_tcp: bool = False  # tcp:// endpoints need this and a client_token
    namespace_quotas: Mapping = field(default_factory=dict)  # namespace -> max L2 bytes
    # which L2 pages go under memory pressure (docs/eviction.md): lru | prefix | hybrid | demote
    eviction: str = "hybrid"
    eviction_alpha: float = 1.0  # hybrid: weight of a page's value (tokens / bytes) vs recency
    # share of the arena each size class that had to evict keeps free, evicting ahead in the
    # control loop's idle turns, so that sets find room without evicting (0: off; eviction.md)
    evict_ahead: float = 0.0
    # warm restart (daemon/adoption.py): what a clean exit (SIGTERM, SIGINT, drain) does with
    # the arena: "free" removes it, "keep" leaves it (and its journal) for the next daemon of
    # this state dir, which adopts its committed pages; a crash always leaves it
    on_stop: str = "free"
    cold: bool = False  # discard a kept arena at start instead of adopting it

    def resolved(self, env: Mapping[str, str] | None = None) -> DaemonConfig:
        """Fill the derived defaults (paths: from ``env``'s XDG variables) and check values."""
        env = env or {}
        state = os.path.abspath(self.state_dir or default_state_dir(env))
        endpoint = absolute_ipc(self.endpoint or default_endpoint(env))
        arena = self.arena_path or "/dev/shm/hicached-" + hashlib.sha256(
            state.encode()).hexdigest()[:16]
        cfg = dataclasses.replace(self, state_dir=state, endpoint=endpoint, arena_path=arena,
                                  l3_dir=self.l3_dir or os.path.join(state, "l3"),
                                  kv_events_endpoint=absolute_ipc(self.kv_events_endpoint),
                                  kv_events_replay_endpoint=absolute_ipc(
                                      self.kv_events_replay_endpoint))
        cfg.check()
        return cfg

    def check(self) -> None:
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"endpoint: must start with ipc:// or tcp://, got {self.endpoint!r}")
        if self.slab_size % 64:
            raise ConfigError(f"slab_size: must be a multiple of 64 bytes, got {self.slab_size}")
        if self.l2_size < self.slab_size:
            raise ConfigError(
                f"l2_size: {self.l2_size} bytes is smaller than one slab ({self.slab_size} bytes)"
            )
        from hicached.backends.base import BACKENDS, is_backend_name

        if not is_backend_name(self.l3_backend):
            raise ConfigError(f"l3_backend: unknown {self.l3_backend!r}; valid: "
                              f"{sorted(BACKENDS)} or 'package.module:Class'")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy: unknown {self.write_policy!r}; "
                              f"valid: {list(WRITE_POLICIES)}")
        if self.write_through_threshold < 1:
            raise ConfigError("write_through_threshold: must be >= 1, got "
                              f"{self.write_through_threshold}")
        if self.get_wait_s <= 0:
            raise ConfigError(f"get_wait_s: must be > 0, got {self.get_wait_s}")
        if self.set_ahead_bytes < 0:
            raise ConfigError(f"set_ahead_bytes: must be >= 0, got {self.set_ahead_bytes}")
        from hicached.daemon.eviction.registry import EVICTIONS, is_policy_name

        if not is_policy_name(self.eviction):
            raise ConfigError(f"eviction: unknown {self.eviction!r}; valid: {list(EVICTIONS)} "
                              "or 'package.module:Class'")
        if not 0 <= self.eviction_alpha < 1e6:
            raise ConfigError(f"eviction_alpha: must be >= 0, got {self.eviction_alpha}")
        if not 0 <= self.evict_ahead <= 0.5:
            raise ConfigError(f"evict_ahead: must be a share of the arena between 0 (off) and "
                              f"0.5, got {self.evict_ahead}")
        p = self.presence_slots
        if p < 0 or (p and (p < 2 or p & (p - 1))):
            raise ConfigError(f"presence_slots: must be 0 (auto) or a power of 2, got {p}")
        if self.io_queue_depth < 1:  # queue.Queue(0) would be unbounded
            raise ConfigError(f"io_queue_depth: must be >= 1, got {self.io_queue_depth}")
        if self.busy_poll_ms < 0:
            raise ConfigError(f"busy_poll_ms: must be >= 0, got {self.busy_poll_ms}")
        for key in ("reservation_ttl_s", "lease_ttl_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.on_stop not in ON_STOP:
            raise ConfigError(f"on_stop: unknown {self.on_stop!r}; valid: {list(ON_STOP)}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level: unknown {self.log_level!r}; valid: {list(LOG_LEVELS)}")
        self._check_operations()

    def _check_operations(self) -> None:
        """Admin API, drain, permissions and quotas."""
        if not 0 <= self.admin_port <= 65535:
            raise ConfigError(f"admin_port: must be 0 (off) or a TCP port, got {self.admin_port}")
        if self.admin_port and not self.admin_host:
            raise ConfigError("admin_host: must be set when admin_port is")
        if not 0.05 <= self.status_sample_s <= 3600:
            raise ConfigError(f"status_sample_s: must be between 0.05 and 3600 s, "
                              f"got {self.status_sample_s}")
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            ep = getattr(self, key)
            if ep and not ep.startswith(("ipc://", "tcp://")):
                raise ConfigError(f"{key}: must be \"\" (off) or start with ipc:// or tcp://, "
                                  f"got {ep!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint: set kv_events_endpoint too")
        if self.l3_audit_s < 0:
            raise ConfigError(f"l3_audit_s: must be >= 0 (0: never), got {self.l3_audit_s}")
        if self.unchecked_idle_s <= 0:
            raise ConfigError(f"unchecked_idle_s: must be > 0, got {self.unchecked_idle_s}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket_mode: must be a permission mode like 0o600, "
                              f"got {self.socket_mode:#o}")
        self.socket_gid  # noqa: B018 - raises ConfigError naming socket_group if unknown
        if self.endpoint.startswith("tcp://") and not (self.allow_tcp and self.client_token):
            raise ConfigError(
                f"endpoint: {self.endpoint} is a tcp endpoint; anyone who can reach it could use "
                "the cache, so tcp is refused unless allow_tcp = true and a client_token is set")
        for ns, size in self.namespace_quotas.items():
            if not isinstance(ns, str) or not ns:
                raise ConfigError(f"namespace_quotas: namespace must be a non-empty string, "
                                  f"got {ns!r}")
            if not isinstance(size, int) or size <= 0:
                raise ConfigError(f"namespace_quotas.{ns}: must be a size > 0, got {size!r}")

    @property
    def socket_gid(self) -> int | None:
        """Group id of ``socket_group`` (None when unset)."""
        if not self.socket_group:
            return None
        try:
            if self.socket_group.isdigit():
                return grp.getgrgid(int(self.socket_group)).gr_gid
            return grp.getgrnam(self.socket_group).gr_gid
        except KeyError:
            raise ConfigError(
                f"socket_group: no group {self.socket_group!r} on this host") from None

    @property
    def access_mode(self) -> int:
        """Mode of the ipc socket and the arena: ``socket_mode``, group read/write added when a
        ``socket_group`` is set (0600 -> 0660)."""
        return self.socket_mode | 0o060 if self.socket_group else self.socket_mode

    def to_toml(self) -> str:
        """The config as a TOML file ``--config`` reads back (``--print-config``): secrets and the
        store's environment variables only as comments."""
        lines = ["# hicached effective config (hicached serve --print-config)", "[hicached]"]
        for key, value in dataclasses.asdict(self).items():
            if key == "store_env":
                lines += [f"# from the environment (not a key): {var}={val}"
                          for var, val in sorted(value.items())]
            elif key in SECRET_KEYS:
                lines.append(f"# {key} = <{'set' if value else 'unset'}, not printed>")
            elif key == "socket_mode":
                lines.append(f"{key} = {value:#o}")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    """A TOML literal of a config value (JSON's string escapes are TOML's)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


SECRET_KEYS = ("admin_api_key", "client_token")  # never printed nor logged

_SIZES = {"l2_size", "slab_size", "l3_load_chunk", "set_ahead_bytes"}
_ZERO_SIZES = {"set_ahead_bytes"}  # 0 turns the feature off


def parse_options(value: object, key: str = "l3_options") -> dict:
    """A dict from a TOML table, a JSON object string, or ``@file`` holding JSON."""
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a table or a JSON object, got {value!r}")
    text = value
    if text.startswith("@"):
        try:
            with open(text[1:]) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{key}: {e}") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: expected a JSON object, got {type(data).__name__}")
    return data


ON_STOP = ("free", "keep")  # what a clean exit does with the arena (``on_stop``)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _coerce(key: str, value: object) -> object:
    field_type = {f.name: f.type for f in fields(DaemonConfig)}[key]
    if key in _SIZES:
        return parse_size(value, key, allow_zero=key in _ZERO_SIZES)
    if key == "l3_options":
        return parse_options(value, key)
    if key == "namespace_quotas":
        return {ns: parse_size(size, f"{key}.{ns}")
                for ns, size in parse_options(value, key).items()}
    try:
        if field_type == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _BOOLS:
                return _BOOLS[value.lower()]
            raise ValueError
        if field_type == "int":
            if isinstance(value, str):
                if key == "socket_mode" and re.fullmatch(r"0[0-7]+", value.strip()):
                    return int(value, 8)  # the chmod spelling, 0600
                return int(value, 0)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError
            return value
        if field_type == "float":
            number = float(value)
            if math.isnan(number):  # NaN passes every `<= 0` check, then breaks every deadline
                raise ValueError
            return number
        if field_type == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {field_type}, got {value!r}") from None
    return value


def read_config_table(path: str) -> dict:
    """The ``[hicached]`` table of a TOML config file (or its top level); ConfigError if the
    file cannot be read."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from None
    if "hicached" not in data:
        return data
    others = sorted(set(data) - {"hicached"})
    if others:  # a key above the table, or another table: it would be silently ignored
        raise ConfigError(f"config file {path}: {others} outside the [hicached] table")
    if not isinstance(data["hicached"], dict):
        raise ConfigError(f"config file {path}: hicached must be a table")
    return data["hicached"]


# Environment variables L3 stores read as their own settings (SGLang's Mooncake variables), kept
# in the config object so no backend reads the process environment.
STORE_ENV_PREFIXES = ("MOONCAKE_", "SGLANG_MOONCAKE_")
STORE_ENV_NAMES = ("LOCAL_HOSTNAME",)
# HICACHED_* variables that are not daemon settings: the engine side's and the tests'
OTHER_ENV = ("HICACHED_CLIENT_TOKEN", "HICACHED_TEST_DEVICE", "HICACHED_TEST_PAUSE_AT",
             "HICACHED_TEST_CRASH_AT", "HICACHED_BENCH_")


def absolute_ipc(endpoint: str) -> str:
    """``endpoint`` with a relative ``ipc://`` path made absolute against the working directory
    now (ZeroMQ would resolve it against the daemon's, and a client elsewhere would not find
    it); other endpoints (tcp, ``ipc://@name``: Linux's abstract sockets, ``ipc://`` with no
    path) as given."""
    if not endpoint.startswith("ipc://"):
        return endpoint
    path = endpoint[len("ipc://"):]
    if not path or path.startswith(("/", "@")):
        return endpoint
    return "ipc://" + os.path.abspath(path)


def load_config(path: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, object] | None = None) -> DaemonConfig:
    """Merge file < env < overrides over the defaults; returns a resolved, checked config."""
    names = {f.name for f in fields(DaemonConfig)} - {"store_env"}
    values: dict[str, object] = {}
    if path:
        for key, value in read_config_table(path).items():
            if key not in names:
                raise ConfigError(f"{path}: unknown key {key!r}; valid: {sorted(names)}")
            values[key] = _coerce(key, value)
    values["store_env"] = {var: value for var, value in (env or {}).items()
                           if var.startswith(STORE_ENV_PREFIXES) or var in STORE_ENV_NAMES}
    for var, value in (env or {}).items():
        if not var.startswith("HICACHED_"):
            continue
        key = var[len("HICACHED_"):].lower()
        if key not in names:
            if not var.startswith(OTHER_ENV):  # a typo would otherwise go unnoticed
                near = difflib.get_close_matches(key, names, 1)
                log.warning("%s is not a hicached setting: ignored%s", var,
                            f" (did you mean HICACHED_{near[0].upper()}?)" if near else
                            " (settings: HICACHED_ + a key of configs/hicached.toml)")
            continue
        values[key] = _coerce(key, value)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in names:
            raise ConfigError(f"unknown option {key!r}")
        values[key] = _coerce(key, value)
    return DaemonConfig(**values).resolved(env)
