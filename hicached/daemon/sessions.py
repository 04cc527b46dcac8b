"""What the controller keeps per client and per waiting request: sessions (namespace fixed at
the handshake, registered pools) and the gets / exists parked while L3 works for them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from hicached import protocol as P
from hicached.daemon.index import Entry
from hicached.errors import UnknownPool
from hicached.liveness import ProcessRef


def namespace_digest(namespace: str) -> str:
    """Stable, filesystem-safe id of a namespace string (never Python's ``hash``)."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32]


class PoolSpec(NamedTuple):
    page_bytes: int
    stride: int


@dataclass
class Session:
    """One connected client: its namespace (fixed at the handshake) and registered pools."""

    id: int
    namespace: str
    ns: str  # digest
    pid: int  # as the client states it (its own pid namespace)
    name: str
    pools: dict[str, PoolSpec] = field(default_factory=dict)
    process: ProcessRef | None = None  # what the daemon checks (liveness.py); None: unchecked
    presence_word: int = -1  # its commit word in the shared presence table (-1: none)
    active: bool = True  # a request came since the last sweep (server: ``_session``)
    idle_since: float = 0.0  # (the sweep's clock) when requests stopped coming

    @property
    def checked(self) -> bool:
        """Whether the daemon can tell this client's process died (``liveness.py``)."""
        return self.process is not None and self.process.how != "none"

    def spec(self, pool: str) -> PoolSpec:
        try:
            return self.pools[pool]
        except KeyError:
            raise UnknownPool(
                f"pool {pool!r} is not registered by this client (registered: "
                f"{sorted(self.pools)}); call register_mem_host_pool_v2 first"
            ) from None


@dataclass
class ParkedGet:
    """A Lease waiting for L3 loads, or for pages another client is writing (reserved, not yet
    committed); answered through ``reply`` once ``jobs`` is empty or at ``deadline`` (pages still
    loading or pending are then misses)."""

    session: Session
    msg: P.Lease
    reply: Callable[[P.Leased], None]
    deadline: float
    jobs: set[int] = field(default_factory=set)
    answered: bool = False
    pending: list[Entry] = field(default_factory=list)  # the uncommitted pages it waits for
    building: bool = False  # a sliced get still looking for its pages: nothing answers it yet


@dataclass
class ParkedExists:
    """An Exists waiting for the store's answer about keys L2 lacks (``L3Tier.probe``);
    answered through ``reply`` once ``jobs`` is empty or at ``deadline`` (keys not yet answered
    for count as absent from L3)."""

    session: Session
    msg: P.Exists
    keys: list[str]
    reply: Callable[[P.ExistsResult], None]
    deadline: float
    jobs: set[int] = field(default_factory=set)
    probes: list = field(default_factory=list)  # the IOJobs (their results, once finished)
    answered: bool = False
    pending: list[Entry] = field(default_factory=list)  # never any (ParkedGet's shape)
    building: bool = False  # never (ParkedGet's shape)


@dataclass
class ParkedStore:
    """A WaitStored waiting for L3 writes of its pages (in flight, or started for it) and for
    the store's word on pages L2 lacks (``store_waits.py``); answered through ``reply`` once
    ``jobs`` is empty or at ``deadline`` (pages not yet stored then: ``StoreTimeout``)."""

    session: Session
    msg: P.WaitStored
    reply: Callable[[P.Ok | P.Error], None]
    deadline: float
    pages: list[tuple[tuple[str, str], str]] = field(default_factory=list)  # (table, key)
    jobs: set[int] = field(default_factory=set)
    writes: list = field(default_factory=list)  # the put IOJobs it waits for (their results)
    probes: list = field(default_factory=list)  # the exists IOJobs (their results)
    answered: bool = False
    pending: list[Entry] = field(default_factory=list)  # never any (ParkedGet's shape)
    building: bool = False  # never (ParkedGet's shape)
