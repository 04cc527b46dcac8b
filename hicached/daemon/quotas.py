"""Per-namespace L2 quotas: the most arena bytes one namespace (model / tenant) may hold.

``namespace_quotas`` in the config maps a namespace string (as clients give it in the handshake)
to a size. The controller asks ``admit(ns, stride)`` before it reserves a slot for a new page of
that namespace:

    used + stride <= quota       admitted
    otherwise                    the namespace's own least recently used unpinned pages are
                                 evicted until the page fits (other namespaces are never
                                 touched); if its pages are all pinned, the key is answered
                                 "no space" (counted as a rejection)

``used`` is what ``PageIndex.ns_bytes`` counts: slot bytes of committed and pending pages,
including pages loaded from L3 (loads are not refused; the namespace's next write evicts its
own pages to get back under its quota). A namespace without a quota only competes in the
arena-wide LRU. Only the control loop calls this.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from hicached.daemon.index import COMMITTED, PageIndex
from hicached.daemon.sessions import namespace_digest


class NoQuotas:
    """No quota configured: every reservation is admitted."""

    def admit(self, ns: str, stride: int) -> bool:
        return True

    def fits(self, ns: str, stride: int) -> bool:
        """``stride`` more bytes stay within ``ns``'s quota without evicting anything."""
        return True

    def admit_many(self, ns: str, stride: int, n: int) -> int:
        """How many of ``n`` new pages of ``stride`` bytes ``admit`` would admit in turn
        without evicting or refusing anything (each admitted page reserved): a batch of
        reservations asks once, and the pages past it one by one (``admit``)."""
        return n

    def set_quotas(self, quotas: Mapping[str, int]) -> None:
        pass

    def snapshot(self) -> list[dict]:
        return []


class NamespaceQuotas(NoQuotas):
    """See the module docstring.

    Eviction order is exact LRU within the namespace without scanning it on every page: the
    namespace's committed pages are sorted once into a queue (oldest first) and consumed; a page
    touched after the sort has ``last_used`` above the sort's newest tick, so it is skipped there
    and found again, in its new place, when the queue runs dry and is rebuilt.
    """

    def __init__(self, index: PageIndex, quotas: Mapping[str, int]):
        self.index = index
        self._limits: dict[str, tuple[str, int]] = {}  # digest -> (namespace, bytes)
        self._counts: dict[str, dict[str, int]] = {}  # digest -> evictions / rejections
        # digest -> (queue of (page record, generation), next victim first; the newest tick)
        self._queues: dict[str, tuple[deque[tuple[int, int]], int]] = {}
        self.set_quotas(quotas)

    def set_quotas(self, quotas: Mapping[str, int]) -> None:
        """Replace the quotas (SIGHUP). A lowered quota is enforced at the namespace's next
        write."""
        self._limits = {namespace_digest(ns): (ns, int(size)) for ns, size in quotas.items()}
        for digest in self._limits:
            self._counts.setdefault(digest, {"evictions": 0, "rejections": 0})

    def fits(self, ns: str, stride: int) -> bool:
        limit = self._limits.get(ns)
        return limit is None or self.index.ns_bytes.get(ns, 0) + stride <= limit[1]

    def admit_many(self, ns: str, stride: int, n: int) -> int:
        limit = self._limits.get(ns)
        if limit is None:
            return n
        return max(0, min(n, (limit[1] - self.index.ns_bytes.get(ns, 0)) // stride))

    def admit(self, ns: str, stride: int) -> bool:
        limit = self._limits.get(ns)
        if limit is None:
            return True
        quota = limit[1]
        over = self.index.ns_bytes.get(ns, 0) + stride - quota
        if over > 0 and stride <= quota:
            self._evict_own(ns, over)
            over = self.index.ns_bytes.get(ns, 0) + stride - quota
        if over > 0:
            self._counts[ns]["rejections"] += 1
            return False
        return True

    def _evict_own(self, ns: str, need_bytes: int) -> None:
        freed = 0
        pinned: list[tuple[int, int]] = []
        ix = self.index
        r = ix.records
        queue, tick = self._queues.get(ns) or self._rebuild(ns)
        rebuilt = False
        while freed < need_bytes:
            if not queue:
                if rebuilt:
                    break
                pinned.clear()  # the re-sorted queue holds them again
                queue, tick = self._rebuild(ns)
                rebuilt = True
                continue
            p, gen = queue.popleft()
            if r.p_gen[p] != gen or not r.p_flags[p] & COMMITTED or r.p_used[p] > tick:
                continue  # gone, or used since the sort: it is further back now
            if r.p_pins[p]:
                pinned.append((p, gen))
                continue
            before = ix.ns_bytes.get(ns, 0)
            self._counts[ns]["evictions"] += ix.evict(ix.handle(p))  # with its dependants
            freed += before - ix.ns_bytes.get(ns, 0)
        queue.extendleft(reversed(pinned))  # still the oldest: first in line next time

    def _rebuild(self, ns: str) -> tuple[deque[tuple[int, int]], int]:
        r = self.index.records
        recs = self.index.policy.ranked(ns)
        tick = max(map(r.p_used.__getitem__, recs), default=0)
        self._queues[ns] = (deque((p, r.p_gen[p]) for p in recs), tick)
        return self._queues[ns]

    def snapshot(self) -> list[dict]:
        """Per namespace with a quota: name, digest, bytes used, quota, own evictions,
        rejections."""
        return [{"namespace": name, "digest": digest,
                 "used_bytes": self.index.ns_bytes.get(digest, 0),
                 "quota_bytes": quota, **self._counts[digest]}
                for digest, (name, quota) in sorted(self._limits.items(), key=lambda i: i[1])]


def make_quotas(index: PageIndex, quotas: Mapping[str, int]) -> NoQuotas:
    return NamespaceQuotas(index, quotas) if quotas else NoQuotas()
