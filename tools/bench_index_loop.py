"""The control loop's cost per call, in process (issue 24): the controller's set and get paths over
a page index of a million pages, without sockets, clients or an arena.

``tools/bench_index.py`` measures the daemon end to end, where the loop's per-page cost hides
behind the clients, the socket and two busy cores; this drives ``Controller.reserve`` /
``commit`` / ``lease`` and ``LeaseTable.release`` directly, as ``server.py`` does for each
message, over the daemon's own objects (``SlabAllocator`` sized as bench_index's arena: 1.05 x
the pages, ``PageIndex`` with the chosen eviction policy, a shared ``PresenceTable`` in a temp
file, ``LeaseTable``, an ``L3Tier`` without a backend), 4 KiB pages, 64-hex keys:

  fill          sets of --set-batch (128) new pages until --pages (1M) are indexed: pages/s
  set @N        --calls more such sets within the arena's headroom: us a call and a page
  set evicting  --calls sets past the headroom (each evicts as many pages): us a call, a page
  get           --calls leases of --get-batch (64) stored pages drawn at random, each released
  small set     --calls sets of 16 pages, and gets of 16 pages (the mixed load's calls)

Times are the measuring thread's CPU time (``time.thread_time``): what the loop spends, which
other processes on a shared machine do not inflate (the wall time per call is printed beside).
One policy after the other (``--policies lru,hybrid``), each on a fresh index; the same seed
draws the same keys. Compare trees by running it with another ``PYTHONPATH`` (a tree from before
the eviction policies runs ``lru`` only; give both the same ``--presence-slots``: default sizings
differ between trees, and a full table stops publishing):

    python tools/bench_index_loop.py [--pages 1000000] [--policies lru,hybrid] [--json]
    PYTHONPATH=/path/to/old/tree python tools/bench_index_loop.py ...
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import sys
import tempfile
import time

from hicached import protocol as P
from hicached.daemon.controller import Controller
from hicached.daemon.index import PageIndex
from hicached.daemon.l3.tier import L3Tier
from hicached.daemon.l3.workers import IOWorkers
from hicached.daemon.leases import LeaseTable
from hicached.daemon.sessions import Session
from hicached.daemon.slabs import SlabAllocator
from hicached.presence import PresenceTable, default_slots

from hicached.daemon.eviction.registry import make_policy

PAGE_BYTES = 4096
SLAB_BYTES = 64 << 20
HEADROOM = 1.05
SMALL = 16


def key(tag: str, i: int) -> str:
    """A 64-hex key (as SGLang's page hashes and ``bench_index.py``'s)."""
    return hashlib.blake2b(f"{tag}{i}".encode(), digest_size=32).hexdigest()


class Loop:
    """The daemon's objects for one run, and the calls ``server.py`` makes per message."""

    def __init__(self, pages: int, policy: str, tmp: str, presence_slots: int = 0):
        slabs = -(-int(pages * PAGE_BYTES * HEADROOM) // SLAB_BYTES)
        self.alloc = SlabAllocator(slabs * SLAB_BYTES, SLAB_BYTES)
        self.presence = PresenceTable(os.path.join(tmp, f"presence-{policy}"),
                                      presence_slots or default_slots(slabs * SLAB_BYTES), 1)
        self.index = PageIndex(self.alloc, policy=make_policy(policy), presence=self.presence)
        self.leases = LeaseTable(self.index, 60.0, 60.0)
        self.workers = IOWorkers()
        self.tier = L3Tier(self.index, self.workers)
        self.ctl = Controller(self.index, self.leases, self.tier, time.monotonic)
        self.s = Session(1, "bench", "ns-bench", os.getpid(), "bench")
        self.ctl.sessions[1] = self.s
        self.ctl.register_pool(self.s, "kv", PAGE_BYTES)
        self.req = 0

    def set(self, keys: list[str]) -> int:
        """Reserve and commit ``keys``; the pages stored."""
        self.req += 1
        r = self.ctl.sets.reserve(self.s, P.Reserve(self.req, 1, [P.PoolKeys("kv", keys)]))
        ok = [[off >= 0 for off in row] for row in r.offsets]
        self.ctl.sets.commit(self.s, P.Commit(self.req, 1, r.reservation_id, ok, seq=self.req))
        return sum(map(sum, ok))

    def get(self, keys: list[str]) -> int:
        """Lease ``keys`` and release the lease; the pages leased."""
        self.req += 1
        got = self.ctl.lease(self.s, P.Lease(self.req, 1, [P.PoolKeys("kv", keys)]), None)
        if got.lease_id:
            self.leases.release(got.lease_id, 1)
        return sum(off >= 0 for row in got.offsets for off in row)

    def close(self) -> None:
        self.workers.close()
        self.presence.close()


def timed(calls: list, fn) -> dict:
    """Run ``fn`` on each of ``calls``: the loop's CPU time per call (this thread's: what the
    daemon's loop spends, whoever else runs on the machine), mean, p50 and p99, and per page;
    and the wall time per call."""
    cpu, pages = [], 0
    clock = time.thread_time
    w0 = time.perf_counter()
    for arg in calls:
        t = clock()
        pages += fn(arg)
        cpu.append(clock() - t)
    wall = time.perf_counter() - w0
    total = sum(cpu)
    cpu.sort()
    return {"calls": len(calls), "pages": pages, "us_per_call": 1e6 * total / len(calls),
            "p50_us": 1e6 * cpu[len(cpu) // 2], "p99_us": 1e6 * cpu[int(len(cpu) * 0.99)],
            "us_per_page": 1e6 * total / max(pages, 1), "wall_us_per_call": 1e6 * wall / len(calls)}


def run(policy: str, args: argparse.Namespace, tmp: str) -> dict:
    rng = random.Random(args.seed)
    loop = Loop(args.pages, policy, tmp, args.presence_slots)
    b = args.set_batch
    fill = [[key("s", i + j) for j in range(min(b, args.pages - i))]
            for i in range(0, args.pages, b)]
    gc.collect()
    gc.freeze()  # as the daemon does after start-up
    out = {"policy": policy, "pages": args.pages}
    t0 = time.thread_time()
    stored = sum(map(loop.set, fill))
    out["fill_pages_per_s"] = stored / (time.thread_time() - t0)  # per second of CPU
    assert stored == args.pages == len(loop.index), (stored, len(loop.index))
    free = (loop.alloc.capacity_bytes // PAGE_BYTES) - args.pages
    calls = min(args.calls, free // b)
    w = iter(range(1 << 40))
    new = [[key("w", next(w)) for _ in range(b)] for _ in range(calls)]
    out["set"] = timed(new, loop.set)
    rest = free - calls * b
    for _ in range(rest // b):  # fill the headroom, untimed
        loop.set([key("w", next(w)) for _ in range(b)])
    new = [[key("w", next(w)) for _ in range(b)] for _ in range(args.calls)]
    out["set_evicting"] = timed(new, loop.set)
    out["evictions"] = loop.index.evictions
    newest = args.pages // 2  # stored keys from the newer half of the fill
    draw = [[key("s", rng.randrange(newest, args.pages)) for _ in range(args.get_batch)]
            for _ in range(args.calls)]
    out["get"] = timed(draw, loop.get)
    new = [[key("w", next(w)) for _ in range(SMALL)] for _ in range(args.calls)]
    out["small_set"] = timed(new, loop.set)
    draw = [[key("s", rng.randrange(newest, args.pages)) for _ in range(SMALL)]
            for _ in range(args.calls)]
    out["small_get"] = timed(draw, loop.get)
    loop.close()
    gc.unfreeze()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--policies", default="lru,hybrid")
    ap.add_argument("--set-batch", type=int, default=128)
    ap.add_argument("--get-batch", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--presence-slots", type=int, default=0,
                    help="the presence table's slots (0: the tree's default sizing)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    gc.set_threshold(20_000, 20, 20)  # the daemon's
    with tempfile.TemporaryDirectory(prefix="hicached-bench-loop-", dir="/dev/shm"
                                     if os.path.isdir("/dev/shm") else None) as tmp:
        results = [run(p, args, tmp) for p in args.policies.split(",")]
    if args.json:
        json.dump({"results": results}, sys.stdout)
        return
    import hicached
    print(f"tree {os.path.dirname(os.path.dirname(hicached.__file__))}, {args.pages} pages")
    for r in results:
        print(f"[{r['policy']}] fill {r['fill_pages_per_s'] / 1e3:.1f}k pages/s (of CPU), "
              f"evictions {r['evictions']}")
        for name in ("set", "set_evicting", "get", "small_set", "small_get"):
            m = r[name]
            print(f"  {name:13s} {m['us_per_call']:8.0f} us/call  p50 {m['p50_us']:7.0f}  "
                  f"p99 {m['p99_us']:7.0f}  {m['us_per_page']:6.2f} us/page  "
                  f"(wall {m['wall_us_per_call']:.0f} us/call)")


if __name__ == "__main__":
    main()
