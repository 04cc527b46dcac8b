"""Typed errors shared by the daemon and the client.

Every error the daemon answers carries a stable ``code`` string on the wire (``protocol.Error``);
the client turns it back into the matching class with :func:`error_from_code`.
"""

from __future__ import annotations


class HicachedError(Exception):
    """Base class of every hicached error."""

    code = "internal"


class DaemonUnavailable(HicachedError):
    """The daemon did not answer within the client's deadline (or its socket does not exist)."""

    code = "unavailable"


class ProtocolError(HicachedError):
    """A frame could not be decoded, or a message is not valid in this state."""

    code = "malformed"


class RequestTooLarge(ProtocolError):
    """One request would exceed ``protocol.MAX_REQUEST_BYTES`` (split the call)."""

    code = "too_large"


class VersionMismatch(HicachedError):
    """Client and daemon speak different protocol versions."""

    code = "version_mismatch"


class UnknownSession(HicachedError):
    """The session id is not known to the daemon (no handshake, or the daemon restarted)."""

    code = "unknown_session"


class UnknownPool(HicachedError):
    """A call names a pool this session never registered."""

    code = "unknown_pool"


class PageSizeMismatch(HicachedError):
    """A pool is registered with a page size other than the one its namespace already uses."""

    code = "page_size_mismatch"


class LengthMismatch(HicachedError):
    """keys / host_indices / flags of one call do not have matching lengths."""

    code = "length_mismatch"


class InvalidTransfer(HicachedError, ValueError):
    """A call's transfers are unusable: host indices that are not integer page starts inside
    the pool, keys (or a parent key) that are not strings or longer than
    ``protocol.MAX_KEY_LEN``, a pool named twice in one call, an anchor pool that is not one of
    the call's. Nothing of the call was stored or copied."""

    code = "invalid_transfer"


class InvalidArgument(HicachedError, ValueError, TypeError):
    """An argument of a ``Client`` (or another public constructor) is of the wrong type or out
    of range; the message names it. Raised before anything is connected or sent."""

    code = "invalid_argument"


class ArenaError(HicachedError):
    """The shared-memory arena cannot be created or mapped, or a slot is out of its bounds."""

    code = "arena"


class ShuttingDown(HicachedError):
    """The daemon is draining and takes no new work."""

    code = "shutting_down"


class Unauthorized(HicachedError):
    """The handshake lacked the daemon's client token (or had a wrong one), or a request came on
    a connection that never completed an authorized handshake."""

    code = "unauthorized"


class ConfigError(HicachedError, ValueError):
    """A configuration key or value is invalid; the message names the key."""

    code = "config"


class BackendError(HicachedError):
    """An L3 backend could not be attached or used (bad options, unreachable store)."""

    code = "backend"


class BackendUnavailable(BackendError):
    """An L3 backend was created but could not be opened (store unreachable, mount missing)."""

    code = "backend_unavailable"


class BackendConflict(BackendError):
    """Another L3 backend is attached (or being attached): detach it first."""

    code = "backend_conflict"


class NoL3(BackendError):
    """The daemon has no L3 backend attached (or it was detached while a call waited for it):
    a call that needs L3 (``Client.wait_stored``) cannot succeed there."""

    code = "no_l3"


class NotStored(BackendError):
    """Named pages are not stored in L3 and will not be: their write failed (the store is
    full or failing), the writer's queue was full, or a page is in neither L2 nor L3 (evicted
    before its write, or never committed). The message names how many and why."""

    code = "not_stored"


class StoreTimeout(NotStored):
    """Named pages were not stored in L3 within the call's deadline (their writes or lookups
    are still under way: a slow or hung store)."""

    code = "store_timeout"


_BY_CODE = {
    cls.code: cls
    for cls in (
        HicachedError,
        DaemonUnavailable,
        ProtocolError,
        RequestTooLarge,
        VersionMismatch,
        UnknownSession,
        UnknownPool,
        PageSizeMismatch,
        LengthMismatch,
        InvalidTransfer,
        ArenaError,
        ShuttingDown,
        Unauthorized,
        ConfigError,
        BackendError,
        BackendUnavailable,
        BackendConflict,
        NoL3,
        NotStored,
        StoreTimeout,
    )
}


def error_from_code(code: str, message: str) -> HicachedError:
    """Rebuild the typed error a daemon answered (unknown codes become ``HicachedError``)."""
    return _BY_CODE.get(code, HicachedError)(message)
