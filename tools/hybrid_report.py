"""The report of ``bench_hybrid_cache.py`` (issue 25): each policy's ratios to LRU's and to the
ceiling, the targets met or not, and the printed table per budget."""

from __future__ import annotations

from hybrid_trace import KV_PAGE_BYTES


def add_ratios(runs: list[dict]) -> None:
    """Each run's hit rate over LRU's at its budget and over its policy's unbounded run."""
    lru = {r["budget"]: r["hit_rate"] for r in runs if r["policy"] == "lru"}
    top = {r["policy"]: r["hit_rate"] for r in runs if r["budget"] is None}
    for r in runs:
        base, ceil = lru.get(r["budget"]), top.get(r["policy"])
        r["over_lru"] = r["hit_rate"] / base if base else None
        r["over_ceiling"] = r["hit_rate"] / ceil if ceil else None


def targets(runs: list[dict]) -> list[tuple[str, str, bool | None]]:
    """(policy, what, met) for each non-LRU policy's issue-25 targets (None: cannot say)."""
    out: list[tuple[str, str, bool | None]] = []
    lru = {r["budget"]: r for r in runs if r["policy"] == "lru"}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        if policy == "lru":
            continue
        mine = [r for r in runs if r["policy"] == policy]
        at = {r["budget"]: r for r in mine}
        if 0.05 in at and at[0.05]["over_lru"] is not None:
            v = at[0.05]["over_lru"]
            out.append((policy, f"5 %: hit rate {v:.2f} x LRU's (>= 1.5)", v >= 1.5))
        if 0.10 in at and at[0.10]["over_ceiling"] is not None:
            v = at[0.10]["over_ceiling"]
            out.append((policy, f"10 %: hit rate {v:.2f} x the ceiling (>= 0.85)", v >= 0.85))
        ratios = [r["over_lru"] for r in mine if r["over_lru"] is not None]
        if ratios:
            out.append((policy, f"no budget below LRU: lowest {min(ratios):.3f} x (>= 1)",
                        min(ratios) >= 1.0))
        worst = None
        for r in mine:
            o = r["orphans_daemon"] or r["orphans_client"]
            if o is not None:
                worst = max(worst or 0.0, o["max"] / r["l2_bytes"])
        src = "daemon's" if all(r["orphans_daemon"] for r in mine) else "client's count"
        share = "n/a" if worst is None else f"{worst:.2%}"
        out.append((policy, f"orphans at most {share} of the arena ({src}; <= 1 %)",
                    None if worst is None else worst <= 0.01))
        for kind in ("exists", "get", "set"):
            ratios = [r[kind]["p99_ms"] / lru[r["budget"]][kind]["p99_ms"]
                      for r in mine if r["budget"] in lru]
            if ratios:
                out.append((policy, f"{kind} p99: worst {max(ratios):.2f} x LRU's (<= 1.10)",
                            max(ratios) <= 1.10))
    return out


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:.1f}"


def _orph(o: dict | None, l2: int) -> str:
    return "n/a" if o is None else f"{_mib(o['max'])}/{_mib(o['mean'])} ({o['max'] / l2:.1%})"


def print_report(info: dict, runs: list[dict], args) -> None:
    """The trace summary, one table per budget, the targets."""
    mib = 2**20
    kinds = ", ".join(f"{k} {v}" for k, v in info["kinds"].items())
    print(f"bench_hybrid_cache: trace {info['trace']} (seed {info['seed']}, {info['about']}, "
          f"Zipf s {info['zipf_s']}): {info['requests']} requests ({kinds}), the first "
          f"{info['warmup_requests']} not counted")
    print(f"  {info['prompt_tokens']:,} prompt tokens (mean {info['mean_prompt_tokens']:,.0f}), "
          f"{info['unique_pages']:,} distinct pages; stored: {info['stored_kv_pages']:,} KV pages "
          f"of {KV_PAGE_BYTES // 1024} KiB + {info['stored_states']:,} states of "
          f"{info['state_bytes'] // 1024} KiB ({args.state_pages} pages) = working set "
          f"{info['working_set_bytes'] / mib:,.1f} MiB; ceiling (no eviction) hit rate "
          f"{info['ceiling_hit_rate']:.4f}")
    print(f"  slab {args.slab_size / mib:g} MiB, L3 off, set calls of <= {args.set_batch} pages"
          + (f", daemon args {args.daemon_args!r}" if args.daemon_args else ""))
    for r in runs:
        if r["budget"] is None and abs(r["hit_rate"] - info["ceiling_hit_rate"]) > 1e-9:
            print(f"  WARNING: {r['policy']} unbounded hit rate {r['hit_rate']:.4f} != the "
                  f"trace's ceiling {info['ceiling_hit_rate']:.4f} (evictions "
                  f"{r['evictions']}, refused {r['set_refused']})")
    cols = ["policy", "hit rate", "/LRU", "/ceil", "orphans MiB max/mean (daemon)",
            "orphans (client)", "dead KV mean", "B/hit tok", "exists p50/p99", "get p50/p99",
            "set p50/p99 ms", "evictions"]
    for budget in dict.fromkeys(r["budget"] for r in runs):
        mine = [r for r in runs if r["budget"] == budget]
        label = "unbounded (ceiling)" if budget is None else f"{budget:.0%} of the working set"
        print(f"\nL2 {label}: arena {mine[0]['l2_bytes'] / mib:,.0f} MiB")
        rows = []
        for r in mine:
            dead = r["dead_kv"]
            rows.append([
                r["policy"], f"{r['hit_rate']:.4f}",
                "-" if r["over_lru"] is None else f"{r['over_lru']:.2f}",
                "-" if r["over_ceiling"] is None else f"{r['over_ceiling']:.2f}",
                _orph(r["orphans_daemon"], r["l2_bytes"]),
                _orph(r["orphans_client"], r["l2_bytes"]),
                "n/a" if dead is None else _mib(dead["mean"]),
                "-" if r["bytes_read_per_hit_token"] is None
                else f"{r['bytes_read_per_hit_token']:,.0f}",
                *(f"{r[k]['p50_ms']:.2f}/{r[k]['p99_ms']:.2f}" for k in ("exists", "get", "set")),
                str(r["evictions"])])
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(cols, widths, strict=True))))
        for row in rows:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                            for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        odd = [f"{r['policy']}: {r['get_misses']} gets missed after exists, "
               f"{r['set_refused']} pages refused" for r in mine
               if r["get_misses"] or r["set_refused"]]
        for line in odd:
            print(f"  NOTE {line}")
    found = targets(runs)
    if found:
        print("\ntargets (issue 25)")
        for policy, what, met in found:
            print(f"  {policy:12s} {'n/a ' if met is None else 'met ' if met else 'MISS'}  {what}")
