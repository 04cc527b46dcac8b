"""The arguments of a ``Client`` (and of its set calls' chains), checked before anything is
connected or sent: a wrong one is an ``InvalidArgument`` naming it, not a ZeroMQ error or a
protocol error deep in the handshake."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from hicached.errors import InvalidArgument
from hicached.protocol import MAX_KEY_LEN

MAX_NAMESPACE_LEN = 4096  # characters; the SGLang plugin's namespaces are a few hundred


def _number(name: str, value: object, minimum: float, inclusive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number of seconds, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite or value < minimum or (value == minimum and not inclusive):
        raise InvalidArgument(f"{name} must be {'>=' if inclusive else '>'} {minimum:g} "
                              f"seconds, got {value!r}")


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{name} must be an int >= 0, got {value!r}")


def check_client_args(endpoint: object, namespace: object, timeout_s: object,
                      client_name: object, spin_s: object, token: object,
                      remember_pages: object, set_ahead_bytes: object, release_delay_s: object,
                      shared_exists: object, shared_gets: object) -> None:
    """``InvalidArgument`` for the first argument of ``Client(...)`` that is unusable."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://")) \
            or len(endpoint) <= len("ipc://"):
        raise InvalidArgument(f"endpoint must be 'ipc:///path/to/socket' or 'tcp://host:port' "
                              f"(the daemon's, see `hicached serve --help`), got {endpoint!r}")
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgument(f"namespace must be a non-empty str (model, revision, dtype, "
                              f"layout, parallel slice, tenant), got {namespace!r}")
    if len(namespace) > MAX_NAMESPACE_LEN:
        raise InvalidArgument(f"namespace must be at most {MAX_NAMESPACE_LEN} characters, got "
                              f"{len(namespace)}")
    _number("timeout_s", timeout_s, 0, inclusive=False)
    _number("spin_s", spin_s, 0, inclusive=True)
    _number("release_delay_s", release_delay_s, 0, inclusive=True)
    if not isinstance(client_name, str):
        raise InvalidArgument(f"client_name must be a str, got {client_name!r}")
    if token is not None and not isinstance(token, str):
        raise InvalidArgument(f"token must be a str, got {type(token).__name__}")
    _count("remember_pages", remember_pages)
    _count("set_ahead_bytes", set_ahead_bytes)
    for name, value in (("shared_exists", shared_exists), ("shared_gets", shared_gets)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{name} must be True or False, got {value!r}")


class Chain(NamedTuple):
    """Where a set call's pages hang (``Reserve.anchor_pool`` / ``parent`` / ``depth``, wire
    values: "" and -1 when not said)."""

    anchor_pool: str
    parent: str
    depth: int
    trailing: tuple[str, ...] = ()  # the call's pools with TRAILING_PAGES hits


NO_CHAIN = Chain("", "", -1)
MAX_DEPTH = 1 << 40  # pages before a key (``protocol.Depth``)


def check_chain(parent: object, depth: object, anchor_pool: object, pools: Sequence[str]
                ) -> Chain:
    """The wire values of a set call's ``parent`` / ``depth`` / ``anchor_pool`` arguments, or
    ``InvalidArgument`` for the first that is unusable (``pools``: the call's, in order)."""
    if parent is not None and (not isinstance(parent, str) or not parent
                               or len(parent) > MAX_KEY_LEN):
        raise InvalidArgument(f"parent must be None or a key (a non-empty str of at most "
                              f"{MAX_KEY_LEN} characters), got {parent!r:.80}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                              or not 0 <= depth <= MAX_DEPTH):
        raise InvalidArgument(f"depth must be None or an int in [0, {MAX_DEPTH}] (pages "
                              f"before the call's first key), got {depth!r}")
    if parent is not None and depth == 0:
        raise InvalidArgument(f"depth 0 says the first key is a root, but parent is {parent!r}")
    if anchor_pool is not None:
        name = getattr(anchor_pool, "value", anchor_pool)
        if name not in pools:
            raise InvalidArgument(f"anchor_pool must be None or one of the call's pools "
                                  f"{list(pools)}, got {anchor_pool!r}")
        anchor_pool = name
    return Chain(anchor_pool or "", parent or "", -1 if depth is None else depth)
