"""Reference-engine benchmark: TTFT of a prompt whose prefix is cached in each tier vs recompute.

One run, one daemon (started here), one Qwen3-Next model (attention KV + gated-delta-net states):

    recompute   radix cache off, no storage: the whole prompt is computed
    L1          the engine that computed the base prompt serves the prefix from its device cache
    L2          a fresh engine (empty device) loads the prefix from the daemon's arena
    L3          the daemon's L2 flushed before each request: the prefix comes from its L3 (file)

Each request shares ``--hit`` of its ``--prompt-tokens`` with a base prompt computed once (the
cached prefix ends at the deepest kept state, so the hit rate printed is what was really served);
TTFT is the median over ``--repeats`` requests with different tails; "load ms" is the part spent
at arrival bringing the prefix from the tier onto the device. Target: L2 hit TTFT <= 0.2 x
recompute at 4k-token prompts.

    python tools/bench_engine.py --prompt-tokens 4096 --hit 0.9

``--pressure`` (issue 25) runs instead the same model under memory pressure, once per eviction
policy (``pressure``): what each policy leaves of a base prompt after unrelated ones, and the
TTFT it gives.

    python tools/bench_engine.py --pressure --prompt-tokens 1024 --noise 3

``--warm-restart`` (issue 49) runs instead: a daemon without L3 (``--on-stop keep``) holds the
base prompt; TTFT of fresh engines asking prompts sharing ``--hit`` of it before the daemon's
restart, right after a warm restart (SIGTERM, then after a SIGKILL: a crash), and after a cold
restart (``--cold``, no L3: the prefix is recomputed), against recompute.

    python tools/bench_engine.py --warm-restart --prompt-tokens 4096 --hit 0.9
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from hicached.client.api import Client
from hicached.engine.config import EngineConfig
from hicached.engine.demo import DaemonLauncher, settle_l3
from hicached.engine.engine import Engine
from hicached.engine.models import load_model
from hicached.settings import parse_size


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--hit", type=float, default=0.9, help="shared prefix fraction")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--track-interval", type=int, default=64)
    p.add_argument("--prefill-chunk-pages", type=int, default=1,
                   help="pages per prefill forward (1: the engine's page-chunked default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--target", type=float, default=0.2, help="L2 TTFT / recompute goal")
    p.add_argument("--pressure", action="store_true",
                   help="instead: the run under memory pressure, once per eviction policy "
                   "(an L2 that holds the base prompt and half the noise, no L3)")
    p.add_argument("--pressure-slab", type=int, default=64 << 10,
                   help="--pressure: the daemon's slab size (small: the L2 is a few MiB; a state must fit)")
    p.add_argument("--noise", type=int, default=3,
                   help="--pressure: unrelated prompts computed after the base prompt")
    p.add_argument("--policies", default="lru,prefix,hybrid",
                   help="--pressure: the daemon's --eviction for each run")
    p.add_argument("--unbounded-l2", default="2GiB",
                   help="--pressure: the L2 of the run without pressure (--warm-restart: of "
                        "the daemon), which must hold every "
                        "prompt (the daemon and each engine map it pre-faulted: a tiny run "
                        "takes seconds less with a few MiB)")
    p.add_argument("--warm-restart", action="store_true",
                   help="instead: TTFT before and right after a warm restart, and after a "
                   "cold one (no L3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (tiny models gain nothing from more, and on a "
                        "shared machine spinning OpenMP threads make timings erratic)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.pressure:
        return pressure(args)
    if args.warm_restart:
        return warm_restart(args)
    n, ps = args.prompt_tokens, args.page_size
    unbounded = parse_size(args.unbounded_l2, "--unbounded-l2")  # (a ConfigError before work)
    shared = int(n * args.hit)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (n,), generator=g).tolist()

    def prompts() -> list[list[int]]:
        """``repeats`` prompts sharing ``shared`` tokens with ``base``; fresh tails per tier,
        so no tier finds a prompt an earlier tier stored."""
        return [base[:shared] + torch.randint(0, 256, (n - shared,), generator=g).tolist()
                for _ in range(args.repeats)]

    pages = 4 * (n // ps + 2) * (args.repeats + 2)
    daemon = DaemonLauncher(l2_size="2GiB", slab_size="16MiB")
    try:
        lm = load_model("qwen3_next", device=args.device, hidden_size=args.hidden,
                        num_hidden_layers=args.layers)
        lm.warmup(ps)

        def config(**kw) -> EngineConfig:
            kw = {"page_size": ps, "kv_pages": pages, "state_slots": 256,
                  "track_interval": args.track_interval,
                  "prefill_chunk_pages": args.prefill_chunk_pages, "device": args.device,
                  "storage_backend": "hicached", "hicached_endpoint": daemon.endpoint, **kw}
            return EngineConfig(**kw)

        results: dict[str, list] = {}

        def measure(tier: str, engine_for, before=None) -> None:
            runs = []
            for p in prompts():
                if before is not None:
                    before()
                eng = engine_for()
                t0 = time.perf_counter()
                req = eng.add_request(p, 1)  # arrival: the load-back from hicached
                load_s = time.perf_counter() - t0
                while not req.done:
                    eng.step()
                runs.append((req.ttft_s, req.cached_tokens, req.hit_sources(), load_s))
                if eng is not warm:
                    eng.close()
            results[tier] = runs

        cold = Engine(lm, config(disable_radix_cache=True, storage_backend="none"))
        warm = cold
        measure("recompute", lambda: cold)
        warm = Engine(lm, config())  # computes the base prompt, writes it through
        warm.generate(base, 1)
        measure("L1", lambda: warm)
        measure("L2", lambda: Engine(lm, config()))
        with Client(daemon.endpoint, "admin") as admin:
            settle_l3(admin)
            measure("L3", lambda: Engine(lm, config()), before=lambda: admin.flush("l2"))
        warm.close()
    finally:
        daemon.close()

    ref = statistics.median(r[0] for r in results["recompute"])
    print(f"qwen3_next hidden {args.hidden}, {args.layers} layers, {n}-token prompts, "
          f"{args.hit:.0%} shared, page {ps}, track {args.track_interval}, "
          f"chunk {args.prefill_chunk_pages} pages, {args.device}, median of {args.repeats}")
    print(f"{'tier':<10} {'hit rate':>8} {'from tier':>9} {'ttft ms':>9} {'load ms':>8} "
          f"{'vs recompute':>13}")
    for tier, runs in results.items():
        ttft = statistics.median(r[0] for r in runs)
        hit = statistics.median(r[1] for r in runs) / n
        key = tier.lower() if tier in ("L1", "L2", "L3") else None
        own = statistics.median(r[2][key] for r in runs) / n if key else 0.0
        load = statistics.median(r[3] for r in runs)
        print(f"{tier:<10} {hit:>8.1%} {own:>9.1%} {ttft * 1e3:>9.1f} {load * 1e3:>8.1f} "
              f"{ttft / ref:>12.3f}x")
    l2 = statistics.median(r[0] for r in results["L2"]) / ref
    verdict = "met" if l2 <= args.target else "NOT met"
    print(f"target L2 TTFT <= {args.target} x recompute: {l2:.3f} ({verdict})")
    return 0


def warm_restart(args: argparse.Namespace) -> int:
    """The run around a daemon restart (issue 49; module docstring): TTFT of fresh engines
    (empty device: the prefix comes from L2 or is computed) at each stage, median of
    ``--repeats`` prompts with fresh tails."""
    import signal

    n, ps = args.prompt_tokens, args.page_size
    shared = int(n * args.hit)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (n,), generator=g).tolist()
    pages = 4 * (n // ps + 2) * 2
    lm = load_model("qwen3_next", device=args.device, hidden_size=args.hidden,
                    num_hidden_layers=args.layers)
    lm.warmup(ps)
    daemon = DaemonLauncher(l2_size=args.unbounded_l2, slab_size="16MiB",
                            extra=["--l3-backend", "none", "--on-stop", "keep"])
    rows = []
    try:
        def engine(**kw) -> Engine:
            return Engine(lm, EngineConfig(**{
                "page_size": ps, "kv_pages": pages, "state_slots": 256,
                "track_interval": args.track_interval,
                "prefill_chunk_pages": args.prefill_chunk_pages, "device": args.device,
                "storage_backend": "hicached", "hicached_endpoint": daemon.endpoint, **kw}))

        def measure(stage: str, ready_s: float | None = None, flush: bool = False,
                    **kw) -> None:
            runs = []
            for _ in range(args.repeats):
                p = base[:shared] + torch.randint(0, 256, (n - shared,), generator=g).tolist()
                if flush:  # each ask as the first after the restart (the one before stored
                    with Client(daemon.endpoint, "admin") as admin:  # the prefix again)
                        admin.flush("l2")
                eng = engine(**kw)
                req = eng.add_request(p, 1)
                while not req.done:
                    eng.step()
                runs.append((req.ttft_s, req.cached_tokens))
                eng.close()
            rows.append((stage, statistics.median(r[0] for r in runs),
                         statistics.median(r[1] for r in runs) / n, ready_s))

        measure("recompute", disable_radix_cache=True, storage_backend="none")
        eng = engine()  # computes the base prompt, writes it to the daemon
        eng.generate(base, 1)
        eng.close()
        measure("before the restart")
        measure("after a warm restart (SIGTERM)", daemon.restart(signal.SIGTERM))
        measure("after a crash (SIGKILL)", daemon.restart(signal.SIGKILL))
        measure("after a cold restart, no L3", daemon.restart(signal.SIGTERM, ["--cold"]),
                flush=True)
    finally:
        daemon.close()
    ref = rows[0][1]
    print(f"qwen3_next hidden {args.hidden}, {args.layers} layers, {n}-token prompts, "
          f"{args.hit:.0%} shared, page {ps}, {args.device}, median of {args.repeats}")
    print(f"{'stage':<32} {'hit rate':>8} {'ttft ms':>9} {'vs recompute':>13} {'ready s':>8}")
    for stage, ttft, hit, ready in rows:
        r = f"{ready:.2f}" if ready is not None else "-"
        print(f"{stage:<32} {hit:>8.1%} {ttft * 1e3:>9.1f} {ttft / ref:>12.3f}x {r:>8}")
    return 0


def pressure(args: argparse.Namespace) -> int:
    """The run under memory pressure (issue 25): per policy, a daemon whose L2 (no L3) holds
    ``--noise`` + 0.5 prompts' pages and states. An engine computes the base prompt, then
    ``--noise`` unrelated prompts of the same length (L2 fills and evicts half a prompt), then
    a fresh engine asks a prompt sharing ``--hit`` of the base: what L2 still serves of the base
    decides its TTFT (the first ask only: it stores the shared prefix again, so later asks
    would hit in full). LRU evicts the base's oldest pages, its head, first, and its hit falls
    to 0; the chain-aware policies take the base from its deep end."""
    n, ps = args.prompt_tokens, args.page_size
    unbounded = parse_size(args.unbounded_l2, "--unbounded-l2")  # (a ConfigError before work)
    shared = int(n * args.hit)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (n,), generator=g).tolist()
    noise = [torch.randint(0, 256, (n,), generator=g).tolist() for _ in range(args.noise)]
    asks = [base[:shared] + torch.randint(0, 256, (n - shared,), generator=g).tolist()]
    lm = load_model("qwen3_next", device=args.device, hidden_size=args.hidden,
                    num_hidden_layers=args.layers)
    lm.warmup(ps)
    slab = args.pressure_slab
    per_prompt = None
    rows = []
    for policy in ["unbounded"] + [p.strip() for p in args.policies.split(",") if p.strip()]:
        if policy == "unbounded":
            l2, extra = unbounded, ["--l3-backend", "none"]
        else:
            l2 = -(-int(per_prompt * (args.noise + 0.5)) // slab) * slab
            extra = ["--l3-backend", "none", "--eviction", policy]
        daemon = DaemonLauncher(l2_size=str(l2), slab_size=str(slab), extra=extra)
        try:
            def engine(daemon=daemon) -> Engine:
                return Engine(lm, EngineConfig(
                    page_size=ps, kv_pages=4 * (n // ps + 2) * 2, state_slots=256,
                    track_interval=args.track_interval,
                    prefill_chunk_pages=args.prefill_chunk_pages, device=args.device,
                    storage_backend="hicached", hicached_endpoint=daemon.endpoint))

            with Client(daemon.endpoint, "admin") as admin:
                for prompt in [base, *noise]:
                    eng = engine()  # each its own engine: what it keeps is the daemon's
                    eng.generate(prompt, 1)
                    eng.close()
                    if per_prompt is None:
                        per_prompt = admin.stats()["l2_used_bytes"]
                runs = []
                for p in asks:
                    eng = engine()
                    req = eng.add_request(p, 1)
                    while not req.done:
                        eng.step()
                    runs.append((req.ttft_s, req.cached_tokens))
                    eng.close()
                st = admin.stats()
            rows.append((policy, l2, runs[0][0], runs[0][1] / n, st["evictions"],
                         st.get("l2_orphan_bytes")))
        finally:
            daemon.close()
    print(f"qwen3_next hidden {args.hidden}, {args.layers} layers, {n}-token prompts, "
          f"{args.hit:.0%} shared with the base, {args.noise} noise prompts, page {ps}, track "
          f"{args.track_interval}, {args.device}, one ask")
    print(f"{'policy':<10} {'L2 MiB':>7} {'hit rate':>8} {'ttft ms':>9} {'evictions':>9} "
          f"{'orphan KiB':>10}")
    for policy, l2, ttft, hit, ev, orphan in rows:
        print(f"{policy:<10} {l2 / (1 << 20):>7.1f} {hit:>8.1%} {ttft * 1e3:>9.1f} {ev:>9} "
              f"{'n/a' if orphan is None else orphan // 1024:>10}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t0:.1f} s)")
    gc.freeze()  # (exit: the interpreter's last collections walk transformers' objects for seconds)
    sys.exit(rc)
