"""Tunes Python's garbage collector for the control loop (``tune_for_the_loop``, called once by
``server.Daemon.serve_forever``).

Each full pass of the collector is a pause of the loop, so it must not walk what startup built
(modules, the arena, the index's record arrays), nor run every 700 allocations (a request of a few
hundred keys allocates that much). An idle page is no Python object (``index.py``: its records
are numpy arrays); what the loop makes and keeps (sessions, leases and the ``Entry`` handles they
hold, parked requests) survives a full pass and is frozen out of the next ones.
"""

from __future__ import annotations

import gc


def freeze_survivors(phase: str, info: dict) -> None:
    """``gc`` callback: after a full collection, move what survived it to the permanent
    generation, so the next full pass walks only what was created since. Without it every full
    pass walks every object the loop keeps (the handles leases and reservations hold: up to one per
    page), a stall of the control loop that grows with the pages held. Frozen objects are still freed by reference counting (the index holds
    no reference cycles)."""
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


def tune_for_the_loop() -> None:
    """Freeze what exists now, collect rarely, and freeze what survives each full pass."""
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    if freeze_survivors not in gc.callbacks:
        gc.callbacks.append(freeze_survivors)
