"""A chaos run of the atomic multi-pool commit: no get may call a key's KV page a hit while the
INDEXER page set with it in the same call is missing (issue 45, item 8).

The shape of the run that once showed it (``--help`` has the knobs):

    phase 1  ``--procs`` load processes in 2 namespaces over the same key strings, on a small
             arena (``--l2-size`` of ``--slab-size`` slabs, no L3, lease and reservation TTL
             ``--ttl-s``): ``--chains`` chains of 8 keys, each call moving KV (64 KiB pages,
             read on the lease-free path once seen), INDEXER (8 KiB, all pages) and MAMBA (35
             KiB, trailing) pages; constant eviction. Every 1-3 s one process is SIGKILLed,
             alternately inside a set (between its reserve and its commit) and inside a get
             (holding a lease), and another is started in its place.
    flush    an L2 flush, waited for.
    phase 2  ``--check-procs`` processes on ``--check-chains`` chains that fit the arena (no
             eviction for room), writers SIGKILLed inside sets, for ``--check-s`` seconds:
             every get is checked. A key whose KV page is a hit and whose INDEXER page is not
             is a *torn* key; a hit page whose bytes are not its key's is a *wrong* page.

Each worker runs a load process's loop: pick a chain and a length T (1..8), get the chain's
first T keys (KV and INDEXER pages, the MAMBA state of key T-1), check what came back, and set
what was missing (KV and INDEXER from the first key that missed, MAMBA of key T-1, with the
chain's parent and depth). Page bytes are a function of (namespace, pool, key), so any page
can be checked wherever it came from.

    python tools/chaos_atomic.py --seconds 300 --check-s 40        # the issue's run
    python tools/chaos_atomic.py --seconds 20 --check-s 10          # a short one

Prints one JSON object (counts per phase: gets, keys checked, torn keys, wrong pages, the
daemon's evictions during the checked phase, and the first torn keys of that phase with what
the worker knew of them: whether it read the KV page with no lease, and what L2 held of the
key right after); exit status 1 when a torn key was found in the checked phase, a wrong page
anywhere, a worker died other than by SIGKILL, or the daemon exited. ``--stateless`` stores a
share of the calls without their state: the state-less leaves the hybrid eviction drops after
a grace, also in the checked phase. Torn keys of the first phase are counted, not failed: under
eviction a set may store a key's KV page and get no room for its INDEXER page (the set says
so). ``tests/ops/test_tools.py`` runs a few seconds of it.

Measured on the 2-vCPU VM (shared with other work, so the calls per second varied 10x), before
the fixes of issue 45 item 8 and after. Before: 38 torn keys in 70,924 gets of the first phase
(7 runs of 20-300 s), every one a KV page read with no lease whose key L2 no longer held at all
right after (evicted whole between the unleased read and the INDEXER lease); 0 in 85,000 gets
of checked phases (the tails evicted there, up to 170 pages a run, never met a reader). After: 0
in 29,099 gets of the first phase and 0 in 32,398 of checked phases (3 runs); no wrong page in
any run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHAIN = 8  # keys per chain
KV_TOKENS = 16  # tokens per page: KV 16 x 4 layers x 256 x 4 B = 64 KiB (tagged: lease-free)
NAMESPACES = ("chaos-a", "chaos-b")
STATS = ("ops", "gets", "sets", "keys", "torn", "wrong", "torn_lease_free")
CTL_NONE, CTL_KILL_IN_SET, CTL_KILL_IN_GET = 0, 1, 2


# ---------------------------------------------------------------- the worker (a load process)

def _pattern(ns: str, pool: str, key: str, part: int, n: int):
    """The bytes of (ns, pool, key)'s page part ``part`` (n bytes)."""
    import numpy as np
    import xxhash

    h = xxhash.xxh3_64_intdigest(f"{ns}/{pool}/{key}/{part}".encode())
    base = _pattern.base
    return np.roll(base[:n], h % n) + np.uint8((h >> 32) & 0xFF)


class Worker:
    """One load process: its client, host pools (pages 0..7 are written from, 8..15 read
    into; Mamba slot 0 written from, 1 read into) and its counters (a file the parent reads:
    ``STATS`` as u64, rewritten after every call, so a SIGKILL loses at most one call's)."""

    def __init__(self, args):
        import numpy as np
        import torch

        from hicached import Client, HostPool

        _pattern.base = np.random.default_rng(45).integers(0, 256, 1 << 16, dtype=np.uint8)
        self.args = args
        self.ns = args.namespace
        self.rng = random.Random(args.seed)
        self.c = Client(args.endpoint, self.ns, timeout_s=10.0)
        self.kv = HostPool.allocate_mla(2 * CHAIN, KV_TOKENS, layers=4, kv_dim=256,
                                        dtype=torch.float32)
        self.ix = HostPool.allocate_indexer(2 * CHAIN, KV_TOKENS, layers=4, page_elems=2048)
        self.mb = HostPool.allocate_mamba(2, 2, (8, 512), [(3, 256)])  # 32 + 3 KiB
        self.c.register_mem_host_pool_v2(self.kv, "kv")
        self.c.register_mem_host_pool_v2(self.ix, "indexer")
        self.c.register_mem_host_pool_v2(self.mb, "mamba")
        self.kv_pages = self.kv.kv_buffer.view(torch.uint8).reshape(2 * CHAIN, -1).numpy()
        self.ix_pages = self.ix.buffers[0].view(torch.uint8).reshape(2 * CHAIN, -1).numpy()
        self.mb_parts = [[b[s].view(torch.uint8).reshape(-1).numpy() for b in self.mb.buffers]
                         for s in range(2)]
        assert self.kv_pages.shape[1] == 64 << 10 and self.ix_pages.shape[1] == 8 << 10
        self.stats = dict.fromkeys(STATS, 0)
        self.stats_fd = os.open(args.stats, os.O_RDWR | os.O_CREAT, 0o600)
        self.ctl_fd = os.open(args.ctl, os.O_RDONLY)
        self.log = open(args.log, "a")
        self._save()  # (the file says this worker is ready: the parent picks whom to kill)

    def _save(self) -> None:
        os.pwrite(self.stats_fd, b"".join(self.stats[s].to_bytes(8, "little")
                                          for s in STATS), 0)

    # -------------------------------------------------------- faults

    def _armed(self, pool: str, direction: str):
        """Make the next copy of ``pool`` in ``direction`` die by SIGKILL (after copying, half
        the time): a set dies between its reserve and its commit, a get holding a lease."""
        io = self.c.pool_io(pool)
        real = getattr(io, direction)

        def die(*a, **k):
            if self.rng.random() < 0.5:
                real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        setattr(io, direction, die)

    def _ctl(self) -> int:
        return os.pread(self.ctl_fd, 1, 0)[0]

    # -------------------------------------------------------- one call of the load

    def run(self) -> None:
        from hicached import PoolTransfer
        from hicached.types import PoolHitPolicy

        args, rng = self.args, self.rng
        trailing = PoolHitPolicy.TRAILING_PAGES
        while True:
            chain = rng.randrange(args.chains)
            n = rng.randint(1, CHAIN)
            keys = [f"c{chain}-{i}" for i in range(n)]
            ctl = self._ctl()
            if ctl == CTL_KILL_IN_GET:
                self._armed(rng.choice(("kv", "indexer", "mamba")), "from_arena")
            known = {k for k in keys if self.c._recall.seen("kv", k) is not None}
            self.kv_pages[CHAIN:CHAIN + n] = 0
            self.ix_pages[CHAIN:CHAIN + n] = 0
            for part in self.mb_parts[1]:
                part[:] = 0
            got = self.c.batch_get_v2([
                PoolTransfer("kv", _tokens(CHAIN, n), keys=keys),
                PoolTransfer("indexer", _tokens(CHAIN, n), keys=keys),
                PoolTransfer("mamba", [1], keys=keys[-1:], hit_policy=trailing)])
            self.stats["gets"] += 1
            self._check(keys, got, known)
            hit = 0
            while hit < n and got["kv"][hit] and got["indexer"][hit]:
                hit += 1
            if hit < n or not got["mamba"][0]:
                if self._ctl() == CTL_KILL_IN_SET:
                    self._armed(rng.choice(("kv", "indexer", "mamba")), "to_arena")
                self._set(keys, hit, state=rng.random() >= args.stateless)
            self.stats["ops"] += 1
            self._save()

    def _set(self, keys: list[str], start: int, state: bool = True) -> None:
        from hicached import PoolTransfer
        from hicached.types import PoolHitPolicy

        n = len(keys)
        for i in range(start, n):
            self.kv_pages[i] = _pattern(self.ns, "kv", keys[i], 0, self.kv_pages.shape[1])
            self.ix_pages[i] = _pattern(self.ns, "indexer", keys[i], 0, self.ix_pages.shape[1])
        for j, part in enumerate(self.mb_parts[0]):
            part[:] = _pattern(self.ns, "mamba", keys[-1], j, part.size)
        transfers = [PoolTransfer("kv", _tokens(start, n - start), keys=keys[start:]),
                     PoolTransfer("indexer", _tokens(start, n - start), keys=keys[start:])]
        if state:
            transfers.append(PoolTransfer("mamba", [0], keys=keys[-1:],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES))
        self.c.batch_set_v2(transfers, parent=keys[start - 1] if start else None, depth=start)
        self.stats["sets"] += 1

    def _check(self, keys: list[str], got: dict[str, list[bool]], known: set[str]) -> None:
        """Count the keys of a get, its torn keys (KV hit, INDEXER miss) and its hit pages
        whose bytes are not their key's (those are logged, each with what it was)."""
        ns = self.ns
        for i, key in enumerate(keys):
            self.stats["keys"] += 1
            if got["kv"][i] and not (self.kv_pages[CHAIN + i] == _pattern(
                    ns, "kv", key, 0, self.kv_pages.shape[1])).all():
                self._note("wrong", key, pool="kv", lease_free=key in known)
            if got["indexer"][i] and not (self.ix_pages[CHAIN + i] == _pattern(
                    ns, "indexer", key, 0, self.ix_pages.shape[1])).all():
                self._note("wrong", key, pool="indexer")
            if got["kv"][i] and not got["indexer"][i]:
                self._note("torn", key, lease_free=key in known, position=i, keys=len(keys),
                           now=self._now(key))
                if key in known:
                    self.stats["torn_lease_free"] += 1
        if got["mamba"][0] and not all(
                (part == _pattern(ns, "mamba", keys[-1], j, part.size)).all()
                for j, part in enumerate(self.mb_parts[1])):
            self._note("wrong", keys[-1], pool="mamba")

    def _now(self, key: str) -> dict[str, int]:
        """The pages of ``key`` L2 holds now, per pool (a torn key that stays torn is the
        daemon's state, one that does not was torn between the lease-free read and the
        lease, or for a moment)."""
        from hicached import PoolTransfer

        res = self.c.batch_exists_v2([key], [PoolTransfer("indexer", keys=[key])])
        return dict(res.extra_pool_hit_pages)

    def _note(self, what: str, key: str, **detail) -> None:
        self.stats[what] += 1
        self.log.write(json.dumps({"what": what, "ns": self.ns, "key": key,
                                   "t": time.time(), **detail}) + "\n")
        self.log.flush()


def _tokens(first_page: int, n: int):
    import torch

    return torch.arange(first_page * KV_TOKENS, (first_page + n) * KV_TOKENS)


# ---------------------------------------------------------------- the parent

class Run:
    """The daemon, the workers and their files, in ``tmp``."""

    def __init__(self, args, tmp: Path):
        self.args, self.tmp = args, tmp
        self.endpoint = f"ipc://{tmp}/d.sock"
        self.workers: list[tuple[subprocess.Popen, int, Path, Path]] = []  # proc, ctl fd, ...
        self.spawned = 0
        self.crashes = 0  # workers that exited other than by SIGKILL (see workers.out)
        self.files: list[Path] = []  # every worker's stats file, per phase
        self.daemon = None
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[1]),
                        os.environ.get("PYTHONPATH")) if p)}

    def start_daemon(self) -> None:
        a = self.args
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "hicached", "serve", "--endpoint", self.endpoint,
             "--l2-size", a.l2_size, "--slab-size", a.slab_size, "--state-dir",
             str(self.tmp / "state"), "--l3-backend", "none", "--reservation-ttl-s",
             str(a.ttl_s), "--lease-ttl-s", str(a.ttl_s), "--log-level", "WARNING"],
            stdout=open(self.tmp / "daemon.log", "ab"), stderr=subprocess.STDOUT, env=self.env)
        from hicached import Client
        from hicached.errors import DaemonUnavailable

        deadline = time.monotonic() + 60
        while True:
            if self.daemon.poll() is not None:
                raise SystemExit(f"daemon exited: {(self.tmp / 'daemon.log').read_text()}")
            try:
                with Client(self.endpoint, "probe", timeout_s=1.0) as c:
                    c.ping()
                return
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def spawn(self, phase: str, chains: int, slot: int | None = None) -> None:
        """Start a worker (in place ``slot`` of ``workers``, or a new one)."""
        self.spawned += 1
        n = self.spawned
        stats, ctl = self.tmp / f"{phase}-{n}.stats", self.tmp / f"ctl-{n}"
        ctl.write_bytes(b"\0")
        self.files.append(stats)
        ns = NAMESPACES[n % len(NAMESPACES)] if slot is None else NAMESPACES[slot % 2]
        proc = subprocess.Popen(
            [sys.executable, __file__, "worker", "--endpoint", self.endpoint, "--namespace", ns,
             "--chains", str(chains), "--seed", str(self.args.seed * 1000 + n),
             "--stateless", str(self.args.stateless), "--stats",
             str(stats), "--ctl", str(ctl), "--log", str(self.tmp / f"{phase}.log")],
            env=self.env, stdout=open(self.tmp / "workers.out", "ab"), stderr=subprocess.STDOUT)
        entry = (proc, os.open(ctl, os.O_WRONLY), stats, ctl)
        if slot is None:
            self.workers.append(entry)
        else:
            self.workers[slot] = entry

    def kill_one(self, rng: random.Random, mode: int, phase: str, chains: int) -> None:
        """Have one worker die by SIGKILL inside its next set or get (SIGKILL it from here
        after 2 s if it has not), then start another in its place."""
        ready = [i for i, (_, _, stats, _) in enumerate(self.workers) if stats.exists()]
        if not ready:
            return
        slot = rng.choice(ready)
        proc, fd, _, _ = self.workers[slot]
        os.pwrite(fd, bytes([mode]), 0)
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.crashes += proc.returncode != -signal.SIGKILL
        os.close(fd)
        self.spawn(phase, chains, slot)

    def kill_all(self) -> None:
        for proc, fd, _, _ in self.workers:
            proc.kill()
            proc.wait()
            os.close(fd)
        self.workers = []

    def flush(self) -> None:
        from hicached import Client

        with Client(self.endpoint, "probe", timeout_s=60.0) as c:
            c.flush("l2")

    def daemon_stats(self) -> dict:
        """The daemon's pages in L2 and evictions so far."""
        from hicached import Client

        with Client(self.endpoint, "probe", timeout_s=60.0) as c:
            st = c.stats()
        return {"l2_pages": sum(st["l2_pages_by_pool"].values()),
                "evictions": st["evictions"], "evictions_ahead": st.get("evictions_ahead", 0)}

    def totals(self, phase: str) -> dict:
        out = dict.fromkeys(STATS, 0)
        for f in self.files:
            if f.name.startswith(phase + "-") and f.exists():
                raw = f.read_bytes()
                for i, s in enumerate(STATS):
                    out[s] += int.from_bytes(raw[8 * i:8 * i + 8], "little") if raw else 0
        return out

    def notes(self, phase: str, limit: int = 10) -> list[dict]:
        path = self.tmp / f"{phase}.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()[:limit]]

    def phase(self, name: str, procs: int, chains: int, seconds: float, modes: tuple[int, ...],
              rng: random.Random) -> None:
        for _ in range(procs):
            self.spawn(name, chains)
        deadline = time.monotonic() + 120  # (a loaded machine takes seconds to import torch)
        while (not all(stats.exists() for _, _, stats, _ in self.workers)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        end = time.monotonic() + seconds  # of load: from when every process is ready
        turn = 0
        while True:
            wait = rng.uniform(1.0, 3.0)
            if time.monotonic() + wait >= end:
                break
            time.sleep(wait)
            for i, (proc, _, _, _) in enumerate(self.workers):
                if proc.poll() is not None:  # died on its own: a bug, logged in workers.out
                    self.crashes += 1
                    self.spawn(name, chains, i)
            self.kill_one(rng, modes[turn % len(modes)], name, chains)
            turn += 1
        time.sleep(max(0.0, end - time.monotonic()))
        self.kill_all()

    def close(self) -> None:
        self.kill_all()
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(20)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="one load process (started by the run)")
    for flag in ("--endpoint", "--namespace", "--stats", "--ctl", "--log"):
        w.add_argument(flag, required=True)
    w.add_argument("--chains", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--stateless", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=300.0, help="phase 1 (default: 300)")
    ap.add_argument("--procs", type=int, default=5, help="phase 1 processes (default: 5)")
    ap.add_argument("--chains", type=int, default=250, help="phase 1 chains (default: 250)")
    ap.add_argument("--check-s", type=float, default=40.0, help="phase 2 (default: 40)")
    ap.add_argument("--check-procs", type=int, default=3, help="phase 2 processes (default: 3)")
    ap.add_argument("--check-chains", type=int, default=12,
                    help="phase 2 chains, which must fit the arena (default: 12)")
    ap.add_argument("--l2-size", default="96MiB")
    ap.add_argument("--slab-size", default="4MiB")
    ap.add_argument("--ttl-s", type=float, default=5.0, help="lease and reservation TTL")
    ap.add_argument("--stateless", type=float, default=0.0,
                    help="share of sets stored without their MAMBA state (state-less leaves, "
                    "which the hybrid eviction drops after a grace, pressure or not)")
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (logs)")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        Worker(args).run()
        return 0
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="hicached-chaos-"))
    run = Run(args, tmp)
    try:
        run.start_daemon()
        t0 = time.monotonic()
        if args.seconds > 0:
            run.phase("churn", args.procs, args.chains, args.seconds,
                      (CTL_KILL_IN_SET, CTL_KILL_IN_GET), rng)
        t1 = time.monotonic()
        run.flush()
        t2 = time.monotonic()
        flushed = run.daemon_stats()  # (pages a lease still pinned stay)
        run.phase("check", args.check_procs, args.check_chains, args.check_s,
                  (CTL_KILL_IN_SET,), rng)
        end = run.daemon_stats()
        out = {"churn": {**run.totals("churn"), "seconds": round(t1 - t0, 1)},
               "flush_s": round(t2 - t1, 2), "after_flush": flushed,
               "check": {**run.totals("check"), "seconds": round(time.monotonic() - t2, 1),
                         "evictions": end["evictions"] - flushed["evictions"],
                         "evictions_ahead": end["evictions_ahead"]
                         - flushed["evictions_ahead"]},
               "processes": run.spawned, "crashes": run.crashes, "check_notes": run.notes("check"),
               "folder": str(tmp)}
        if run.daemon.poll() is not None:
            out["daemon_exit"] = run.daemon.returncode
    finally:
        run.close()
    print(json.dumps(out, indent=1))
    bad = (out["check"]["torn"] or out["check"]["wrong"] or out["churn"]["wrong"]
           or out["crashes"] or "daemon_exit" in out)
    if not args.keep and not bad:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
