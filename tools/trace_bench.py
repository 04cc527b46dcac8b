"""``bench_hybrid_cache.py --trace-file``: a real trace (Mooncake's format, ``mooncake_trace.py``)
replayed through real daemons, every policy side by side in one run (issue 48).

Per geometry (``--geometry attention,hybrid``) and budget (``--budgets``, % of the working set in
bytes, pages and states; an unbounded run is added), one daemon per policy (``--policies``,
``--eviction NAME``) on an arena of the budget rounded up to whole slabs, L3 off, set-ahead and
evict-ahead off (``--set-ahead-bytes 0``: the arena's room is the budget). Each request goes to
every daemon in turn (the first daemon rotating), one client per daemon, as an engine would:

    exists   batch_exists_v2(its full prompt blocks; KV ALL_PAGES [+ MAMBA TRAILING_PAGES])
             -> L, the longest prefix the pools can restore
    get      batch_get_v2(KV pages 0..L-1 [+ the state of page L-1]) (L > 0)
    set      the full pages it computed, L..n-1, in calls of --set-batch KV pages, chained
             (parent, depth); the hybrid geometry's states (``hybrid_trace.states_to_set``: the
             last full page, a branch point passed) ride on the call holding their page

Requests arrive in the trace's order, paced at ``--speedup`` x the trace's own clock (request i
not before its timestamp / speedup; 0: no pacing), so the daemons' idle turns see the trace's
rhythm. The metric is the token hit rate over full prompt blocks (hit pages x 512 / full prompt
blocks x 512, no warm-up). Every ``--sample-every`` requests, each daemon's shared presence table
is read from outside and orphans counted with no grace: a KV page present while an earlier page
of its chain is not, a state whose KV prefix is not all present; as a share of resident pages
(KV pages + states). Beside each budget: ``hybrid_oracle``'s LRU, leaf-first LRU, admit and
Belady simulated on the same trace at the same bytes (the arena's).
"""

from __future__ import annotations

import math
import random
import shlex
import tempfile
import time

import mooncake_trace
from bench_hybrid_cache import Orphans, pct, policy_args, progress, start_daemon, stop
from hybrid_oracle import simulate
from hybrid_trace import Trace, states_to_set, summary

NS = "bench-trace|mooncake-512|bf16|tp0of1"
HEADROOM = 1.1  # the unbounded arena over the working set
ORACLES = ("lru", "leaf", "admit_store", "admit", "belady")
MAMBA_LAYERS = 4  # a state: 4 layers x (SSM [p, 4, 15] fp32 + conv [4, 2p] bf16) = 1 KiB x p


class Lane:
    """One daemon and the client replaying the trace into it: its hits, latencies, orphans."""

    def __init__(self, policy: str, endpoint: str, trace: Trace, state_pages: int,
                 set_batch: int):
        import torch

        from hicached import Client, HostPool, PoolName

        self.policy, self.trace, self.set_batch = policy, trace, set_batch
        self.client = Client(endpoint, NS, timeout_s=60.0)
        rows = mooncake_trace.POOL_PAGE_ROWS
        pages = max(len(r.ids) for r in trace.requests) or 1
        self.kv = HostPool.allocate_mha(pages, rows, mooncake_trace.POOL_LAYERS,
                                        mooncake_trace.POOL_KV_HEADS,
                                        mooncake_trace.POOL_HEAD_DIM)
        assert self.kv.page_bytes == trace.kv_page_bytes, self.kv.page_bytes
        self.kv.kv_buffer.normal_()
        self.client.register_mem_host_pool_v2(self.kv, PoolName.KV)
        self.mamba = None
        if trace.with_states:
            self.mamba = HostPool.allocate_mamba(4, MAMBA_LAYERS, (state_pages, 4, 15),
                                                 [(4, 2 * state_pages)])
            assert self.mamba.page_bytes == state_pages * trace.kv_page_bytes
            self.client.register_mem_host_pool_v2(self.mamba, PoolName.MAMBA)
        self.rows = torch.arange(pages * rows)
        self.lat: dict[str, list[float]] = {"exists": [], "get": [], "set": []}
        self.hit_pages = self.prompt_pages = self.get_misses = self.set_refused = 0
        self.orphan_share: list[float] = []
        self.resident: list[int] = []

    def request(self, req) -> None:
        """One request: exists, get of the hit, set of the pages computed."""
        import torch

        from hicached import PoolHitPolicy, PoolName, PoolTransfer

        KV, MAMBA = PoolName.KV, PoolName.MAMBA
        ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
        c, keys, p, rows = self.client, req.keys, req.prompt_pages, mooncake_trace.POOL_PAGE_ROWS
        n, hit = len(keys), 0
        if p:
            ts = [PoolTransfer(KV, keys=keys[:p], hit_policy=ALL)]
            if self.mamba is not None:
                ts.append(PoolTransfer(MAMBA, keys=keys[p - 1:p], hit_policy=TRAILING))
            t = time.perf_counter()
            hit = c.batch_exists_v2(keys[:p], ts).kv_hit_pages
            self.lat["exists"].append((time.perf_counter() - t) * 1e3)
        if hit:
            ts = [PoolTransfer(KV, self.rows[:hit * rows], keys=keys[:hit])]
            if self.mamba is not None:
                ts.append(PoolTransfer(MAMBA, torch.tensor([0]), keys=keys[hit - 1:hit],
                                       hit_policy=TRAILING))
            t = time.perf_counter()
            got = c.batch_get_v2(ts)
            self.lat["get"].append((time.perf_counter() - t) * 1e3)
            if not all(all(v) for v in got.values()):
                self.get_misses += 1  # (one client per daemon, in order: nothing between)
                hit = 0
        self.hit_pages += hit
        self.prompt_pages += p
        states = states_to_set(req, hit) if self.mamba is not None else []
        for lo in range(hit, n, self.set_batch):
            hi = min(n, lo + self.set_batch)
            ts = [PoolTransfer(KV, self.rows[lo * rows:hi * rows], keys=keys[lo:hi],
                               hit_policy=ALL)]
            mine = [b for b in states if lo < b <= hi]
            if mine:
                ts.append(PoolTransfer(MAMBA, torch.tensor([1 + j % 3 for j in range(len(mine))]),
                                       keys=[keys[b - 1] for b in mine], hit_policy=TRAILING))
            t = time.perf_counter()
            res = c.batch_set_v2(ts, parent=keys[lo - 1] if lo else None, depth=lo,
                                 anchor_pool=KV)
            self.lat["set"].append((time.perf_counter() - t) * 1e3)
            self.set_refused += sum(row.count(False) for row in res.values())

    def sample(self, orphans: Orphans, upto: int) -> None:
        """Orphans over resident pages now (nothing when the presence table is unusable)."""
        got = orphans.count(self.client, upto)
        if got is not None:
            orphan, resident = got
            self.resident.append(resident)
            self.orphan_share.append(orphan / resident if resident else 0.0)

    def result(self) -> dict:
        st = self.client.stats()
        self.client.close()
        return {
            "policy": self.policy, "hit_rate": self.hit_pages / max(1, self.prompt_pages),
            "hit_pages": self.hit_pages, "prompt_pages": self.prompt_pages,
            "get_misses": self.get_misses, "set_refused": self.set_refused,
            "eviction": st.get("eviction"), "evictions": st.get("evictions"),
            "l2_used_bytes": st.get("l2_used_bytes"),
            "orphans_max_share": max(self.orphan_share) if self.orphan_share else None,
            "orphans_mean_share": (sum(self.orphan_share) / len(self.orphan_share)
                                   if self.orphan_share else None),
            "orphan_samples": len(self.orphan_share),
            "resident_max": max(self.resident) if self.resident else None,
            **{k: {"count": len(v), "p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99)}
               for k, v in self.lat.items()},
        }


def arena_bytes(budget: float | None, working_set: int, slab_bytes: int) -> int:
    """A budget's arena (None: unbounded), whole slabs, at least 4."""
    want = working_set * (HEADROOM if budget is None else budget)
    return max(4, math.ceil(want / slab_bytes)) * slab_bytes


def presence_slots(l2_bytes: int, kv_page_bytes: int) -> int:
    """Presence-table slots for an arena of small pages: every page at a load under half."""
    return max(1 << 14, 1 << (2 * l2_bytes // kv_page_bytes).bit_length())


def replay_budget(trace: Trace, info: dict, budget: float | None, args, orphans: Orphans) -> dict:
    """Every policy's daemon at one budget, the requests interleaved; the runs and the
    oracles at the arena's bytes."""
    l2 = arena_bytes(budget, info["working_set_bytes"], args.slab_size)
    label = "unbounded" if budget is None else f"{budget:.0%}"
    progress(f"{trace.name} {info['geometry']} {label}: {l2 / 2**20:.1f} MiB arena, "
             f"{', '.join(args.policies)}")
    extra = ["--set-ahead-bytes", "0", "--evict-ahead", "0", "--presence-slots",
             str(presence_slots(l2, trace.kv_page_bytes)), *shlex.split(args.daemon_args)]
    started = time.monotonic()
    tmps, procs, lanes = [], [], []
    try:
        for policy in args.policies:
            tmp = tempfile.TemporaryDirectory(prefix="bench-trace-")
            tmps.append(tmp)
            proc, endpoint = start_daemon(tmp.name, l2, args.slab_size,
                                          policy_args(policy) + extra)
            procs.append(proc)
            lanes.append(Lane(policy, endpoint, trace, args.state_pages, args.set_batch))
        times = trace.times_ms
        rng = random.Random(0)
        lag_ms = 0.0
        t0 = time.monotonic()
        every = args.sample_every or max(1, len(trace.requests) // 40)
        seen = 0
        for i, req in enumerate(trace.requests):
            if args.speedup > 0:
                due = t0 + times[i] / 1e3 / args.speedup
                now = time.monotonic()
                if due > now:
                    time.sleep(due - now)
                else:
                    lag_ms = max(lag_ms, (now - due) * 1e3)
            seen = max(seen, max(req.ids, default=-1) + 1)
            first = rng.randrange(len(lanes))
            for lane in lanes[first:] + lanes[:first]:
                lane.request(req)
            if (i + 1) % every == 0 or i + 1 == len(trace.requests):
                for lane in lanes:
                    lane.sample(orphans, seen)
        runs = [lane.result() for lane in lanes]
    finally:
        for lane in lanes:
            lane.client.close()
        for proc in procs:
            stop(proc)
        for tmp in tmps:
            tmp.cleanup()
    for r in runs:
        name = r["policy"].partition(":")[0]
        if r["eviction"] is not None and r["eviction"] != name:
            raise SystemExit(f"asked for eviction {name!r}, the daemon runs {r['eviction']!r}")
    state_bytes = info["state_bytes"]
    bounds = {p: simulate(trace, l2, p, state_bytes, 0)["hit_rate"] for p in ORACLES}
    return {"budget": budget, "l2_bytes": l2, "seconds": time.monotonic() - started,
            "pacing_lag_max_ms": lag_ms, "runs": runs, "oracle": bounds}


def run(args) -> dict:
    """Every geometry and budget of ``args`` (see the module docstring)."""
    out = []
    for geometry in args.geometry:
        trace = mooncake_trace.load(args.trace_file, geometry, args.requests)
        state_bytes = args.state_pages * trace.kv_page_bytes if trace.with_states else 0
        info = summary(trace, 0, state_bytes)
        progress(f"{trace.name} ({geometry}): {len(trace.requests)} requests, working set "
                 f"{info['working_set_bytes'] / 2**20:.1f} MiB, ceiling "
                 f"{info['ceiling_hit_rate']:.4f}")
        orphans = Orphans(trace)
        budgets = [b / 100 for b in args.budgets] + [None]
        rows = [replay_budget(trace, info, b, args, orphans) for b in budgets]
        out.append({"trace": info, "budgets": rows})
    return {"trace_file": args.trace_file, "geometries": out}


def print_report(result: dict, args) -> None:
    """Per geometry, a table per budget: every policy's hit rate, its ratio to LRU's, the
    oracles at the same bytes, orphans and latency."""
    print(f"bench_hybrid_cache --trace-file {result['trace_file']}: pages of 512 tokens "
          f"({mooncake_trace.KV_PAGE_BYTES} B), states {args.state_pages} pages of bytes, "
          f"replayed at {args.speedup:g}x the trace's clock (0: unpaced), policies interleaved")
    for g in result["geometries"]:
        info = g["trace"]
        print(f"\n{info['trace']} ({info['geometry']}): {info['requests']} requests, "
              f"{info['stored_kv_pages']} KV pages + {info['stored_states']} states = "
              f"{info['working_set_bytes'] / 2**20:.1f} MiB working set; ceiling "
              f"{info['ceiling_hit_rate']:.4f}")
        print("budget     arena  policy        hit   x LRU  orphans max/mean  set p50/p99 ms"
              "  exists p99  get p99")
        for row in g["budgets"]:
            label = "unbounded" if row["budget"] is None else f"{row['budget']:.0%}"
            lru = next((r["hit_rate"] for r in row["runs"] if r["policy"] == "lru"), None)
            for r in row["runs"]:
                ratio = f"{r['hit_rate'] / lru:.3f}" if lru else "  n/a"
                om = r["orphans_max_share"]
                orph = ("n/a" if om is None
                        else f"{om:.2%}/{r['orphans_mean_share']:.2%}")
                print(f"{label:>9s} {row['l2_bytes'] / 2**20:7.1f}  {r['policy']:<10s} "
                      f"{r['hit_rate']:.4f}  {ratio:>6s}  {orph:>16s}  "
                      f"{r['set']['p50_ms']:5.2f}/{r['set']['p99_ms']:5.2f}  "
                      f"{r['exists']['p99_ms']:10.2f}  {r['get']['p99_ms']:7.2f}")
            o = row["oracle"]
            base = o["lru"]
            print(f"{'':>17s}  oracle (sim): " + ", ".join(
                f"{p} {v:.4f} ({v / base if base else 0:.2f}x)" for p, v in o.items()))
            if row["pacing_lag_max_ms"] > 1000:
                print(f"{'':>17s}  (the replay fell behind the pace by up to "
                      f"{row['pacing_lag_max_ms'] / 1e3:.1f} s)")
