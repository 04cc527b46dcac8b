"""PageIndex against a plain-dict model: seeded random sequences of every public call, with the
model's prediction checked after each step (the hand-written LRU cases are in test_index.py).

Only the public API is used (no ``tables``, ``pending``, ``_lru``...), and entries are compared with
``==`` or by ``(table, key, offset, gen)``, never with ``is``, so the same test holds for a rewrite
of the index's internals. A failure names its seed and the steps so far; ``_run(seed, ...)``
replays it.

What the model predicts exactly: every entry's state (table, key, offset, stride, page_bytes, gen,
pins, committed), ``get`` / ``get_pending`` / ``at`` / ``len`` / ``presence`` / ``lru_order`` /
``ns_bytes`` / ``evictions`` / ``tagged``, whether ``reserve`` takes a free slot, evicts or answers
None, and which pages it evicts (with ``EXACT_SLAB_RECLAIM``, also when a slab of another class is
reclaimed). The model's slabs are offsets // slab_bytes:

    arena   |<-- slab 0 (SLAB bytes) -->|<-- slab 1 -->| ... | tail < SLAB (unused)
    slab k  | slot 0 | slot 1 | ... | waste < stride |    one class (stride) per used slab
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from hicached.daemon.index import Entry, PageIndex
from hicached.daemon.slabs import ALIGN, SlabAllocator, stride_for

SLAB = 1024
NAMESPACES = ("n0", "n1", "n2")
POOLS = ("kv", "mamba", "idx")
KEYS = tuple(f"k{i}" for i in range(8))
STRIDES = (128, 256, 320, 512, 1024)  # 320: 3 slots and 64 bytes of waste in a slab
# Which slab a reclaim takes: the unpinned slab of another class whose newest commit / touch of any
# entry (since the slab was taken) is oldest. False: only check that a whole unpinned slab of
# another class went (for a rewrite that defines a slab's recency differently).
EXACT_SLAB_RECLAIM = True


@dataclass(eq=False)
class Page:
    """The model of one live slot."""

    table: tuple[str, str]  # (ns, "") while unbound
    key: str
    offset: int
    stride: int
    page_bytes: int
    gen: int
    handle: Entry  # what reserve / bind returned (calls use it or a fresh lookup)
    state: str = "pending"  # "unbound" | "pending" | "committed"
    leases: int = 0  # pins taken by ``lease`` steps (committed pages only)
    tick: int = 0  # the model's tick of its commit or newest touch

    @property
    def pins(self) -> int:
        return self.leases if self.state == "committed" else 1

    @property
    def ident(self) -> tuple:
        return (self.table, self.key, self.offset, self.gen)


def ident(e: Entry) -> tuple:
    return (e.table, e.key, e.offset, e.gen)


@dataclass
class Model:
    """Live slots by offset, committed / pending by (table, key), LRU per class, slab recency."""

    num_slabs: int
    slots: dict[int, Page] = field(default_factory=dict)
    committed: dict[tuple, Page] = field(default_factory=dict)  # (table, key) -> page
    pending: dict[tuple, Page] = field(default_factory=dict)
    lru: dict[int, dict[tuple, None]] = field(default_factory=dict)  # stride -> (table, key)
    slab_tick: dict[int, int] = field(default_factory=dict)  # slab -> newest commit / touch
    tick: int = 0
    evictions: int = 0
    ns_bytes: dict[str, int] = field(default_factory=dict)
    tables: set = field(default_factory=set)  # every table given a pool bit
    used: set = field(default_factory=set)  # every offset a slot ever started at
    gens: dict[int, set] = field(default_factory=dict)  # offset -> every gen it ever had
    stale: list = field(default_factory=list)  # (offset, gen) of freed or rebound slots

    def by_slab(self) -> dict[int, list[Page]]:
        out: dict[int, list[Page]] = {}
        for p in self.slots.values():
            out.setdefault(p.offset // SLAB, []).append(p)
        return out

    def predict(self, stride: int) -> tuple[str, list[Page], list[list[Page]]]:
        """What a reserve of ``stride`` does: ("free", [], []), ("none", [], []), or ("page",
        [victim], []) / ("slab", victims, eligible slabs) when it must evict."""
        slabs = self.by_slab()
        if len(slabs) < self.num_slabs or any(
            ps[0].stride == stride and len(ps) < SLAB // stride for ps in slabs.values()
        ):
            return "free", [], []
        page = next(
            (self.committed[k] for k in self.lru.get(stride, ()) if self.committed[k].leases == 0),
            None,
        )
        eligible = [
            ps for ps in slabs.values() if ps[0].stride != stride and all(p.pins == 0 for p in ps)
        ]
        slab = min(eligible, key=lambda ps: self.slab_tick[ps[0].offset // SLAB], default=None)
        if page is not None and (
            slab is None or page.tick <= self.slab_tick[slab[0].offset // SLAB]
        ):
            return "page", [page], []
        if slab is not None:
            return "slab", slab, eligible
        return "none", [], []

    def add(self, page: Page) -> None:
        slab = page.offset // SLAB
        rel = page.offset - slab * SLAB
        assert 0 <= slab < self.num_slabs and rel % page.stride == 0, page
        assert rel + page.stride <= SLAB, page
        assert page.offset not in self.slots, (page, self.slots[page.offset])
        for p in self.slots.values():  # slots never overlap; a slab holds one class
            assert p.offset + p.stride <= page.offset or page.offset + page.stride <= p.offset, p
            assert p.offset // SLAB != slab or p.stride == page.stride, (p, page)
        if page.key:  # an unbound slot has no tag yet (0 today): ``bind`` gives it one
            self.gen_is_new(page)
        self.slots[page.offset] = page
        self.used.add(page.offset)
        ns = page.table[0]
        self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + page.stride
        if page.key:
            self.pending[(page.table, page.key)] = page

    def gen_is_new(self, page: Page) -> None:
        seen = self.gens.setdefault(page.offset, set())
        assert page.gen not in seen, f"slot {page.offset} had tag {page.gen} before"
        seen.add(page.gen)

    def remove(self, page: Page) -> None:
        del self.slots[page.offset]
        k = (page.table, page.key)
        if page.state == "committed":
            del self.committed[k], self.lru[page.stride][k]
        elif page.state == "pending":
            del self.pending[k]
        self.ns_bytes[page.table[0]] -= page.stride
        self.stale.append((page.offset, page.gen))
        if not any(p.offset // SLAB == page.offset // SLAB for p in self.slots.values()):
            self.slab_tick.pop(page.offset // SLAB, None)  # a slab left empty is free again

    def commit(self, page: Page) -> None:
        assert page.state == "pending"
        k = (page.table, page.key)
        del self.pending[k]
        page.state = "committed"
        self.committed[k] = page
        self.lru.setdefault(page.stride, {})[k] = None
        self.touch(page)

    def touch(self, page: Page) -> None:
        self.tick += 1
        self.slab_tick[page.offset // SLAB] = self.tick
        if page.state == "committed":
            page.tick = self.tick
            lru = self.lru[page.stride]
            k = (page.table, page.key)
            del lru[k]
            lru[k] = None


class Run:
    """One random sequence: the index, its model and the steps taken so far."""

    def __init__(self, seed: int):
        self.rng = rng = random.Random(seed)
        num_slabs = rng.randint(1, 4)
        self.ix = PageIndex(
            SlabAllocator(num_slabs * SLAB + rng.randrange(0, SLAB, ALIGN), SLAB),
            on_evict=self._on_evict,
        )
        self.strides = rng.sample(STRIDES, rng.choice((1, 1, 2, 2, 3)))
        self.namespaces = NAMESPACES[: rng.randint(1, 3)]
        self.pools = POOLS[: rng.randint(1, 3)]
        self.m = Model(num_slabs)
        self.evicted: list[tuple] = []  # ident() of each on_evict
        self.log: list[str] = []

    def _on_evict(self, e: Entry) -> None:
        assert e.committed and e.pins == 0, e
        self.evicted.append(ident(e))

    # ------------------------------------------------------------ helpers

    def entry(self, page: Page) -> Entry:
        """The handle reserve / bind gave, or a fresh lookup of the same page (equal to it)."""
        if self.rng.random() < 0.5:
            return page.handle
        if page.state == "committed":
            e = self.ix.get(page.table, page.key)
        elif page.state == "pending":
            e = self.ix.get_pending(page.table, page.key)
        else:
            e = self.ix.at(page.offset)
        assert e == page.handle and hash(e) == hash(page.handle), (e, page)
        return e

    def pages(self, *states: str) -> list[Page]:
        return [p for p in self.m.slots.values() if p.state in states]

    def free_key(self, table: tuple) -> str | None:
        keys = [
            k
            for k in KEYS
            if (table, k) not in self.m.committed and (table, k) not in self.m.pending
        ]
        return self.rng.choice(keys) if keys else None

    def table(self, ns: str | None = None) -> tuple[str, str]:
        return (ns or self.rng.choice(self.namespaces), self.rng.choice(self.pools))

    def page_bytes(self, stride: int) -> int:
        page_bytes = stride - self.rng.randrange(ALIGN)
        assert self.ix.alloc.check_page_bytes(page_bytes) == stride == stride_for(page_bytes)
        return page_bytes

    # ------------------------------------------------------------ steps

    def step_reserve(self) -> None:
        table = self.table()
        key = self.free_key(table)
        if key is None:
            return
        stride = self.rng.choice(self.strides)
        page_bytes = self.page_bytes(stride)
        self.log.append(f"reserve({table}, {key!r}, {page_bytes}, {stride})")
        self.m.tables.add(table)
        self.allocated(
            stride, lambda: self.ix.reserve(table, key, page_bytes, stride), table, key, page_bytes
        )

    def step_reserve_unbound(self) -> None:
        ns, stride = self.rng.choice(self.namespaces), self.rng.choice(self.strides)
        self.log.append(f"reserve_unbound({ns!r}, {stride})")
        self.allocated(stride, lambda: self.ix.reserve_unbound(ns, stride), (ns, ""), "", 0)

    def allocated(self, stride, call, table, key, page_bytes) -> None:
        """Run a reserve and check it against the model's prediction."""
        kind, victims, eligible = self.m.predict(stride)
        before = self.ix.evictions
        self.evicted.clear()
        e = call()
        if kind == "none":
            assert e is None and not self.evicted and self.ix.evictions == before, (e, kind)
            return
        assert e is not None, f"reserve answered None; expected {kind} {victims}"
        got = set(self.evicted)
        assert len(got) == len(self.evicted) == self.ix.evictions - before, self.evicted
        if kind == "slab" and not EXACT_SLAB_RECLAIM:
            slabs = {p.offset // SLAB: ps for ps in eligible for p in ps[:1]}
            victims = slabs.get(e.offset // SLAB, [])
        assert got == {p.ident for p in victims}, (kind, self.evicted, victims)
        for p in victims:
            assert p.state == "committed" and p.leases == 0, p
            self.m.remove(p)
            self.m.evictions += 1
        if kind == "page":  # the only free slot is the victim's
            assert e.offset == victims[0].offset, (e, victims)
        elif kind == "slab":  # the only free slab; a fresh slab's slots go in ascending order
            assert e.offset == victims[0].offset // SLAB * SLAB, (e, victims)
        page = Page(
            table, key, e.offset, stride, page_bytes, e.gen, e, "pending" if key else "unbound"
        )
        self.m.add(page)
        self.log.append(f"  -> @{e.offset} gen {e.gen}, evicted {sorted(got)}")

    def step_bind(self) -> None:
        unbound = self.pages("unbound")
        if not unbound:
            return
        page = self.rng.choice(unbound)
        table = self.table(page.table[0])
        key = self.free_key(table)
        if key is None:
            return
        page_bytes = self.page_bytes(page.stride)
        self.log.append(f"bind(@{page.offset}, {table}, {key!r}, {page_bytes})")
        self.m.tables.add(table)
        e = self.ix.bind(self.entry(page), table, key, page_bytes)
        assert e.offset == page.offset and e.gen != page.gen, (e, page)
        self.m.stale.append((page.offset, page.gen))
        page.table, page.key, page.page_bytes = table, key, page_bytes
        page.gen, page.handle, page.state = e.gen, e, "pending"
        self.m.gen_is_new(page)
        self.m.pending[(table, key)] = page

    def step_commit(self) -> None:
        pending = self.pages("pending")
        if pending:
            page = self.rng.choice(pending)
            self.log.append(f"commit(@{page.offset})")
            self.ix.commit(self.entry(page))
            self.m.commit(page)

    def step_commit_many(self) -> None:
        pending = self.pages("pending")
        if pending:
            pages = self.rng.sample(pending, self.rng.randint(1, len(pending)))
            self.log.append(f"commit_many({[p.offset for p in pages]})")
            self.ix.commit_many([self.entry(p) for p in pages])
            for p in pages:
                self.m.commit(p)

    def step_abort(self) -> None:
        pages = self.pages("pending", "unbound")
        if pages:
            page = self.rng.choice(pages)
            self.log.append(f"abort(@{page.offset})")
            self.ix.abort(self.entry(page))
            self.m.remove(page)

    def step_lease(self) -> None:
        pages = self.pages("committed")
        if pages:
            page = self.rng.choice(pages)
            self.log.append(f"pin(@{page.offset})")
            self.ix.pin(self.entry(page))
            page.leases += 1

    def step_release(self) -> None:
        pages = [p for p in self.m.slots.values() if p.leases]
        if pages:
            page = self.rng.choice(pages)
            self.log.append(f"unpin(@{page.offset})")
            self.ix.unpin(self.entry(page))
            page.leases -= 1

    def step_touch(self) -> None:
        pages = self.pages("committed") if self.rng.random() < 0.8 else list(self.m.slots.values())
        if pages:
            page = self.rng.choice(pages)
            self.log.append(f"touch(@{page.offset})")
            self.ix.touch(self.entry(page))
            self.m.touch(page)

    def step_evict(self) -> None:
        pages = [p for p in self.pages("committed") if not p.leases]
        if pages:
            page = self.rng.choice(pages)
            self.log.append(f"evict(@{page.offset})")
            self.evicted.clear()
            self.ix.evict(self.entry(page))
            assert self.evicted == [page.ident], (self.evicted, page)
            self.m.remove(page)
            self.m.evictions += 1

    def step_drop_one(self) -> None:
        pages = list(self.m.slots.values())
        if pages:
            page = self.rng.choice(pages)
            self.log.append(f"drop_one(@{page.offset})")
            expected = page.state == "committed" and not page.leases
            assert bool(self.ix.drop_one(self.entry(page))) is expected, page
            if expected:
                self.m.remove(page)

    def step_drop(self) -> None:
        pages = list(self.m.slots.values())
        pages = self.rng.sample(pages, self.rng.randint(0, len(pages)))
        self.log.append(f"drop({[p.offset for p in pages]})")
        dropped = [p for p in pages if p.state == "committed" and not p.leases]
        assert self.ix.drop([self.entry(p) for p in pages]) == len(dropped)
        for p in dropped:
            self.m.remove(p)

    def step_flush(self) -> None:
        """A flush's walk: every slot start ever used, in order, ``at`` then ``drop_one``."""
        ns = self.rng.choice(self.namespaces)
        self.log.append(f"flush({ns!r})")
        for offset in sorted(self.m.used):
            e = self.ix.at(offset)
            page = self.m.slots.get(offset)
            if page is None:
                continue  # a slot that is free, or inside another class's slot
            assert e is not None and ident(e) == page.ident, (offset, e, page)
            if e.committed and e.table[0] == ns:
                assert bool(self.ix.drop_one(e)) is (page.leases == 0), page
                if not page.leases:
                    self.m.remove(page)

    def step_tagged(self) -> None:
        ns = self.rng.choice(self.namespaces)
        pairs = {(p.offset, p.gen + self.rng.choice((0, 0, 0, 1))) for p in self.m.slots.values()}
        pairs.update(self.rng.sample(self.m.stale, min(len(self.m.stale), 4)))
        pairs.add((self.rng.randrange(-SLAB, SLAB * 5, ALIGN), self.rng.randrange(1 << 20)))
        pairs.update((p.offset + ALIGN, p.gen) for p in self.m.slots.values() if p.stride > ALIGN)
        pairs = self.rng.sample(sorted(pairs), self.rng.randint(0, len(pairs)))
        flat = [x for pair in pairs for x in pair] + [0] * self.rng.randint(0, 1)
        self.log.append(f"tagged({flat}, {ns!r})")
        expected = []
        for offset, gen in pairs:
            p = self.m.slots.get(offset)
            if p is not None and p.state == "committed" and p.gen == gen and p.table[0] == ns:
                expected.append(p.ident)
        assert [ident(e) for e in self.ix.tagged(flat, ns)] == expected

    STEPS = (
        (step_reserve, 12),
        (step_reserve_unbound, 2),
        (step_bind, 3),
        (step_commit, 6),
        (step_commit_many, 3),
        (step_abort, 2),
        (step_lease, 3),
        (step_release, 3),
        (step_touch, 5),
        (step_evict, 1),
        (step_drop_one, 1),
        (step_drop, 0.3),
        (step_flush, 0.2),
        (step_tagged, 1),
    )

    # ------------------------------------------------------------ the check

    def check(self) -> None:
        """Every prediction of the model against the index."""
        ix, m = self.ix, self.m
        for page in m.slots.values():
            e = ix.at(page.offset)
            assert e is not None and ident(e) == page.ident, (page, e)
            assert (e.stride, e.page_bytes, e.pins, e.committed) == (
                page.stride,
                page.page_bytes,
                page.pins,
                page.state == "committed",
            ), (page, e)
        for table in m.tables:
            for key in KEYS:
                c, p = m.committed.get((table, key)), m.pending.get((table, key))
                e = ix.get(table, key)
                assert (e is None) if c is None else (ident(e) == c.ident), (table, key, e)
                e = ix.get_pending(table, key)
                assert (e is None) if p is None else (ident(e) == p.ident), (table, key, e)
        assert len(ix) == len(m.committed)
        for stride in self.strides:
            order = ix.lru_order(stride)
            assert [(e.table, e.key) for e in order] == list(m.lru.get(stride, ())), stride
            ticks = [e.last_used for e in order]
            assert ticks == sorted(ticks) and len(set(ticks)) == len(ticks), ticks
        bits: dict[tuple, int] = {t: ix.pool_bit(t) for t in m.tables}
        for ns in self.namespaces:
            mine = [b for t, b in bits.items() if t[0] == ns]
            assert all(b > 0 and b & (b - 1) == 0 for b in mine) and len(set(mine)) == len(mine)
            masks = dict.fromkeys(KEYS, 0)
            for table, key in m.committed:
                if table[0] == ns:
                    masks[key] |= bits[table]
            got = ix.presence(ns, KEYS)
            assert got.dtype == np.int64 and got.tolist() == list(masks.values()), (ns, got)
            assert ix.ns_bytes.get(ns, 0) == m.ns_bytes.get(ns, 0), ns
        assert ix.evictions == m.evictions
        for offset in self.rng.sample(sorted(m.used), min(4, len(m.used))):
            if not any(p.offset <= offset < p.offset + p.stride for p in m.slots.values()):
                assert ix.at(offset) is None, offset


def _run(seed: int, steps: int) -> None:
    """One sequence; replay a failure with the seed it names."""
    r = Run(seed)
    funcs, weights = zip(*Run.STEPS, strict=True)
    try:
        for _ in range(steps):
            r.rng.choices(funcs, weights)[0](r)
            r.check()
    except Exception as exc:
        trail = "\n".join(r.log)
        raise AssertionError(
            f"seed {seed} (arena {r.m.num_slabs} slabs, strides {r.strides}), "
            f"{exc!r}\nsteps:\n{trail}"
        ) from exc


@pytest.mark.parametrize("block", range(8))
def test_random_sequences_match_the_model(block):
    for seed in range(block * 25, block * 25 + 25):
        _run(seed, 250)
