"""The L2 page index: which (namespace, pool, key) lives in which arena slot, and in what state.

A page's states:

    reserve_unbound() --> unbound (pinned, no key: a client's set-ahead slot)
                               | bind(key)
                               v
    reserve() ----------> pending (pinned, invisible) ---commit()---> committed (visible)
                               |                                        |   ^
                               +--abort()--> freed                 pin()|   |unpin()
                                                                        v   |  (leases, L3 I/O)
                                                  evicted when unpinned and the policy says so

Readers only ever look at committed pages, so a page becomes visible exactly when ``commit`` runs
(the control loop is single-threaded: a multi-pool commit is atomic for every reader).

Compact records: a node's L2 holds a million pages or more, so an idle page is no Python object.
Every page is a *page record* (``p_*`` arrays: table, offset, stride, size, generation, recency,
hits, pins, flags, owner, the next page of its key) and every (namespace, key) L2 holds a page of
is a *key record* (``k_*``: the key's bytes, the mask of the pools holding it committed, its first
page, its presence fingerprint, its chain: parent and depth). Each namespace maps its keys to key
records through an open-addressing table of 64-bit fingerprints (``FpTable``; Python's own string
hash, itself salted per process: this table never leaves the process), looked up for 1024 keys at
once with numpy. About 220 bytes a page in all (``tools/bench_index.py`` measures it).

``Entry`` is a handle on a page record, made when code asks for one: its fixed fields (table, key,
slot, generation) are copied into it, its mutable state (pins, flags, hits) is read through to the
records, so two handles of one page always agree and a handle of a page that is gone reads as
uncommitted and unpinned. Handles compare equal when they name the same page (record and
generation). A fingerprint collision costs a miss, never wrong bytes: a page is served only after
its key's bytes compared equal.

Eviction asks one policy object which pages go next (``eviction/``): ``Reclaimer.make_room``
when a size class has no free slot, slab reclaim, quotas, the L3 audit.

The index is built from parts, each owning one thing, in the order a page lives:

    records.py    Records       the page and key records, the key tables, the slot maps (the
                                policy's ``IndexView``)
    lookups.py    Lookups       reads by key: a call's committed pages, the presence masks
    reserving.py  Reservations  slots reserved for a call's pages (pending, pinned)
    reclaim.py    Reclaimer     room made in a full class: on a reservation's path and ahead
    commits.py    Commits       pending pages made visible, presence published
    uses.py       Uses          recency, pins and hits of live pages
    evict.py      Evictor       a committed page leaving L2

``PageIndex`` builds them with their collaborators (the allocator, the policy, the presence
table, the KV events) and offers their calls as its own: ``index.reserve`` *is*
``index.reservations.reserve`` (bound once in the constructor: no forwarding call on the hot
path). What it adds itself: the slot -> entry questions (``at``, ``tagged``) and ``lru_order``.

One path per operation where it costs nothing: ``commit`` is ``commit_many`` of one page;
``reserve`` is the page-by-page path of ``reserve_many`` (which goes through it for calls of
few keys; a call through ``reserve_many``'s dispatch measured 4.6-5.1 us against 3.9-4.6);
``touch`` stays beside ``touch_many`` (as its batch of one it measured ~1 us more a call, on
per-page loops). Inside a batch call, pages go one by one (``reserve``, ``_commit_each``: a
numpy call costs ~1-2 us, a page ~3-5) or in a few numpy passes where the call is large enough
to pay for them (``_reserve_run``); both leave exactly the state of its pages done one by one in
turn (``commits.py``, ``reserving.py``).

Presence (``presence``): a key record's mask is the OR of ``pool_bit`` of the pools holding the
key committed, kept by ``Commits`` and ``Evictor``, so an exists query looks every key up once
for all its pools. With ``shared`` set (``records.shared``: the presence table given), every change of a mask is also published in the
shared-memory presence table (``presence.py``), from which clients answer exists without asking,
and so is every committed large page's slot tag (its generation, from ``commit`` until
``Evictor`` frees the slot), with which clients read pages without a lease. A key's mask is
written there once per call that changes it (a commit, ``evict_pages``), never with some of the
call's pools of the key and not the others: clients read the table while the loop writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicached.daemon.commits import Commits
from hicached.daemon.entry import (  # noqa: F401 - names the daemon imports from here
    _TOP,
    COMMITTED,
    FROM_L3,
    GROW_MIN,
    IN_L3,
    KEY_BYTES,
    MAX_POOLS,
    MAX_TABLES,
    PENDING,
    WRITING,
    Entry,
    TableId,
)
from hicached.daemon.evict import Evictor
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.eviction.lru import LruPolicy
from hicached.daemon.journal import Journal
from hicached.daemon.kv_events import NullKVEvents
from hicached.daemon.lookups import Lookups
from hicached.daemon.reclaim import Reclaimer
from hicached.daemon.records import Records
from hicached.daemon.reserving import Reservations
from hicached.daemon.slabs import SlabAllocator
from hicached.daemon.uses import Uses
from hicached.presence import PresenceTable


class PageIndex:
    """The L2 page index over a ``SlabAllocator`` (module docstring): builds its parts with
    their collaborators and offers their calls as its own; owns the parts (``records``,
    ``lookups``, ``reservations``, ``reclaimer``, ``commits``, ``uses``, ``evictor``) and
    nothing else. ``policy`` (default LRU) is bound to the records (its ``IndexView``);
    ``presence``: the shared presence table it publishes to (None: none); ``events``: KV
    events, told of pages of the tables in ``events.tids`` as they come and go; ``on_evict
    (entry)`` runs for every evicted committed page (before its slot is reused); ``ahead`` /
    ``busy``: the reclaimer's (``Reclaimer``: a daemon's share of the arena kept free, and
    whether a request waits; ``busy`` None: no idle turns, a victim set goes whole);
    ``journal``: the journal of committed slots it keeps (``journal.py``; None: none);
    ``first_gen``: where its slot generations start (None: a random start).

    Not thread-safe: only the daemon's control loop calls it.
    """

    def __init__(self, allocator: SlabAllocator, on_evict: Callable[[Entry], None] | None = None,
                 policy: EvictionPolicy | None = None, presence: PresenceTable | None = None,
                 events: NullKVEvents | None = None, ahead: float = 0.0,
                 busy: Callable[[], bool] | None = None, journal: Journal | None = None,
                 first_gen: int | None = None):
        self.alloc = allocator
        self.policy = policy = policy or LruPolicy()
        self.events = events = events or NullKVEvents()
        self.records = records = Records(allocator, policy, presence, journal, first_gen)
        self.lookups = lookups = Lookups(records)
        self.evictor = evictor = Evictor(records, policy, events, on_evict)
        self.reclaimer = reclaimer = Reclaimer(records, evictor, policy, ahead, busy)
        self.reservations = reservations = Reservations(records, policy, reclaimer)
        self.commits = commits = Commits(records, policy, events, evictor, reclaimer)
        self.uses = uses = Uses(records, policy)
        # the records' state others read (the same objects for the index's life)
        self.shared = presence
        self.pending = records.pending
        self.ns_bytes = records.ns_bytes
        self.pressed = reclaimer.pressed
        # the parts' calls, bound once (an index call costs no forwarding frame)
        self.get, self.get_many, self.lookup = lookups.get, lookups.get_many, lookups.lookup
        self.get_pending, self.contains = lookups.get_pending, lookups.contains
        self.presence = lookups.presence
        self.reserve, self.reserve_many = reservations.reserve, reservations.reserve_many
        self.evict_for = reclaimer.evict_for
        self.reserve_unbound, self.bind = reservations.reserve_unbound, reservations.bind
        self.abort = reservations.abort
        self.commit, self.commit_many = commits.commit, commits.commit_many
        self.touch, self.touch_many, self.read_many = uses.touch, uses.touch_many, uses.read_many
        self.pin, self.unpin, self.pin_many = uses.pin, uses.unpin, uses.pin_many
        self.unpin_many, self.count_hits = uses.unpin_many, uses.count_hits
        self.evict, self.evict_pages = evictor.evict, evictor.evict_pages
        self.drop, self.drop_one = evictor.drop, evictor.drop_one
        self.table_id, self.pool_bit = records.table_id, records.pool_bit
        self.mark_trailing, self.trailing = records.mark_trailing, records.trailing
        self.link, self.chain = records.link, records.chain
        self.parent_pages, self.key_pages = records.parent_pages, records.key_pages
        self.handle, self.entries, self.counts = records.handle, records.entries, records.counts
        self.table, self.forget_in_l3 = records.table, records.forget_in_l3
        self.republish, self.seed = records.republish, records.seed

    # ------------------------------------------------------------ counters

    @property
    def evictions(self) -> int:
        """Committed pages evicted so far (drops not counted)."""
        return self.records.evictions

    @property
    def committed_count(self) -> int:
        """Committed pages now."""
        return self.records.committed_count

    def __len__(self) -> int:
        return self.records.committed_count

    @property
    def tables(self) -> dict[TableId, dict[str, Entry]]:
        """Committed entries per table: a snapshot (``Records.tables``)."""
        return self.records.tables

    # ------------------------------------------------------------ slots

    def lru_order(self, stride: int) -> list[Entry]:
        """Committed entries of a class, least recently used first (for tests and stats)."""
        handle = self.records.handle
        return [handle(p) for p in self.policy.order(stride)]

    def tagged(self, pairs: Sequence[int], ns: str) -> list[Entry]:
        """The committed entries of namespace ``ns`` named by flat (offset, tag) pairs that are
        still in their slot (``Release.touched``: pages a client read without a lease); pairs
        naming nothing (or a trailing odd number) are skipped."""
        r = self.records
        out = []
        limit = self.alloc.capacity_bytes
        for i in range(0, len(pairs) - 1, 2):
            off = pairs[i]
            if not 0 <= off < limit:
                continue
            p = r.rec_at(off)
            if (p >= 0 and r.p_flags[p] & COMMITTED and r.p_gen[p] == pairs[i + 1]
                    and r.table_of[r.p_tid[p]][0] == ns):
                out.append(r.handle(p))
        return out

    def at(self, offset: int) -> Entry | None:
        """The entry (any state) holding the slot at ``offset``, or None."""
        r = self.records
        p = r.rec_at(offset)
        if p < 0 or r.p_off[p] != offset:
            return None
        if r.p_flags[p] & PENDING:  # its live handle (unless fenced: ``leases.py``)
            e = r.pending.get(r.table_of[r.p_tid[p]], {}).get(r.key_of(r.p_krec[p]))
            if e is not None and e.rec == p:
                return e
        return r.handle(p)
