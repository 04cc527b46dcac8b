"""HostPool (SGLang host-pool surface) and make_page_io: three paths, one arena byte format."""

from __future__ import annotations

import threading

import pytest
import torch

from hicached.client.hostpool import (
    FlatPageIO,
    HostPool,
    NativePageIO,
    PointerPageIO,
    make_page_io,
)
from hicached.kernels import reference
from hicached.kernels.pageio import PageIO

NUM_PAGES = 10
POOL_CASES = (
    [(k, lay, ps) for k in ("mha", "mla", "indexer")
     for lay in ("layer_first", "page_first", "page_first_direct") for ps in (1, 4)]
    + [("mamba", "page_first", 1), ("mamba", "page_first_direct", 1), ("mamba0", "page_first", 1)]
)


def _fill(pool: HostPool, seed: int) -> HostPool:
    gen = torch.Generator().manual_seed(seed)
    for t in pool.buffers:
        if t.numel():
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return pool


def make_pool(kind: str, layout: str, page_size: int, seed: int | None = 0) -> HostPool:
    """A small pool (random bytes, or zeros when ``seed`` is None); mamba0 has no SSM state."""
    if kind == "mha":
        pool = HostPool.allocate_mha(NUM_PAGES, page_size, 3, 2, 4, layout, torch.bfloat16)
    elif kind == "mla":
        pool = HostPool.allocate_mla(NUM_PAGES, page_size, 3, 12, layout, torch.float32)
    elif kind == "indexer":
        pool = HostPool.allocate_indexer(NUM_PAGES, page_size, 2, 24, layout, torch.uint8)
    else:
        temporal = (0,) if kind == "mamba0" else (2, 3)
        pool = HostPool.allocate_mamba(NUM_PAGES, 2, temporal, [(3, 2), (4,)], layout=layout)
    return pool if seed is None else _fill(pool, seed)


def _ids(case) -> str:
    return "-".join(map(str, case))


class FlatOnly:
    """Duck-typed stand-in for a SGLang pool that offers only the flat page accessors."""

    def __init__(self, pool: HostPool):
        self.page_size, self.size, self._pool = pool.page_size, pool.size, pool

    def get_data_page(self, index, flat=True):
        return self._pool.get_data_page(index, flat)

    def get_dummy_flat_data_page(self):
        return self._pool.get_dummy_flat_data_page()

    def set_from_flat_data_page(self, index, data_page):
        self._pool.set_from_flat_data_page(index, data_page)


class PointerOnly:
    """Stand-in for a SGLang pool seen through its zero-copy meta (plus what SGLang also has)."""

    def __init__(self, pool: HostPool):
        self.page_size, self.size, self.layout, self._pool = (
            pool.page_size, pool.size, pool.layout, pool)
        self.kv_buffer = getattr(pool, "kv_buffer", None)

    def get_page_buffer_meta(self, indices):
        return self._pool.get_page_buffer_meta(indices)

    def get_size_per_token(self):
        return self._pool.get_size_per_token()


BATCH_PAGES = [3, 4, 5, 9, 0, 7]  # a run of three, then scattered


def _batch(io: PageIO) -> tuple[list[int], list[int]]:
    starts = [p * io.page_size for p in BATCH_PAGES]
    offsets = [0, io.page_bytes, 2 * io.page_bytes, 5 * io.page_bytes, 3 * io.page_bytes,
               4 * io.page_bytes]
    return starts, offsets


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes hold NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def _all_bytes(pool: HostPool) -> list[torch.Tensor]:
    return [b.view(torch.uint8) for b in pool.buffers if b.numel()]


@pytest.mark.parametrize("case", POOL_CASES, ids=_ids)
def test_paths_write_identical_arena_bytes_and_restore_identically(case):
    pool = make_pool(*case)
    ios = {
        "native": make_page_io(pool),
        "pointer": make_page_io(PointerOnly(pool)),
        "flat": make_page_io(FlatOnly(pool)),
    }
    assert isinstance(ios["native"], NativePageIO)
    assert isinstance(ios["pointer"], PointerPageIO)
    assert isinstance(ios["flat"], FlatPageIO)
    assert {io.page_bytes for io in ios.values()} == {pool.page_bytes}
    assert [io.path for io in ios.values()] == list(ios)
    starts, offsets = _batch(ios["native"])
    arenas = {}
    for name, io in ios.items():
        arenas[name] = torch.full((6 * pool.page_bytes + 64,), 0xA5, dtype=torch.uint8)
        io.to_arena(starts, arenas[name], offsets)
    want = arenas["native"].clone().fill_(0xA5)
    reference.to_arena(pool.kind, pool.layout, pool.page_size, pool.buffers, starts, want, offsets)
    for name, arena in arenas.items():
        assert torch.equal(arena, want), name
    # Restore the native arena through every path into zeroed pools: all equal the source pages.
    for name in ios:
        target = make_pool(*case, seed=None)
        io = {"native": make_page_io(target), "pointer": make_page_io(PointerOnly(target)),
              "flat": make_page_io(FlatOnly(target))}[name]
        io.from_arena(starts, arenas["native"], offsets)
        for t in starts:
            got = reference.read_page(target.kind, target.layout, target.page_size,
                                      target.buffers, t)
            assert torch.equal(got, reference.read_page(pool.kind, pool.layout, pool.page_size,
                                                        pool.buffers, t)), (name, t)
        untouched = (set(range(NUM_PAGES)) - set(BATCH_PAGES)).pop() * pool.page_size
        assert not reference.read_page(target.kind, target.layout, target.page_size,
                                       target.buffers, untouched).any(), name


@pytest.mark.parametrize("case", POOL_CASES, ids=_ids)
def test_round_trip_whole_pool_into_a_zeroed_pool(case):
    src, dst = make_pool(*case), make_pool(*case, seed=None)
    io_src, io_dst = make_page_io(src), make_page_io(dst)
    starts = [p * src.page_size for p in range(NUM_PAGES)]
    offsets = [(NUM_PAGES - 1 - p) * io_src.page_bytes for p in range(NUM_PAGES)]  # reversed
    arena = torch.zeros(NUM_PAGES * io_src.page_bytes, dtype=torch.uint8)
    io_src.to_arena(starts, arena, offsets)
    io_dst.from_arena(starts, arena, offsets)
    assert all(torch.equal(a, b) for a, b in zip(_all_bytes(src), _all_bytes(dst), strict=True))


@pytest.mark.parametrize("case", POOL_CASES, ids=_ids)
@pytest.mark.parametrize("pad", [0, 40])  # packed slots, and slots rounded up (slabs)
def test_pages_in_a_row_take_the_run_path_with_the_same_bytes(case, pad):
    """Pages one after the other into slots one stride apart (the client's usual batch) skip the
    array checks (``NativePageIO._in_a_row``): same arena bytes as the general path, same pages
    back, gaps between slots untouched."""
    src, dst = make_pool(*case), make_pool(*case, seed=None)
    io = make_page_io(src)
    stride = io.page_bytes + pad
    starts = [p * src.page_size for p in range(2, 7)]
    offsets = [64 + k * stride for k in range(5)]
    fast = torch.full((64 + 5 * stride,), 0xA5, dtype=torch.uint8)
    general = fast.clone()
    io.to_arena(starts, fast, offsets)
    io.to_arena(torch.tensor(starts), general, torch.tensor(offsets))  # tensors: general path
    want = general.clone().fill_(0xA5)
    reference.to_arena(src.kind, src.layout, src.page_size, src.buffers, starts, want, offsets)
    assert torch.equal(fast, want) and torch.equal(general, want)
    make_page_io(dst).from_arena(starts, fast, offsets)
    for t in range(NUM_PAGES):
        got = reference.read_page(dst.kind, dst.layout, dst.page_size, dst.buffers,
                                  t * src.page_size)
        if 2 <= t < 7:
            assert torch.equal(got, reference.read_page(src.kind, src.layout, src.page_size,
                                                        src.buffers, t * src.page_size)), t
        else:
            assert not got.any(), t


def test_pages_in_a_row_are_checked_too():
    pool = make_pool("mla", "page_first", 4)
    io = make_page_io(pool)
    pb = io.page_bytes
    arena = torch.zeros(3 * pb, dtype=torch.uint8)
    for call in (io.to_arena, io.from_arena):
        with pytest.raises(ValueError, match="do not fit the arena"):
            call([0, 4, 8], arena, [pb, 2 * pb, 3 * pb])  # last slot past the end
        with pytest.raises(ValueError, match="outside the pool of 40 tokens"):
            call([32, 36, 40], arena, [0, pb, 2 * pb])  # last page past the pool
        with pytest.raises(ValueError, match="is not a multiple of page_size"):
            call([2, 6], arena, [0, pb])
        with pytest.raises(ValueError, match="token_starts must hold integers"):
            call([0.0, 4.0], arena, [0, pb])
        with pytest.raises(ValueError, match="offsets must hold integers"):
            call([0, 4], arena, [0, "x"])
    with pytest.raises(ValueError, match="overlap"):
        io.to_arena([0, 4], arena, [0, pb // 2])  # slots closer than a page: general path


def test_sglang_surface_mha_layer_first():
    pool = make_pool("mha", "layer_first", 4)
    kv = pool.kv_buffer  # [2, layers 3, tokens 40, heads 2, dim 4]
    page = pool.get_data_page(8, flat=False)
    assert page.shape == (2, 3, 4, 2, 4) and _same(page, kv[:, :, 8:12])
    assert _same(pool.get_data_page(8), kv[:, :, 8:12].flatten())
    dummy = pool.get_dummy_flat_data_page()
    assert dummy.dtype == torch.bfloat16 and dummy.numel() == 2 * 3 * 4 * 2 * 4 and not dummy.any()
    pool.set_from_flat_data_page(8, dummy)
    assert not kv[:, :, 8:12].any() and kv[:, :, 12:16].view(torch.uint8).any()
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(8, 16))
    want = [kv[i, layer, t].data_ptr() for t in (8, 12) for layer in range(3) for i in (0, 1)]
    assert ptrs == want and sizes == [4 * 2 * 4 * 2] * 12
    assert pool.get_size_per_token() == 2 * 3 * 2 * 4 * 2 and pool.get_ksize_per_token() == 48


def test_sglang_surface_page_layouts():
    mla = make_pool("mla", "page_first", 4)
    assert mla.get_data_page(4).data_ptr() == mla.kv_buffer[4].data_ptr()  # a view, as SGLang's
    mha = make_pool("mha", "page_first", 4)
    assert _same(mha.get_data_page(4), mha.kv_buffer[:, 4:8].flatten())  # K and V: a copy
    ptrs, sizes = mha.get_page_buffer_meta(list(range(12, 16)) + list(range(4)))
    kv = mha.kv_buffer
    assert ptrs == [kv[0, 12].data_ptr(), kv[1, 12].data_ptr(), kv[0, 0].data_ptr(),
                    kv[1, 0].data_ptr()]
    assert sizes == [4 * 3 * 2 * 4 * 2] * 4
    direct = make_pool("mla", "page_first_direct", 4)
    assert direct.get_data_page(8, flat=False).shape == (1, 3, 4, 1, 12)
    assert direct.get_page_buffer_meta(range(8, 12)) == ([direct.kv_buffer[2].data_ptr()],
                                                         [3 * 4 * 12 * 4])
    mla_lf = make_pool("mla", "layer_first", 4)
    ptrs, _ = mla_lf.get_page_buffer_meta(range(4, 8))
    assert ptrs == [mla_lf.kv_buffer[layer, 4].data_ptr() for layer in range(3)]
    idx = make_pool("indexer", "page_first", 4)
    assert idx.get_data_page(4, flat=False).shape == (1, 2, 1, 24)
    assert idx.get_page_buffer_meta(range(4, 8)) == ([idx.buffers[0][1].data_ptr()], [48])


def test_sglang_surface_mamba():
    pool = make_pool("mamba", "page_first", 1)
    temporal, conv0, conv1 = pool.buffers
    page = pool.get_data_page(6)
    assert page.dtype == torch.uint8 and page.numel() == pool.page_bytes
    assert _same(page[: 2 * 2 * 3 * 4], temporal[6].view(torch.uint8).flatten())
    ptrs, sizes = pool.get_page_buffer_meta([6, 2])
    assert ptrs == [temporal[6].data_ptr(), conv0[6].data_ptr(), conv1[6].data_ptr(),
                    temporal[2].data_ptr(), conv0[2].data_ptr(), conv1[2].data_ptr()]
    assert sizes == [2 * 6 * 4, 2 * 6 * 2, 2 * 4 * 2] * 2
    pool.set_from_flat_data_page(2, page)
    assert torch.equal(pool.get_data_page(2), page)
    no_ssm = make_pool("mamba0", "page_first", 1)
    assert len(no_ssm.get_page_buffer_meta([0])[0]) == 2  # the 0-byte temporal pointer is dropped


def test_sglang_surface_rejects_non_page_starts():
    pool = make_pool("mla", "page_first", 4)
    with pytest.raises(ValueError, match="token index 6 is not a page start"):
        pool.get_data_page(6)
    with pytest.raises(ValueError, match="token index 40 is not a page start .* 40 tokens"):
        pool.set_from_flat_data_page(40, pool.get_dummy_flat_data_page())
    with pytest.raises(ValueError, match="flat page has 4 bytes, pages of this pool have 576"):
        pool.set_from_flat_data_page(0, torch.zeros(1))
    with pytest.raises(ValueError, match="6 indices is not a multiple of page_size 4"):
        pool.get_page_buffer_meta(range(6))


@pytest.mark.parametrize("path", ["native", "pointer", "flat"])
def test_page_io_rejects_bad_input(path):
    pool = make_pool("mha", "page_first", 4)
    io = make_page_io({"native": pool, "pointer": PointerOnly(pool), "flat": FlatOnly(pool)}[path])
    arena = torch.zeros(3 * io.page_bytes, dtype=torch.uint8)
    pb = io.page_bytes
    for call in (io.to_arena, io.from_arena):
        with pytest.raises(ValueError, match="2 token starts but 1 arena offsets"):
            call([0, 4], arena, [0])
        with pytest.raises(ValueError, match="token start 6 \\(item 1\\) is not a multiple of "
                                             "page_size 4"):
            call([0, 6], arena, [0, pb])
        with pytest.raises(ValueError, match="token start 40 \\(item 0\\) is outside the pool of "
                                             "40 tokens"):
            call([40], arena, [0])
        with pytest.raises(ValueError, match="token start -4"):
            call([-4], arena, [0])
        with pytest.raises(ValueError, match=f"offset {2 * pb + 64} \\+ {pb} page bytes is "
                                             f"outside the arena of {3 * pb} bytes"):
            call([0], arena, [2 * pb + 64])
    with pytest.raises(ValueError, match=f"slots at offsets 0 and 64 overlap \\(page_bytes {pb}"):
        io.to_arena([0, 4], arena, [64, 0])


def test_make_page_io_picks_paths_and_names_missing_methods():
    pool = make_pool("mla", "layer_first", 4)
    assert isinstance(make_page_io(pool, path="pointer"), PointerPageIO)
    assert isinstance(make_page_io(pool, path="flat"), FlatPageIO)
    with pytest.raises(ValueError, match="unknown page path 'gpu'"):
        make_page_io(pool, path="gpu")
    with pytest.raises(TypeError, match="native path needs a HostPool, got FlatOnly"):
        make_page_io(FlatOnly(pool), path="native")

    class Bare:
        page_size = 4

        def get_data_page(self, index, flat=True):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="lacks get_page_buffer_meta and set_from_flat_data_page, "
                                        "get_dummy_flat_data_page"):
        make_page_io(Bare())
    with pytest.raises(TypeError, match="has no page_size"):
        make_page_io(object())


def test_pointer_refusal_falls_back_to_flat():
    class LayerFirstSGLangMLA(FlatOnly):
        """Like SGLang's MLA/DSA host pools whose meta refuses layer_first."""

        def get_page_buffer_meta(self, indices):
            raise ValueError("Unsupported layout: layer_first")

    pool = make_pool("indexer", "layer_first", 4)
    io = make_page_io(LayerFirstSGLangMLA(pool))
    assert isinstance(io, FlatPageIO) and io.page_bytes == pool.page_bytes


def test_pointer_meta_disagreeing_with_the_pool_falls_back_to_flat():
    class SkipsV(FlatOnly, PointerOnly):
        """Meta that covers only K (like SGLang's kv_split with skip_v): not the flat page."""

        def __init__(self, pool):
            FlatOnly.__init__(self, pool)
            PointerOnly.__init__(self, pool)

        def get_page_buffer_meta(self, indices):
            ptrs, sizes = self._pool.get_page_buffer_meta(indices)
            return ptrs[::2], sizes[::2]

    pool = make_pool("mha", "page_first", 4)
    with pytest.raises(ValueError, match="meta segments cover 192 bytes per page, the pool says "
                                         "384"):
        PointerPageIO(SkipsV(pool))
    assert isinstance(make_page_io(SkipsV(pool)), FlatPageIO)


def test_geometry_errors():
    with pytest.raises(ValueError, match="mha page_first buffer must have 5 dims with dim 0 == 2"):
        HostPool.mha(torch.zeros(3, 8, 2, 2, 4), "page_first", 4)
    with pytest.raises(ValueError, match="10 tokens is not a multiple of page_size 4"):
        HostPool.mla(torch.zeros(10, 2, 1, 8), "page_first", 4)
    with pytest.raises(ValueError, match="page_first_direct dim of page_size is 8, not 4"):
        HostPool.mla(torch.zeros(2, 3, 8, 1, 8), "page_first_direct", 4)
    with pytest.raises(ValueError, match="mamba pools need page_first or page_first_direct"):
        HostPool.mamba([torch.zeros(4, 2, 3)], "layer_first")
    with pytest.raises(ValueError, match="mamba component 1 has shape \\(5, 2, 3\\)"):
        HostPool.mamba([torch.zeros(4, 2, 3), torch.zeros(5, 2, 3)])
    with pytest.raises(ValueError, match="unknown layout 'page_head'"):
        HostPool.mha(torch.zeros(2, 2, 8, 2, 4), "page_head", 4)
    with pytest.raises(ValueError, match="buffer 0 must be a contiguous CPU tensor"):
        HostPool.mla(torch.zeros(8, 2, 1, 8).transpose(0, 1), "layer_first", 4)


def test_concurrent_calls_on_disjoint_pages():
    pool = make_pool("mha", "layer_first", 4)
    io = make_page_io(pool)
    arena = torch.zeros(NUM_PAGES * io.page_bytes, dtype=torch.uint8)
    halves = [list(range(0, NUM_PAGES, 2)), list(range(1, NUM_PAGES, 2))]

    def work(pages):
        for _ in range(20):
            io.to_arena([p * 4 for p in pages], arena, [p * io.page_bytes for p in pages])

    threads = [threading.Thread(target=work, args=(pages,)) for pages in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = torch.zeros_like(arena)
    reference.to_arena("mha", "layer_first", 4, pool.buffers, [p * 4 for p in range(NUM_PAGES)],
                       want, [p * io.page_bytes for p in range(NUM_PAGES)])
    assert torch.equal(arena, want)
