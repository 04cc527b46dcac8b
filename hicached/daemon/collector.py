"""The control loop's garbage collector settings.

The index holds one long-lived object per page: the collector must not walk what startup built
(modules, the arena), nor run every 700 allocations (a request of a few hundred keys allocates
that much): each full pass is a pause of the loop.
"""

from __future__ import annotations

import gc


def freeze_survivors(phase: str, info: dict) -> None:
    """``gc`` callback: after a full collection, move what survived it to the permanent
    generation, so the next full pass walks only what was created since. Without it every full
    pass walks every page's index entry: ~100 ms per 256k pages, a stall of the control loop that
    grows with the arena. Frozen objects are still freed by reference counting (the index holds
    no reference cycles)."""
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


def tune_for_the_loop() -> None:
    """Freeze what exists now, collect rarely, and freeze what survives each full pass."""
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    if freeze_survivors not in gc.callbacks:
        gc.callbacks.append(freeze_survivors)
