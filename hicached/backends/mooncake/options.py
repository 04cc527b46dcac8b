"""Options of the Mooncake backend: SGLang's Mooncake keys, their ``MOONCAKE_*`` variables, ours.

An SGLang operator's Mooncake JSON (``extra_config`` / ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``)
works unchanged as ``--l3-options``. Each value comes from, in order: the option, the environment
variable SGLang reads for it, the default below; as in SGLang, ``local_hostname`` is the exception:
its environment variables win over the option (one config file serves every node, each node
says its own address). Unknown keys raise ``ConfigError`` naming them.

    option                 environment                               default
    master_server_address  MOONCAKE_MASTER                           (required)
    protocol               MOONCAKE_PROTOCOL                         rdma       (tcp | rdma)
    device_name            MOONCAKE_DEVICE                           ""         (RDMA NICs)
    metadata_server        MOONCAKE_TE_META_DATA_SERVER              P2PHANDSHAKE
    global_segment_size    MOONCAKE_GLOBAL_SEGMENT_SIZE              4GiB  (0: contribute none;
                                                                     else at least 16MiB)
    local_buffer_size      SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE         16MiB (only non-zero-copy
                                                                     calls use it)
    local_hostname         MOONCAKE_LOCAL_HOSTNAME, LOCAL_HOSTNAME   localhost  (others must reach
                                                                     this node's segment there)
    tenant_id              MOONCAKE_TENANT_ID                        default
    enable_ssd_offload     MOONCAKE_ENABLE_SSD_OFFLOAD               false
    ssd_offload_path       MOONCAKE_OFFLOAD_FILE_STORAGE_PATH        (Mooncake's)

hicached's own (no environment variable; they are daemon behaviour, not Mooncake's):

    timeout_s          2.0       deadline of one batch_put / batch_get call (worker threads) ...
    timeout_per_gib_s  10.0      ... plus this per GiB it moves (a floor of ~100 MB/s), so a big
                                 batch on a slow but working network is not abandoned midway
    exists_timeout_s   0.5       deadline of one exists call (the daemon's lookups queue on it)
    connect_timeout_s  1.0       TCP probe of the master before ``setup`` (which holds the GIL)
    probe_timeout_s    15.0      ... then a ``setup`` in a child process must succeed within this
                                 (a port that accepts but is no Mooncake master, or a hung one,
                                 would hold the daemon's GIL for minutes)
    backoff_s          0.5       first retry delay once the store is found unavailable ...
    max_backoff_s      8.0       ... doubling up to this
    close_timeout_s    5.0       close() waits this long for running calls
    max_call_threads   16        helper threads (calls stuck past their deadline keep one each)
    key_prefix         hicached  first part of every object key; clear() removes only these

SGLang keys that mean nothing to a daemon are accepted and ignored (logged once):
``master_metrics_port``, ``check_server``, ``extra_backend_tag``, ``enable_group_semantics``,
and ``standalone_storage`` / ``client_server_address`` as long as they ask for no dummy client.
Sizes are ints or strings read by ``hicached.settings.parse_size`` (note: "4gb" there is 4e9
bytes; SGLang reads it as 4 GiB).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hicached.errors import ConfigError
from hicached.settings import parse_size

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
MIN_SEGMENT = 16 << 20  # Mooncake refuses a smaller global segment (setup answers -600)

# option -> environment variables SGLang reads for it (first set one wins)
ENV = {
    "master_server_address": ("MOONCAKE_MASTER",),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "device_name": ("MOONCAKE_DEVICE",),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER",),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
    "local_buffer_size": ("SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE",),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"),
    "tenant_id": ("MOONCAKE_TENANT_ID",),
    "enable_ssd_offload": ("MOONCAKE_ENABLE_SSD_OFFLOAD",),
    "ssd_offload_path": ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",),
}

SGLANG_IGNORED = ("master_metrics_port", "check_server", "extra_backend_tag",
                  "enable_group_semantics", "standalone_storage", "client_server_address")

_PREFIX = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class MooncakeOptions:
    """Resolved options (sizes in bytes, times in seconds). Build with ``resolve``."""

    master_server_address: str
    protocol: str = "rdma"  # SGLang's default
    device_name: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 4 * 1024**3
    local_buffer_size: int = 16 * 1024**2
    local_hostname: str = "localhost"
    tenant_id: str = "default"
    enable_ssd_offload: bool = False
    ssd_offload_path: str | None = None
    timeout_s: float = 2.0
    timeout_per_gib_s: float = 10.0
    exists_timeout_s: float = 0.5
    connect_timeout_s: float = 1.0
    probe_timeout_s: float = 15.0
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    close_timeout_s: float = 5.0
    max_call_threads: int = 16
    key_prefix: str = "hicached"

    @classmethod
    def resolve(cls, options: Mapping[str, object], env: Mapping[str, str]) -> MooncakeOptions:
        """Options > SGLang's environment variables > defaults, checked; ConfigError names the
        offending key."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in options if k not in names and k not in SGLANG_IGNORED]
        if unknown:
            raise ConfigError(f"l3_options: unknown Mooncake option(s) {unknown}; valid: "
                              f"{sorted(names)} (SGLang-only, ignored: {list(SGLANG_IGNORED)})")
        _check_ignored(options)
        values: dict[str, object] = {}
        for name in names:
            from_env = next((env[var] for var in ENV.get(name, ()) if env.get(var)), None)
            if name == "local_hostname" and from_env is not None:
                values[name] = from_env  # SGLang's order: each node's own address wins
            elif name in options and options[name] is not None:
                values[name] = options[name]
            elif from_env is not None:
                values[name] = from_env
        if "master_server_address" not in values:
            raise ConfigError("l3_options: master_server_address is required for the mooncake "
                              "backend (or set MOONCAKE_MASTER=host:port)")
        return cls(**{k: _coerce(k, v) for k, v in values.items()}).checked()

    def checked(self) -> MooncakeOptions:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"l3_options: protocol must be one of {list(PROTOCOLS)}, "
                              f"got {self.protocol!r}")
        if self.device_name.lstrip().startswith("{"):
            raise ConfigError("l3_options: device_name as a per-TP-rank JSON map is an SGLang "
                              "engine feature; the daemon is one client per node: give the "
                              "device list itself (e.g. 'mlx5_0,mlx5_1')")
        if not _PREFIX.match(self.key_prefix):
            raise ConfigError(f"l3_options: key_prefix must match {_PREFIX.pattern}, "
                              f"got {self.key_prefix!r}")
        if 0 < self.global_segment_size < MIN_SEGMENT:
            raise ConfigError(f"l3_options: global_segment_size must be 0 (contribute none) or "
                              f"at least 16MiB (Mooncake's minimum), got "
                              f"{self.global_segment_size} bytes")
        for key in ("timeout_s", "exists_timeout_s", "connect_timeout_s", "probe_timeout_s",
                    "backoff_s", "max_backoff_s", "close_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"l3_options: {key} must be > 0, got {getattr(self, key)}")
        if self.timeout_per_gib_s < 0:
            raise ConfigError(f"l3_options: timeout_per_gib_s must be >= 0, "
                              f"got {self.timeout_per_gib_s}")
        if self.max_call_threads < 1:
            raise ConfigError(f"l3_options: max_call_threads must be >= 1, "
                              f"got {self.max_call_threads}")
        return self

    def describe(self) -> str:
        """One log line with nothing secret in it (addresses lose any ``user:password@``)."""
        return (f"master {redact(self.master_server_address)}, protocol {self.protocol}, "
                f"metadata {redact(self.metadata_server)}, segment "
                f"{self.global_segment_size / 2**20:.0f} MiB, hostname {self.local_hostname}")


def redact(address: str) -> str:
    """``etcd://user:secret@host:2379`` -> ``etcd://***@host:2379`` (credentials never logged)."""
    return re.sub(r"(^|//)[^/@]*@", r"\1***@", address)


def _check_ignored(options: Mapping[str, object]) -> None:
    if _flag("standalone_storage", options.get("standalone_storage", False)):
        raise ConfigError("l3_options: standalone_storage (SGLang's dummy client) is not "
                          "supported: the daemon is itself the Mooncake client of this node")
    if options.get("client_server_address") and not options.get("master_server_address"):
        raise ConfigError("l3_options: client_server_address (a dummy client) is not supported; "
                          "give master_server_address")
    ignored = [k for k in SGLANG_IGNORED if k in options]
    if ignored:
        log.info("mooncake: ignoring SGLang-only options %s (the daemon's namespace already "
                 "isolates models and tenants)", ignored)


def _flag(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"l3_options: {key}: expected a boolean, got {value!r}")


def _coerce(key: str, value: object) -> object:
    kind = {f.name: f.type for f in dataclasses.fields(MooncakeOptions)}[key]
    if key == "global_segment_size" and str(value).strip() in ("0", ""):
        return 0  # a pure client: stores pages in other nodes' segments only
    if key in ("global_segment_size", "local_buffer_size"):
        return parse_size(value, f"l3_options: {key}")
    if kind == "bool":
        return _flag(key, value)
    try:
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"l3_options: {key}: expected {kind}, got {value!r}") from None
    if not isinstance(value, str):
        raise ConfigError(f"l3_options: {key}: expected a string, got {value!r}")
    return value
