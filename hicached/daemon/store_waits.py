"""The controller's ``WaitStored``: answer once named committed pages are stored in L3.

Why: a commit makes pages visible to the clients of one daemon. A client of another daemon
that shares the store (the PD decode on another node) sees them only once they are in L3, and
no write policy says when that is: write-through writes on a worker thread after the commit,
write-back only under pressure, selective writes only after enough hits. The PD prefill must
not say "ready" before; this request is its way to know.

Per named page (``wait_stored``), on the control loop, never blocking it:

    known to be in L3 (written or loaded here)        stored
    in L2, being written                              wait for that put job
    in L2, not in L3                                  written now, whatever the policy
                                                      (``L3Writes.store_now``), then waited for
    not in L2, not known in L3                        the store is asked (an exists on the
                                                      prober thread; the absent memory is not
                                                      trusted: another node may have written it)

The request is parked (``ParkedStore``) until its jobs are done (``on_io_done`` of the
controller), then answered ``Ok``, or ``NotStored`` naming the pages whose write failed or
that are nowhere; at its deadline ``StoreTimeout``. No L3 attached: ``NoL3`` at once (also
when it was detached while the request waited).

``StoreWaits`` owns nothing but its counters (``store_waits``, ``store_wait_timeouts`` in the
controller's ``counters``); it parks requests in ``parking``, starts writes and lookups on the
tier, and reads the index, the pools' geometry and the sessions. Control loop only.
"""

from __future__ import annotations

from collections.abc import Callable

from hicached import protocol as P
from hicached.daemon.parking import Parking
from hicached.daemon.sessions import ParkedStore, Session
from hicached.errors import HicachedError, InvalidTransfer, NoL3, NotStored, StoreTimeout

SHOWN_KEYS = 3  # keys an error message names (of how many)


class StoreWaits:
    """``wait_stored`` and its late answer (``answer``; see the module docstring)."""

    def __init__(self, index, tier, parking: Parking, sessions, geometry: dict,
                 counters: dict, clock: Callable[[], float]) -> None:
        self.index = index
        self.tier = tier
        self.parking = parking
        self.sessions = sessions
        self.geometry = geometry  # (ns, pool) -> page_bytes (the controller's, read only)
        self.counters = counters
        self.clock = clock

    def wait_stored(self, s: Session, msg: P.WaitStored,
                    reply: Callable[[P.Ok | P.Error], None]) -> P.Ok | None:
        """See the module docstring: ``Ok`` now, None (parked: ``reply`` answers later), or a
        typed error raised."""
        for t in msg.transfers:
            if (s.ns, t.pool) not in self.geometry:
                s.spec(t.pool)  # UnknownPool
            if t.keys and max(map(len, t.keys)) > P.MAX_KEY_LEN:  # (no page has such a key)
                raise InvalidTransfer(f"pool {t.pool!r}: a key is longer than "
                                      f"{P.MAX_KEY_LEN} characters")
        tier = self.tier
        if not tier.attached:
            raise NoL3("no L3 backend is attached to this daemon: its pages are visible to its "
                       "own clients only (attach one, or wait for the commit instead)")
        self.counters["store_waits"] += 1
        parked = ParkedStore(s, msg, reply, self.clock() + msg.timeout_s)
        write, unqueued = [], 0
        for t in msg.transfers:
            table = (s.ns, t.pool)
            keys = list(dict.fromkeys(t.keys))
            ask = []
            for key, e in zip(keys, self.index.get_many(table, keys)):
                parked.pages.append((table, key))
                if tier.is_known(table, key) or (e is not None and e.in_l3):
                    continue
                if e is None:
                    ask.append(key)
                else:
                    write.append(e)
            if ask:
                job = tier.probe(table, ask, parked)
                if job is None:
                    unqueued += len(ask)
                else:
                    parked.probes.append(job)
                    parked.jobs.add(id(job))
        if write:
            parked.writes = tier.writes.store_now(write, parked)
            parked.jobs.update(id(job) for job in parked.writes)
            unqueued += sum(not e.in_l3 and not e.writing for e in write)
        if unqueued:  # the prober's or writer's queue is full: no use waiting
            self.parking.settle(parked)
            raise NotStored(f"{unqueued} of {len(parked.pages)} pages could not be queued for "
                            "L3 (its worker queues are full); try again")
        if parked.jobs:
            self.parking.park(parked)
            return None
        self.parking.settle(parked)
        return P.Ok(msg.req_id)

    def answer(self, parked: ParkedStore, final: bool) -> None:
        """A parked ``WaitStored``: ``Ok`` when every page is stored now, else the error."""
        self.parking.settle(parked)
        if parked.session.id not in self.sessions:
            return
        try:
            self._check_stored(parked, final)
            answer = P.Ok(parked.msg.req_id)
        except HicachedError as e:
            answer = P.Error(parked.msg.req_id, e.code, str(e))
        parked.reply(answer)

    def _check_stored(self, parked: ParkedStore, final: bool) -> None:
        """Raise unless every page of ``parked`` is in L3 now. A page counts as stored when
        the tier knows it (written or loaded here), its L2 page is clean, or a finished job
        of the attached backend said so (a put that stored it, an exists that found it)."""
        tier, ix = self.tier, self.index
        if not tier.attached:
            raise NoL3("the L3 backend was detached while waiting for pages to be stored")
        done: set[tuple[tuple[str, str], str]] = set()
        looking: set[tuple[tuple[str, str], str]] = set()  # lookups the store has not answered
        for job in (*parked.writes, *parked.probes):
            table = (job.ns, job.pool)
            if len(job.result) != len(job.keys):
                looking.update((table, k) for k in job.keys)
            elif job.backend is tier.backend:
                done.update((table, k) for k, ok in zip(job.keys, job.result) if ok)
        busy, failed, nowhere = [], [], []
        for table, key in parked.pages:
            if (table, key) in done or tier.is_known(table, key):
                continue
            e = ix.get(table, key)
            if e is not None and e.in_l3:
                continue
            if (table, key) in looking or (e is not None and e.writing):
                busy.append(key)
            elif e is not None:
                failed.append(key)
            else:
                nowhere.append(key)
        if not (busy or failed or nowhere):
            return
        n = len(parked.pages)
        parts = []
        if busy:
            parts.append(f"{len(busy)} still being written or looked up {_some(busy)}")
        if failed:
            parts.append(f"{len(failed)} whose L3 write failed {_some(failed)}")
        if nowhere:
            parts.append(f"{len(nowhere)} in neither L2 nor L3 {_some(nowhere)}")
        why = "; ".join(parts)
        if busy and final:
            self.counters["store_wait_timeouts"] += 1
            raise StoreTimeout(f"{len(busy) + len(failed) + len(nowhere)} of {n} pages not "
                               f"stored in L3 within {parked.msg.timeout_s} s: {why}")
        raise NotStored(f"{len(failed) + len(nowhere)} of {n} pages not stored in L3 "
                        f"({tier.backend.name}): {why}")


def _some(keys: list[str]) -> str:
    shown = ", ".join(repr(k[:40]) for k in keys[:SHOWN_KEYS])
    return f"({shown}{', ...' if len(keys) > SHOWN_KEYS else ''})"
