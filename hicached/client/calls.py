"""What every client call checks and counts: its host indices (page starts inside the pool) and
the calls under way (``Client.close`` waits for them)."""

from __future__ import annotations

import operator
import threading
from typing import Any

from hicached.errors import InvalidTransfer, LengthMismatch


def token_starts(host_indices: Any, num_keys: int, page_size: int, pool: str,
                 capacity: int | None = None) -> list[int]:
    """Page-start token indices (``host_indices[i * page_size]``), checked: one page per key,
    integers at page starts inside the pool (``capacity`` tokens; None: unknown)."""
    n = len(host_indices) if host_indices is not None else 0
    if n != num_keys * page_size:
        raise LengthMismatch(
            f"pool {pool!r}: {num_keys} keys need {num_keys * page_size} host indices "
            f"(page_size {page_size}), got {n}"
        )
    starts = host_indices[::page_size]
    starts = starts.tolist() if hasattr(starts, "tolist") else list(starts)
    if not starts:
        return starts
    if not all(type(t) is int for t in starts):
        try:  # e.g. numpy integers in a list
            starts = [operator.index(t) for t in starts]
        except TypeError:
            bad = next(t for t in starts if not hasattr(t, "__index__"))
            raise InvalidTransfer(f"pool {pool!r}: host indices must be integers, got "
                                  f"{bad!r}") from None
    low, high = min(starts), max(starts)
    if low < 0 or (capacity is not None and high + page_size > capacity):
        raise InvalidTransfer(f"pool {pool!r}: host indices {low}..{high + page_size - 1} are "
                              f"outside the pool of {capacity} tokens")
    if page_size > 1 and any(t % page_size for t in starts):
        bad = next(t for t in starts if t % page_size)
        raise InvalidTransfer(f"pool {pool!r}: host index {bad} is not a page start (page_size "
                              f"{page_size})")
    return starts


class InFlight:
    """Sets and gets running in this client's threads: ``Client.close`` lets them end (their
    commits go out, their leased copies finish) before its ``Bye`` frees their slots."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._count = 0

    def __enter__(self) -> None:
        with self._cond:
            self._count += 1

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._count -= 1
            if not self._count:
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until none runs (True) or ``timeout_s`` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._count, timeout_s)
