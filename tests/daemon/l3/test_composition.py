"""The L3 tier is built by composition (issue 47): ``L3Tier`` is no mixin, it builds its write
half (``L3Writes``) and its audit (``L3Audit``) with itself. (That no module of ``daemon/``
reads another object's underscore attributes is ``tests/test_layout.py``'s.)"""

from hicached.daemon.index import PageIndex
from hicached.daemon.l3.audit import L3Audit
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.l3.writes import L3Writes
from hicached.daemon.slabs import SlabAllocator

def test_the_tier_builds_its_writes_and_audit(arena):
    assert L3Tier.__bases__ == (object,) and L3Writes.__bases__ == (object,)
    index = PageIndex(SlabAllocator(arena.size_bytes, 64 * 4096))
    workers = IOWorkers()
    try:
        tier = L3Tier(index, workers, audit_s=0)
    finally:
        workers.close()
    assert isinstance(tier.writes, L3Writes) and tier.writes.tier is tier
    assert tier.writes.index is index and tier.writes.kv_events is tier.kv_events
    assert isinstance(tier.auditor, L3Audit) and tier.auditor.tier is tier
    assert tier.status()["dirty_pages"] == 0 and not tier.writes.failing
