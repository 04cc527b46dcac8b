"""Audit of the L3 copies the daemon counts on: does the store still hold the pages L2 will evict
next?

A page L2 serves is never read from L3, so in the store's own LRU (Mooncake's leases, another
3FS node's slots) its copy ages and may be evicted, often without a word to this daemon (only
the file L3 and this node's 3FS slots tell, ``L3Backend.take_evicted``). The daemon would go on
counting on that copy: under write_through it would never write the page again, under
write_back it would drop it clean; once L2 evicts it the page is gone for every engine and every
restart, and it is the hot pages that go.

So every ``audit_s`` (``l3_audit_s`` in the config; 0: never) the tier asks the store, on the
prober thread like any exists, about the ``AUDIT_PAGES`` least recently used L2 pages of each
slot class that it knows to be in L3, among the ``AUDIT_WINDOW`` pages L2 evicts next. A page
the store no longer has is no longer clean (``forget_evicted``, as when a store tells): under
write_through it is written again now (under selective writes, once its hits reach the
threshold), under write_back it is dirty again (written when L2 needs its room).
A store that cannot answer changes nothing. Counted in ``l3_copies_lost``.

``L3Audit`` owns the audit's schedule (``audit_s``, the next one due, those in flight). The
tier builds it with itself: it reads the tier's backend and write policy and the index's
eviction order, submits its jobs through the tier (``submit_job``), and hands what a finished
audit found to the tier (``remember``, ``forget_evicted``, ``writes.write``). Control loop only.
"""

from __future__ import annotations

import itertools
import logging

from hicached.daemon.index import Entry, TableId
from hicached.daemon.l3.workers import IOJob

log = logging.getLogger("hicached.daemon.l3.tier")

AUDIT_S = 10.0  # default interval
AUDIT_PAGES = 512  # pages asked about per slot class and audit
# unpinned pages looked at per slot class and audit: those L2 evicts next. A page further on
# is not at risk yet, and the control loop must not walk a million-page LRU every audit_s
AUDIT_WINDOW = 4 * AUDIT_PAGES


class L3Audit:
    """``audit`` and its completion (``done``); see the module docstring."""

    def __init__(self, tier, index, audit_s: float = AUDIT_S) -> None:
        self.tier = tier
        self.index = index
        self.audit_s = audit_s  # 0: never
        self._next_audit = 0.0
        self._audits_in_flight = 0

    def audit(self, now: float) -> int:
        """Start an audit when one is due and none is running; returns the pages asked about."""
        tier = self.tier
        if (not self.audit_s or not tier.attached or self._audits_in_flight
                or now < self._next_audit):
            return 0
        self._next_audit = now + self.audit_s
        by_table: dict[TableId, list[Entry]] = {}
        policy = self.index.policy
        for stride in policy.strides():
            # pinned pages are passed over (as eviction does): they are not evicted next
            evictable = map(self.index.handle,
                            policy.upcoming(stride, AUDIT_WINDOW))
            oldest = (e for e in evictable if e.in_l3 and e.committed and not e.writing)
            for e in itertools.islice(oldest, AUDIT_PAGES):
                by_table.setdefault(e.table, []).append(e)
        asked = 0
        for (ns, pool), entries in by_table.items():
            job = IOJob("audit", ns, pool, [e.key for e in entries], [], 0, entries,
                        backend=tier.backend)
            if not tier.submit_job(job):
                tier.counters["l3_probes_dropped"] += 1
                break
            self._audits_in_flight += 1
            asked += len(entries)
        return asked

    def done(self, job: IOJob, current: bool) -> None:
        """A finished audit job (``current``: of the attached backend)."""
        tier = self.tier
        self._audits_in_flight -= 1
        if job.error or not current:  # a store that cannot answer says nothing
            return
        lost = []
        for e, have in zip(job.entries, job.result):
            if have:
                tier.remember(e.table, e.key)
            elif e.in_l3 and self.index.get(e.table, e.key) == e:
                lost.append(e)
        if not lost:
            return
        tier.forget_evicted([(*e.table, e.key) for e in lost])
        tier.counters["l3_copies_lost"] += len(lost)
        log.info("L3 %s no longer holds %d pages L2 will evict next (the store evicted them); "
                 "%s", job.backend.name, len(lost),
                 "dirty again" if tier.write_policy == "write_back" else "writing them again")
        if tier.write_policy == "write_through":
            tier.writes.write(lost)
        elif tier.write_policy == "write_through_selective":
            tier.writes.write([e for e in lost if e.hits >= tier.threshold])
