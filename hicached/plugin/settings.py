"""The SGLang plugin's settings: the ``extra_config`` keys it reads (``hicached.plugin.sglang``
documents each), validated once when SGLang builds the backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicached.settings import default_endpoint

CLEAR_TIERS = ("all", "l2", "none")
CLEAR_SCOPES = ("namespace", "node")  # what clear() flushes: this rank's namespace, or all


@dataclass(frozen=True)
class PluginSettings:
    """The extra_config keys this plugin reads (see the module docstring)."""

    endpoint: str
    timeout_s: float = 6.0
    retry_interval_s: float = 1.0
    model_name: str = ""
    model_revision: str = ""
    namespace_salt: str = ""
    kv_cache_dtype: str = ""  # SGLang's --kv-cache-dtype (fp8 formats all store as uint8)
    clear_tier: str = "all"
    clear_scope: str = "namespace"
    allocator: str = ""
    token: str = field(default="", repr=False)  # the daemon's client_token (never logged)

    @classmethod
    def from_extra_config(cls, extra: dict | None, env: Mapping[str, str] | None = None
                          ) -> PluginSettings:
        """Validated settings; raises ValueError naming the bad key (SGLang fails the attach).
        ``env``: the engine's environment (``HICACHED_CLIENT_TOKEN`` when no ``token`` key)."""
        extra = dict(extra or {})
        endpoint = extra.get("endpoint") or ""
        if not endpoint and extra.get("socket"):
            endpoint = f"ipc://{extra['socket']}"
        endpoint = endpoint or default_endpoint(env or {})
        if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"hicached extra_config endpoint must start with ipc:// or tcp://, "
                             f"got {endpoint!r}")
        out: dict[str, Any] = {"endpoint": endpoint}
        for key in ("timeout_s", "retry_interval_s"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"hicached extra_config {key} must be a number > 0, "
                                     f"got {value!r}")
                out[key] = float(value)
        for key in ("model_name", "model_revision", "namespace_salt", "kv_cache_dtype",
                    "allocator"):
            if extra.get(key) is not None:
                out[key] = str(extra[key])
        tier = extra.get("clear_tier", "all")
        if tier not in CLEAR_TIERS:
            raise ValueError(f"hicached extra_config clear_tier must be one of {CLEAR_TIERS}, "
                             f"got {tier!r}")
        out["clear_tier"] = tier
        scope = extra.get("clear_scope", "namespace")
        if scope not in CLEAR_SCOPES:
            raise ValueError(f"hicached extra_config clear_scope must be one of {CLEAR_SCOPES}, "
                             f"got {scope!r}")
        out["clear_scope"] = scope
        token = extra.get("token", (env or {}).get("HICACHED_CLIENT_TOKEN", ""))
        if not isinstance(token, str):
            raise ValueError(f"hicached extra_config token must be a string, got "  # noqa: TRY004
                             f"{type(token).__name__}")  # (SGLang reports ValueErrors)
        out["token"] = token
        return cls(**out)
