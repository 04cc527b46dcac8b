"""kernels/cpu.py and kernels/pointers.py against the plain-torch reference, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicached.client.hostpool import HostPool
from hicached.kernels import cpu, reference
from hicached.kernels.cpu import PageCopier, page_major_parts
from hicached.kernels.pointers import SegmentPlan, memmove_runs, mha_layer_first_order

NUM_PAGES = 12
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


def _fill(tensors, seed: int) -> None:
    """Random bytes everywhere (NaN payloads included: copies must be bit-exact)."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        if t.numel():
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def make_pool(kind: str, layout: str, page_size: int, dtype: torch.dtype,
              seed: int = 0, zero_temporal: bool = False) -> HostPool:
    """A small pool of NUM_PAGES pages filled with random bytes."""
    if kind == "mha":
        pool = HostPool.allocate_mha(NUM_PAGES, page_size, 3, 2, 8, layout, dtype)
    elif kind == "mla":
        pool = HostPool.allocate_mla(NUM_PAGES, page_size, 3, 12, layout, dtype)
    elif kind == "indexer":
        pool = HostPool.allocate_indexer(NUM_PAGES, page_size, 3, 20, layout, dtype)
    elif kind == "odd":  # odd byte counts: no wide dtype fits, the uint8 fallbacks run
        pool = HostPool.allocate_mha(NUM_PAGES, page_size, 3, 1, 3, layout, torch.uint8)
    else:
        temporal = (0,) if zero_temporal else (2, 4)
        pool = HostPool.allocate_mamba(NUM_PAGES, 2, temporal, [(3, 4), (5,)],
                                       torch.float32, dtype, layout)
    _fill(pool.buffers, seed)
    return pool


CONFIGS = (
    [(k, lay, ps, dt) for k in ("mha", "mla", "indexer") for lay in LAYOUTS
     for ps in (1, 4) for dt in DTYPES]
    + [("odd", lay, ps, torch.uint8) for lay in LAYOUTS for ps in (1, 3)]
    + [("mamba", lay, 1, dt) for lay in LAYOUTS[1:] for dt in DTYPES]
)


def _ids(config) -> str:
    kind, layout, page_size, dtype = config
    return f"{kind}-{layout}-p{page_size}-{str(dtype).removeprefix('torch.')}"


def patterns(page_bytes: int) -> dict[str, tuple[list[int], list[int]]]:
    """(host pages, arena offsets) batches that hit every branch of PageCopier."""
    pb, slot = page_bytes, page_bytes + 64
    return {
        "run": ([2, 3, 4, 5, 6], [i * pb for i in range(5)]),
        "run_strided_slots": ([1, 2, 3, 4], [128 + i * slot for i in range(4)]),
        "gather": ([7, 2, 9, 0, 11, 4], [i * pb for i in range(6)]),
        "gather_partly_consecutive": ([3, 4, 8, 9], [pb + i * pb for i in range(4)]),
        "scatter": ([5, 1, 10, 3], [7 * pb + 128, 0, 3 * pb + 64, 12 * pb + 256]),
        "scatter_two_grids": ([6, 7, 1, 2, 9],
                              [5 * pb + 256, 6 * pb + 256, 64, 64 + pb, 2 * pb + 64]),
        "slots_shuffled": ([2, 3, 4, 5, 6, 7], [5 * pb, 0, 3 * pb, pb, 9 * pb, 2 * pb]),
        "both_shuffled": ([9, 2, 4, 0, 6], [4 * pb, 5 * pb, 0, pb, 7 * pb]),
        "mixed": ([0, 1, 2, 8, 6, 7, 11], [0, pb, 2 * pb, 9 * pb, 4 * pb, 5 * pb, 20 * pb]),
        "unaligned": ([3, 4, 9, 1], [3 + i * pb for i in range(4)]),
        "single": ([11], [pb]),
        "empty": ([], []),
    }


def _arena_for(offsets: list[int], page_bytes: int, seed: int) -> torch.Tensor:
    size = (max(offsets) if offsets else 0) + page_bytes + 64
    return torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def _spec(pool: HostPool) -> tuple[str, str, int, list[torch.Tensor]]:
    return pool.kind, pool.layout, pool.page_size, pool.buffers


def _bytes_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    pairs = zip(a, b, strict=True)
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


# every path of PageCopier._copy: a few pages with plain ints or the array path of larger
# batches, each copying pages and runs through numpy views (small copies) or through torch
COPY_PATHS = {"small-numpy": {}, "small-torch": {"NUMPY_COPY_MAX": 0},
              "arrays-numpy": {"SMALL_COPY": 0},
              "arrays-torch": {"SMALL_COPY": 0, "NUMPY_COPY_MAX": 0}}


@pytest.fixture(params=list(COPY_PATHS))
def copy_path(request, monkeypatch):
    for name, value in COPY_PATHS[request.param].items():
        monkeypatch.setattr(cpu, name, value)
    return request.param


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_cpu_copies_of_many_scattered_pages_match_reference(config, copy_path):
    """Batches of 1 to 150 (page, slot) pairs drawn at random, runs among them, both ways."""
    pool = make_pool(*config)
    copier = PageCopier(page_major_parts(*_spec(pool)))
    pb = copier.page_bytes
    rng = np.random.default_rng(7)
    for n in (1, 5, 40, 64, 65, 150):
        pages = rng.integers(0, NUM_PAGES, n).tolist()
        slots = rng.permutation(200)[:n]
        slots[: n // 2] = np.arange(n // 2) + 300  # a run of slots...
        pages[: n // 2] = [(3 + i) % NUM_PAGES for i in range(n // 2)]  # ...of host pages
        offsets = (slots * (pb + 64)).tolist()
        got = _arena_for(offsets, pb, seed=n)
        want = got.clone()
        # to the arena: a host page may go to several slots
        copier.to_arena(pages, got, offsets)
        reference.to_arena(*_spec(pool), [p * pool.page_size for p in pages], want, offsets)
        assert torch.equal(got, want), (n, copy_path)
        # and back, one slot per host page (two slots for a page leave either's bytes)
        first = {p: i for i, p in reversed(list(enumerate(pages)))}
        back, ref = make_pool(*config, seed=9), make_pool(*config, seed=9)
        idx = sorted(first.values())
        PageCopier(page_major_parts(*_spec(back))).from_arena(
            [pages[i] for i in idx], got, [offsets[i] for i in idx])
        reference.from_arena(*_spec(ref), [pages[i] * ref.page_size for i in idx], got,
                             [offsets[i] for i in idx])
        assert _bytes_equal(back.buffers, ref.buffers), (n, copy_path)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_cpu_to_arena_matches_reference(config, copy_path):
    pool = make_pool(*config)
    copier = PageCopier(page_major_parts(*_spec(pool)))
    assert copier.page_bytes == reference.read_page(*_spec(pool), 0).numel()
    for name, (pages, offsets) in patterns(copier.page_bytes).items():
        got = _arena_for(offsets, copier.page_bytes, seed=1)
        want = got.clone()
        copier.to_arena(pages, got, offsets)
        starts = [p * pool.page_size for p in pages]
        reference.to_arena(*_spec(pool), starts, want, offsets)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_cpu_from_arena_matches_reference(config, copy_path):
    for name, (pages, offsets) in patterns(make_pool(*config).page_bytes).items():
        got, want = make_pool(*config, seed=2), make_pool(*config, seed=2)
        copier = PageCopier(page_major_parts(*_spec(got)))
        arena = _arena_for(offsets, copier.page_bytes, seed=3)
        copier.from_arena(pages, arena, offsets)
        starts = [p * want.page_size for p in pages]
        reference.from_arena(*_spec(want), starts, arena, offsets)
        assert _bytes_equal(got.buffers, want.buffers), name
        if pages:  # the copy did land (the pools started equal, the arena is random)
            assert not _bytes_equal(got.buffers, make_pool(*config, seed=2).buffers), name


def test_cpu_duplicate_pages_to_arena(copy_path):
    pool = make_pool("mha", "layer_first", 4, torch.bfloat16)
    copier = PageCopier(page_major_parts(*_spec(pool)))
    pb = copier.page_bytes
    arena = torch.zeros(3 * pb, dtype=torch.uint8)
    copier.to_arena([5, 5, 2], arena, [0, pb, 2 * pb])
    page5 = reference.read_page(*_spec(pool), 20)
    assert torch.equal(arena[:pb], page5) and torch.equal(arena[pb : 2 * pb], page5)
    assert torch.equal(arena[2 * pb :], reference.read_page(*_spec(pool), 8))


def test_mamba_without_temporal_state_drops_the_part():
    pool = make_pool("mamba", "page_first", 1, torch.bfloat16, zero_temporal=True)
    parts = page_major_parts(*_spec(pool))
    assert len(parts) == 2  # conv_0, conv_1: the 0-byte temporal part is left out
    copier = PageCopier(parts)
    assert copier.page_bytes == 2 * (3 * 4 + 5) * 2
    arena = torch.zeros(2 * copier.page_bytes, dtype=torch.uint8)
    copier.to_arena([4, 9], arena, [0, copier.page_bytes])
    want = torch.cat([reference.read_page(*_spec(pool), 4), reference.read_page(*_spec(pool), 9)])
    assert torch.equal(arena, want)


def test_page_major_parts_are_views():
    pool = make_pool("mha", "layer_first", 4, torch.float32)
    k, v = page_major_parts(*_spec(pool))
    assert k.shape == (NUM_PAGES, 3, 4 * 2 * 8 * 4) and v.shape == k.shape
    assert k.data_ptr() == pool.kv_buffer.data_ptr()
    assert v.data_ptr() == pool.kv_buffer[1].data_ptr()
    assert k.stride() == (4 * 2 * 8 * 4, NUM_PAGES * 4 * 2 * 8 * 4, 1)


def test_copier_rejects_bad_input(copy_path):
    pool = make_pool("mla", "page_first", 4, torch.bfloat16)
    copier = PageCopier(page_major_parts(*_spec(pool)))
    pb = copier.page_bytes
    arena = torch.zeros(4 * pb, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 pages but 1 arena offsets"):
        copier.to_arena([0, 1], arena, [0])
    with pytest.raises(ValueError, match=f"page {NUM_PAGES} .* outside 0..{NUM_PAGES - 1}"):
        copier.from_arena([NUM_PAGES], arena, [0])
    with pytest.raises(ValueError, match=f"offset {3 * pb + 1} \\+ {pb} page bytes"):
        copier.to_arena([0], arena, [3 * pb + 1])
    with pytest.raises(ValueError, match="offset -64"):
        copier.to_arena([0], arena, [-64])
    with pytest.raises(ValueError, match="1-D torch.uint8"):
        copier.to_arena([0], arena.view(torch.int32), [0])
    with pytest.raises(ValueError, match=f"offsets 64 and {pb} overlap"):
        copier.to_arena([0, 1, 2], arena, [2 * pb, pb, 64])
    before = arena.clone()  # nothing is copied before a check fails
    with pytest.raises(ValueError, match="outside"):
        copier.to_arena([0, 1], arena, [0, 4 * pb])
    assert torch.equal(arena, before)


# ------------------------------------------------------------------ pointer path


def test_segment_plan_inner_offsets_follow_arena_order():
    plan = SegmentPlan([4, 2, 4, 2], order=mha_layer_first_order(2))
    assert plan.order.tolist() == [0, 2, 1, 3]
    assert plan.inner_offsets.tolist() == [0, 8, 4, 10]  # k0 @0, v0 @8, k1 @4, v1 @10
    assert plan.page_bytes == 12
    with pytest.raises(ValueError, match="not a permutation of 0..3"):
        SegmentPlan([1, 1, 1, 1], order=[0, 0, 1, 2])


def test_memmove_runs_merges_touching_segments():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    s, d = src.data_ptr(), dst.data_ptr()
    sizes = np.array([16, 16, 8, 24], dtype=np.int64)
    starts = np.array([0, 16, 32, 40])
    calls = memmove_runs(d + starts, s + starts, sizes)
    assert calls == 1 and torch.equal(dst, src)
    dst.zero_()
    calls = memmove_runs(np.array([d + 32, d]), np.array([s, s + 32]), np.array([32, 32]))
    assert calls == 2
    assert torch.equal(dst[32:], src[:32]) and torch.equal(dst[:32], src[32:])


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[3] == torch.bfloat16], ids=_ids)
def test_pointer_plan_matches_reference(config):
    pool = make_pool(*config)
    probe_ptrs, probe_sizes = pool.get_page_buffer_meta(list(range(pool.page_size)))
    order = mha_layer_first_order(3) if pool.kind in ("mha", "odd") and (
        pool.layout == "layer_first") else None
    plan = SegmentPlan(probe_sizes, order)
    assert plan.page_bytes == pool.page_bytes
    for name, (pages, offsets) in patterns(plan.page_bytes).items():
        starts = [p * pool.page_size for p in pages]
        indices = [t + i for t in starts for i in range(pool.page_size)]
        got = _arena_for(offsets, plan.page_bytes, seed=4)
        want = got.clone()
        plan.to_arena(*pool.get_page_buffer_meta(indices), got, offsets)
        reference.to_arena(*_spec(pool), starts, want, offsets)
        assert torch.equal(got, want), name
        back = make_pool(*config, seed=9)
        plan.from_arena(*back.get_page_buffer_meta(indices), got, offsets)
        for t in starts:
            assert torch.equal(reference.read_page(*_spec(back), t),
                               reference.read_page(*_spec(pool), t)), name


def test_pointer_plan_rejects_mismatched_meta():
    plan = SegmentPlan([8, 8])
    arena = torch.zeros(64, dtype=torch.uint8)
    host = torch.zeros(16, dtype=torch.uint8)
    ptrs = [host.data_ptr(), host.data_ptr() + 8]
    with pytest.raises(ValueError, match="2 pages x 2 segments need 4 pointers"):
        plan.to_arena(ptrs, [8, 8], arena, [0, 16])
    with pytest.raises(ValueError, match="page 0 has segment sizes \\[8, 4\\]"):
        plan.to_arena(ptrs, [8, 4], arena, [0])
    with pytest.raises(ValueError, match="offset 60 \\+ 16 page bytes"):
        plan.to_arena(ptrs, [8, 8], arena, [60])
