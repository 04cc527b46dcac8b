"""hicached as a vLLM KV-cache tier: the ``HicachedConnector`` v1 KV connector.

Turn it on with one flag (every vLLM instance and rank of the node then shares the daemon's L2
and its L3)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HicachedConnector",
        "kv_connector_module_path": "hicached.plugin.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"endpoint": "ipc:///run/hicached/hicached.sock"}}'

``kv_connector_extra_config`` takes the SGLang plugin's keys (``plugin/settings.py``):
``endpoint``, ``timeout_s``, ``retry_interval_s``, ``model_name`` (default: vLLM's served model
name), ``model_revision``, ``namespace_salt``, ``token``. Names, keys and pools:
``plugin/vllm_naming.py``; how blocks become pages: ``plugin/vllm_blocks.py``.

How a request goes (the scheduler instance runs in vLLM's engine-core process, a worker instance
in each worker process):

1. ``get_num_new_matched_tokens``: the page keys of the request's blocks beyond its local hit
   (vLLM's block hashes as hex) go to the daemon in one exists call; the answer is the longest
   prefix every pool (KV-cache group) can restore, capped one token short of the prompt (vLLM
   must compute at least one token).
2. ``update_state_after_alloc`` / ``build_connector_meta``: the hit's block ids per group become
   this step's loads; the blocks this step completes become its saves (a block is saved in the
   step that computes its last token, while its block id is certainly still the request's).
3. Worker ``start_load_kv`` copies the hit's pages from arena slots into vLLM's blocks. By
   default asynchronously (``load_async``, vLLM's ``WAITING_FOR_REMOTE_KVS``): the request waits
   while a loader thread copies, other requests' forward passes go on, and
   ``get_transfer_results`` reports the load done. With ``"load_async": false`` (one KV-cache
   group only) the load runs before the forward pass that needs it. A page the daemon no longer
   has, or a daemon gone meanwhile, makes its blocks and those after them load errors
   (``get_block_ids_with_load_errors``; with several KV-cache groups, whose block ids vLLM
   cannot map back, the whole request's ``failed_recving``): vLLM recomputes them, never reads
   them.
4. Worker ``wait_for_save`` (after the forward pass) copies the completed blocks into arena slots
   and commits them with their chain (parent key, depth) for the daemon's eviction.

Blocks in host memory are copied with one ``memmove`` per layer segment (``BlockPool``); blocks
on a GPU with device gathers and one DMA per batch (``vllm_blocks.device_pool``; the
``copy_path`` setting picks).

A daemon that is down or slow answers misses (logged once per episode, counted), never an engine
error: the SGLang plugin's ``RankSessions`` / ``PluginHealth`` do this for both engines.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from hicached.plugin.health import PluginHealth
from hicached.plugin.sessions import RankSessions
from hicached.plugin.settings import PluginSettings
from hicached.plugin.vllm_blocks import BlockPool, device_pool, token_indices
from hicached.plugin.vllm_naming import (
    build_vllm_namespace,
    check_hash_algo,
    chunk_alignment_warning,
    config_digest,
    copy_path,
    group_specs,
    load_async,
    page_keys,
    pool_names,
)
from hicached.types import PoolTransfer

# vLLM's logging shows its own loggers ("vllm.*") at INFO; the shared plugin code's warnings
# ("hicached.plugin") reach stderr through Python's last-resort handler
log = init_logger("vllm.hicached")
NULL_BLOCK = 0  # vLLM's null block (skipped blocks of sliding-window and state groups)


@dataclass
class PageRun:
    """Consecutive blocks of one request to load or save: ``keys[i]`` is block ``first + i``;
    ``blocks[pool]`` the block ids of that pool's pages (``None`` where the group holds
    nothing there: a skipped sliding-window or state block)."""

    req_id: str
    first: int
    keys: list[str]
    blocks: dict[str, list[int | None]]
    parent: str | None = None
    background: bool = False  # a load the request waits for (vLLM's WAITING_FOR_REMOTE_KVS)


@dataclass
class HicachedMeta(KVConnectorMetadata):
    """One step's loads and saves, from the scheduler to every worker."""

    loads: list[PageRun] = field(default_factory=list)
    saves: list[PageRun] = field(default_factory=list)


@dataclass
class _Req:
    """The scheduler's view of one running request."""

    request: Any
    blocks: list[list[int]] = field(default_factory=list)  # per group, as vLLM gave them
    saved: int = 0  # leading blocks stored or known to be (never saved again)
    hit: tuple[int, int] = (0, 0)  # (first block, blocks) the last exists call promised
    load: tuple[int, int] | None = None  # what to load at the next step


class HicachedConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector over a hicached daemon (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        # a page that fails to load is a cache miss: vLLM must recompute it, not fail the
        # request (its default); read by the scheduler right after it builds this instance
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", None) != "recompute":
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._settings = PluginSettings.from_extra_config(extra, os.environ)
        cache = vllm_config.cache_config
        check_hash_algo(str(getattr(cache, "prefix_caching_hash_algo", "sha256")), os.environ)
        self._groups = group_specs(kv_cache_config)
        self._pools = pool_names(self._groups)
        sizes = {g.block_size for g in self._groups}
        if len(sizes) != 1:
            raise ValueError(f"hicached: KV-cache groups of different block sizes {sorted(sizes)}"
                             " are not supported yet")
        self._block = sizes.pop()
        self._async = load_async(extra, len(self._groups))
        self._copy_path = copy_path(extra)
        self._on_gpu = False  # worker: some group's blocks are on a GPU
        self._hash_block = int(getattr(kv_cache_config, "hash_block_size", None) or self._block)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._is_worker = role == KVConnectorRole.WORKER
        name = f"hicached-vllm {'worker' if self._is_worker else 'scheduler'}"
        self._health = PluginHealth(name, record_metrics=False)
        self._sessions = RankSessions(self._settings, None, name, self._health,
                                      namespace=self._namespace(vllm_config, cache),
                                      event_hash="vllm_bytes")
        self._reqs: dict[str, _Req] = {}  # scheduler: running requests
        self._load_errors: set[int] = set()  # worker: block ids to recompute
        self._loading: dict[str, Future] = {}  # worker: background loads, by request
        self._loader: ThreadPoolExecutor | None = None  # worker: their thread, made on first use
        self._async_loads: list[PageRun] = []  # scheduler: loads for the next metadata
        self._io_s = {"load": 0.0, "save": 0.0}  # worker: seconds in daemon calls
        self._io_blocks = {"load": 0, "save": 0, "background": 0, "failed": 0}
        log.info("%s: namespace %s, pools %s", name, self._sessions.namespace.namespace,
                 sorted(self._pools.values()))
        self._aligned_told = self._is_worker  # scheduler: the chunking checked (first step)

    def _namespace(self, vllm_config: Any, cache: Any):
        model = vllm_config.model_config
        served = getattr(model, "served_model_name", None) or model.model
        if isinstance(served, (list, tuple)):
            served = served[0]
        hf = getattr(model, "hf_config", None)
        config = hf.to_dict() if hasattr(hf, "to_dict") else {}
        parallel = vllm_config.parallel_config
        tp_rank = pp_rank = 0
        if self._is_worker:
            from vllm.distributed.parallel_state import (  # worker only
                get_pp_group,
                get_tensor_model_parallel_rank,
            )
            tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        return build_vllm_namespace(
            model=self._settings.model_name or str(served), config=config_digest(config),
            dtype=model.dtype, kv_cache_dtype=str(cache.cache_dtype), block_size=self._block,
            hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "sha256")),
            groups=self._groups, tp_rank=tp_rank, tp_size=parallel.tensor_parallel_size,
            pp_rank=pp_rank, pp_size=parallel.pipeline_parallel_size,
            revision=self._settings.model_revision or str(getattr(model, "revision", "") or ""),
            salt=self._settings.namespace_salt)

    # ------------------------------------------------------------------ scheduler side

    def _keys(self, request: Any, count: int) -> list[str]:
        return page_keys(request.block_hashes, self._hash_block, self._block, count)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        st = self._reqs.setdefault(request.request_id, _Req(request))
        st.request, st.hit = request, (0, 0)
        first = num_computed_tokens // self._block
        keys = self._keys(request, (request.num_tokens - 1) // self._block)
        if len(keys) <= first:
            return 0, False
        want = keys[first:]
        queries = [PoolTransfer(name, keys=want[-g.window_blocks:], hit_policy=g.hit_policy)
                   for g in self._groups if (name := self._pools[g.index]) != "kv"]

        def ask(client) -> int:
            return client.batch_exists_v2(want, queries).kv_hit_pages

        hit = self._sessions.guard("exists", lambda: 0, ask)
        self._health.add(calls=1, exists_pages=len(want), hit_pages=hit)
        st.hit = (first, hit)
        return hit * self._block, self._async and hit > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        st = self._reqs.setdefault(request.request_id, _Req(request))
        st.blocks = [list(b) for b in blocks.get_block_ids()]
        first, hit = st.hit
        n = min(hit, num_external_tokens // self._block)
        st.load = (first, n) if n > 0 else None
        if st.load is not None and self._async:
            # the request waits unscheduled until the load is reported done: it goes out in
            # this step's metadata, and the blocks it fills are never saved again
            keys = self._keys(request, first + n)[first:]
            run = self._run(st, request.request_id, first, keys)
            run.background = True
            self._async_loads.append(run)
            st.saved, st.load = first + len(run.keys), None

    def build_connector_meta(self, scheduler_output: Any) -> HicachedMeta:
        if not self._aligned_told:  # (vLLM sets the block size it chunks on after our start)
            self._aligned_told = True
            warning = chunk_alignment_warning(
                int(getattr(self._vllm_config.cache_config, "block_size", 0) or 0),
                self._block, self._groups)
            if warning:
                log.warning("hicached-vllm: %s", warning)
        meta = HicachedMeta(loads=self._async_loads)
        self._async_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:  # not asked about (cannot happen with vLLM's scheduler): skip
                continue
            st.blocks = [list(b) for b in new.block_ids]
            self._plan(meta, st, new.req_id, new.num_computed_tokens + scheduled[new.req_id],
                       new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:  # preempted and back: its blocks are new
                st.blocks = [list(b) for b in new_ids] if new_ids is not None else st.blocks
            elif new_ids is not None:
                for mine, more in zip(st.blocks, new_ids, strict=False):
                    mine.extend(more)
            computed = cached.num_computed_tokens[i]
            self._plan(meta, st, req_id, computed + scheduled.get(req_id, 0),
                       computed if req_id in resumed else None)
        return meta

    def _run(self, st: _Req, req_id: str, first: int, keys: list[str]) -> PageRun:
        blocks: dict[str, list[int | None]] = {}
        for g in self._groups:
            ids = st.blocks[g.index][first:first + len(keys)]
            if len(ids) < len(keys):  # the request's blocks end first (cannot happen)
                keys = keys[:len(ids)]
            blocks[self._pools[g.index]] = [None if b == NULL_BLOCK and
                                            self._pools[g.index] != "kv" else b for b in ids]
        blocks = {k: v[:len(keys)] for k, v in blocks.items()}
        parent = self._keys(st.request, first)[first - 1] if first else None
        return PageRun(req_id, first, keys, blocks, parent)

    def _plan(self, meta: HicachedMeta, st: _Req, req_id: str, computed_after: int,
              started_at: int | None) -> None:
        """This step's load (first schedule) and save (blocks it completes) of a request."""
        if started_at is not None:
            # a local hit or a finished background load: those blocks are known (after a failed
            # load vLLM's count is lower, and the blocks it recomputes are saved)
            st.saved = started_at // self._block
            if st.load is not None:
                first, n = st.load
                keys = self._keys(st.request, first + n)[first:]
                if keys:
                    meta.loads.append(self._run(st, req_id, first, keys))
                st.saved = max(st.saved, first + len(keys))
            st.load = None
        full = computed_after // self._block
        if full > st.saved:
            keys = self._keys(st.request, full)[st.saved:]
            if keys:
                run = self._run(st, req_id, st.saved, keys)
                self._only_end_state(run, full - 1 if computed_after == full * self._block
                                     else None)
                meta.saves.append(run)
                st.saved += len(keys)

    def _only_end_state(self, run: PageRun, end_block: int | None) -> None:
        """Keep in a save only the state that is its block's: a state group's slot holds the
        state after the step's last token, so it is block ``p``'s state only when the step
        ended exactly at that block's end (``end_block``). vLLM rotates a request's state
        slots, and its engine core may chunk a prefill on another block size than its
        groups' (on CPU it kept 128 while the groups took 384 to fit an fp32 state): a slot
        named at any other block holds another position's state, which a hit would restore
        as this block's (wrong outputs). Such blocks are stored without their state."""
        for g in self._groups:
            if g.kind != "state":
                continue
            ids = run.blocks[self._pools[g.index]]
            for i in range(len(ids)):
                if run.first + i != end_block:
                    ids[i] = None

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any
                                    ) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        groups = self._kv_cache_config.kv_cache_groups
        for g in self._groups:
            layers = [(n, kv_caches[n]) for n in groups[g.index].layer_names if n in kv_caches]
            gpu = any(t.device.type != "cpu" for _, t in layers)
            try:
                if self._copy_path == "device" or (self._copy_path == "auto" and gpu):
                    pool = device_pool(layers, self._num_blocks, self._block)
                    self._on_gpu |= gpu
                else:
                    pool = BlockPool(layers, self._num_blocks, self._block)
            except ValueError as e:
                self._health.warn_once(f"group:{g.index}", f"hicached: KV-cache group {g.index}"
                                       f" cannot be stored ({e}); its pages miss")
                continue
            self._sessions.add_pool(self._pools[g.index], pool)
        # register the pools now: the scheduler's first exists call names them
        self._sessions.guard("register", lambda: None, lambda client: None)
        if self._async:  # the loader thread's own session too, before the first load waits on it
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="hicached-load")
            self._loader.submit(self._sessions.guard, "register", lambda: None,
                                lambda client: None).result()

    def _transfers(self, run: PageRun) -> tuple[list[PoolTransfer], list[int]]:
        """The run's pool transfers, and every block id it names."""
        out, ids = [], []
        for g in self._groups:
            name = self._pools[g.index]
            if not self._sessions.usable(name):
                raise KeyError(name)
            pairs = [(k, b) for k, b in zip(run.keys, run.blocks[name], strict=True)
                     if b is not None]
            if pairs:
                blocks = [b for _, b in pairs]
                ids += blocks
                out.append(PoolTransfer(name, host_indices=token_indices(blocks, self._block),
                                        keys=[k for k, _ in pairs], hit_policy=g.hit_policy))
        return out, ids

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for run in getattr(meta, "loads", ()):
            if not run.background:
                self._load_errors |= self._load(run)
                continue
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="hicached-load")
            self._loading[run.req_id] = self._loader.submit(self._load, run)
            self._io_blocks["background"] += len(run.keys)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The background loads that ended since the last call, every one of them reported
        (vLLM frees an aborted request's blocks only then). A load with errors: its bad blocks
        go to ``get_block_ids_with_load_errors``, which vLLM asks right after this in the same
        step; with several KV-cache groups the whole request is a failed receive."""
        done, failed = set(), set()
        for req_id in [r for r, f in self._loading.items() if f.done()]:
            future = self._loading.pop(req_id)
            try:
                bad = future.result()
            except Exception as e:  # noqa: BLE001 - a bug in a load must not kill the engine
                self._health.warn_once("load-crash", f"hicached: a load failed ({e!r}); its "
                                       "blocks are recomputed")
                bad = None
            done.add(req_id)
            if bad is None or (bad and len(self._groups) > 1):
                failed.add(req_id)
                self._io_blocks["failed"] += 1
            elif bad:
                self._load_errors |= bad
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.get_transfer_results(finished_req_ids).finished_recving

    def _load(self, run: PageRun) -> set[int]:
        """Copy a run's pages into its blocks; the block ids that did not load."""
        try:
            transfers, ids = self._transfers(run)
        except KeyError as e:  # a group not registered: nothing of this run can be used
            self._health.warn_once(f"load:{e}", f"hicached: pool {e} is not registered; "
                                   "its hits are recomputed")
            return {b for v in run.blocks.values() for b in v if b is not None}
        t0 = time.perf_counter()
        got = self._sessions.guard("get", dict, lambda c: c.batch_get_v2(transfers))
        self._io_s["load"] += time.perf_counter() - t0
        self._io_blocks["load"] += len(run.keys)
        bad = len(run.keys)  # the first block position that did not load
        for t in transfers:
            ok = got.get(str(t.name))
            positions = [i for i, b in enumerate(run.blocks[str(t.name)]) if b is not None]
            if ok is None or len(ok) != len(positions):
                bad = 0
                break
            for pos, flag in zip(positions, ok, strict=True):
                if not flag:
                    # a missing state spoils the whole run (states are needed at its end)
                    bad = min(bad, pos if str(t.name) == "kv" else 0)
        self._health.add(read_pages=len(ids), read_hit_pages=len(ids) if bad == len(run.keys)
                         else 0)
        return {b for v in run.blocks.values() for b in v[bad:] if b is not None}

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._on_gpu and getattr(meta, "saves", ()):
            import torch

            torch.cuda.synchronize()  # the forward pass's writes to the blocks, on any stream
        for run in getattr(meta, "saves", ()):
            try:
                transfers, ids = self._transfers(run)
            except KeyError:
                continue
            t0 = time.perf_counter()
            result = self._sessions.guard(
                "set", dict, lambda c, t=transfers, r=run: c.batch_set_v2(
                    t, parent=r.parent, depth=r.first))
            self._io_s["save"] += time.perf_counter() - t0
            self._io_blocks["save"] += len(run.keys)
            self._health.add(write_pages=len(ids),
                             written_pages=sum(sum(v) for v in result.values()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._is_worker:
            log.info("hicached-vllm worker: saved %d tokens in %.3f s, loaded %d tokens in "
                     "%.3f s (%d in the background; %d requests' loads failed whole); "
                     "counters %s", self._io_blocks["save"] * self._block, self._io_s["save"],
                     self._io_blocks["load"] * self._block, self._io_s["load"],
                     self._io_blocks["background"] * self._block, self._io_blocks["failed"],
                     self.counters)
        self._sessions.close()

    @property
    def counters(self) -> dict[str, int]:
        """This instance's counters (``plugin/health.py``)."""
        return dict(self._health.counters)
