"""The L3 tier is built by composition (issue 47): ``L3Tier`` is no mixin, it builds its write
half (``L3Writes``) and its audit (``L3Audit``) with itself, and no module of ``daemon/l3/`` reads
another object's underscore attributes (``x._y`` where ``x`` is neither ``self``, ``cls`` nor an
imported module). Read from the source (ast), so a new reach-in fails here."""

import ast
import pathlib

from hicached.daemon.index import PageIndex
from hicached.daemon.l3.audit import L3Audit
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.l3.writes import L3Writes
from hicached.daemon.slabs import SlabAllocator

L3 = pathlib.Path(__file__).resolve().parents[3] / "hicached" / "daemon" / "l3"


def private_reads(source: str) -> list[str]:
    """Each ``x._y`` of ``source`` where ``x`` is not ``self``, ``cls`` or an imported module
    (dunders allowed), as ``line: x._y``."""
    tree = ast.parse(source)
    modules = {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names)
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in modules)]


def test_no_l3_module_reads_another_objects_private_attributes():
    found = {p.name: private_reads(p.read_text()) for p in sorted(L3.glob("*.py"))}
    assert set(found) >= {"tier.py", "writes.py", "audit.py", "workers.py", "keymemory.py"}
    assert {name: reads for name, reads in found.items() if reads} == {}


def test_a_reach_in_is_caught():
    src = "import os\nclass A:\n    def f(self, tier):\n        os._exit\n" \
          "        return self._x, tier._dirty, tier.writes._failing\n"
    assert private_reads(src) == ["5: tier._dirty", "5: tier.writes._failing"]


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
