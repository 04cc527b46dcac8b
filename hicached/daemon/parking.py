"""Requests parked while they wait: gets for L3 loads or another client's commit, exists for the
store's lookup, ``WaitStored`` for L3 writes (``sessions.ParkedGet`` / ``ParkedExists`` /
``ParkedStore``).

``Parking`` owns the parked requests (id -> request) and, per uncommitted page, the gets that
wait for its commit. It answers nothing itself: the controller answers a request and then
``settle``s it here, so that nothing it waited for answers it again. Control loop only.
"""

from __future__ import annotations

from hicached.daemon.sessions import ParkedExists, ParkedGet, ParkedStore

Parked = ParkedGet | ParkedExists | ParkedStore


class Parking:
    """The parked requests and the gets waiting for pages being written (see the module
    docstring)."""

    def __init__(self) -> None:
        self.parked: dict[int, Parked] = {}  # id -> request waiting for L3
        self.pending_waiters: dict = {}  # uncommitted page (Entry) -> the gets waiting for it

    def park(self, parked: Parked) -> None:
        """``parked`` waits (until its jobs are done or its deadline)."""
        self.parked[id(parked)] = parked

    def wait_for_commit(self, e, parked: ParkedGet) -> None:
        """The get ``parked`` waits for the commit (or abort) of page ``e``."""
        self.pending_waiters.setdefault(e, []).append(parked)
        parked.pending.append(e)
        parked.jobs.add(id(e))

    def waiting_on(self, e) -> list[ParkedGet]:
        """The gets that waited for page ``e`` (committed or aborted now), taken."""
        return self.pending_waiters.pop(e, ())

    def settle(self, parked: Parked) -> None:
        """``parked`` is answered: nothing it waited for may answer it again."""
        parked.answered = True
        self.parked.pop(id(parked), None)
        for e in parked.pending:  # e.g. pages whose reservation expired uncommitted
            waiting = self.pending_waiters.get(e)
            if waiting is not None:
                waiting[:] = [p for p in waiting if p is not parked]
                if not waiting:
                    del self.pending_waiters[e]

    def due(self, now: float) -> list[Parked]:
        """The parked requests whose deadline has come."""
        return [p for p in self.parked.values() if p.deadline <= now]

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self.parked.values()), default=None)

    def __len__(self) -> int:
        return len(self.parked)

    def values(self):
        return self.parked.values()
