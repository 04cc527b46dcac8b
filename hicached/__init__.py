"""hicached: a per-node tiered KV-cache storage daemon for LLM inference engines.

Engine side: ``Client`` speaks SGLang's HiCache v2 storage API (``batch_exists_v2`` /
``batch_get_v2`` / ``batch_set_v2`` and the v1 KV calls) to the node's daemon.
Daemon side: ``hicached serve`` (``hicached.daemon.server.Daemon``).
"""

from hicached.errors import (
    DaemonUnavailable,
    HicachedError,
    InvalidArgument,
    InvalidTransfer,
    LengthMismatch,
    PageSizeMismatch,
    ProtocolError,
    RequestTooLarge,
    ShuttingDown,
    Unauthorized,
    UnknownPool,
    VersionMismatch,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "DaemonUnavailable",
    "HicachedError",
    "HostPool",
    "InvalidArgument",
    "InvalidTransfer",
    "LengthMismatch",
    "PageSizeMismatch",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "ProtocolError",
    "RequestTooLarge",
    "ShuttingDown",
    "Unauthorized",
    "UnknownPool",
    "VersionMismatch",
]


_TYPES = ("PoolHitPolicy", "PoolName", "PoolTransfer", "PoolTransferResult")


def __getattr__(name: str):
    # Client and HostPool pull in torch and zmq; the daemon's CLI can start without paying that
    # until it needs them. The types too (typing, dataclasses): this module runs before the
    # CLI can take Ctrl-C (ops/interrupts.py), so the less it imports the shorter that window.
    if name in _TYPES:
        from hicached import types

        return getattr(types, name)
    if name == "Client":
        from hicached.client.api import Client

        return Client
    if name == "HostPool":
        from hicached.client.hostpool import HostPool

        return HostPool
    raise AttributeError(f"module 'hicached' has no attribute {name!r}")
