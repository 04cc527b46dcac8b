"""Ctrl-C while ``hicached`` starts, before the daemon's own handler takes over (``serve``).

SIGINT raises KeyboardInterrupt, as Python's default does, and is remembered: code we import
(torch, aiohttp) may catch it (``except BaseException``) and go on, so the start would carry on
as if nothing was pressed. ``check`` raises it again at our next step.
"""

from __future__ import annotations

import signal

_seen = False


def install() -> None:
    """Take SIGINT (unless it is ignored: a background job's)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum, frame) -> None:
    global _seen
    _seen = True
    raise KeyboardInterrupt


def pressed() -> bool:
    return _seen


def check() -> None:
    """KeyboardInterrupt if Ctrl-C was pressed since ``install`` (and swallowed since)."""
    if _seen:
        raise KeyboardInterrupt
