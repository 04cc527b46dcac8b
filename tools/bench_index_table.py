"""The side-by-side table of ``bench_index.py`` (issue 24): one row a metric, its value for
each tree measured, then current / baseline for each baseline."""

from __future__ import annotations

MIX_KINDS = ("exists", "get", "set")  # bench_index.MIX's kinds, in its order
PAGE_BYTES = 4096  # bench_index.PAGE_BYTES


def _count(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k" if n >= 1000 else str(n)


def rows(r: dict) -> list[tuple[str, float | str]]:
    """(metric, value) of one tree's results, in table order."""
    a, b = _count(r["first"]), _count(r["pages"])
    e1, e2, m = r["exists_first"], r["exists_full"], r["mixed"]
    table = r["presence_full"] or {}
    out = []
    for path in ("table", "socket"):
        out += [(f"exists p50 via {path} @{a} (ms)", e1[path]["p50_ms"]),
                (f"exists p99 via {path} @{a} (ms)", e1[path]["p99_ms"]),
                (f"exists p50 via {path} @{b} (ms)", e2[path]["p50_ms"]),
                (f"exists p99 via {path} @{b} (ms)", e2[path]["p99_ms"]),
                (f"  p50 @{b} / @{a} (target <= 1.3)",
                 e2[path]["p50_ms"] / e1[path]["p50_ms"])]
    out += [
        (f"table answered exists @{a}; @{b}",
         f"{'yes' if e1['from_table'] else 'no'}; {'yes' if e2['from_table'] else 'no'}"),
        (f"presence table @{b}: keys / slots, full",
         f"{table.get('keys', 0)}/{table.get('slots', 0)}, {'FULL' if table.get('full') else 'ok'}"),
        ("daemon RssAnon before fill (MiB)", r["rss_before"] / 2**20),
        (f"daemon RssAnon @{a} (MiB)", r["rss_first"] / 2**20),
        (f"daemon RssAnon @{b} (MiB)", r["rss_full"] / 2**20),
        ("heap bytes / indexed page (target <= 250)", r["heap_bytes_per_page"]),
        (f"set {a}->{b} (k pages/s)", r["set"]["pages_per_s"] / 1e3),
        (f"set {a}->{b} (GB/s)", r["set"]["gbps"]),
        (f"get 64 pages @{b} (k pages/s)", r["get"]["pages_per_s"] / 1e3),
        (f"get 64 pages @{b} p50 (ms)", r["get"]["p50_ms"]),
        (f"get 64 pages @{b} p99 (ms)", r["get"]["p99_ms"]),
        (f"mixed, {m['clients']} clients: ops/s", m["ops_per_s"]),
    ]
    if len(m.get("runs_ops_per_s", ())) > 1:  # the median above, of these
        out.append(("  ops/s of each run", " ".join(f"{v:,.0f}" for v in m["runs_ops_per_s"])))
    for kind in MIX_KINDS:
        out += [(f"  {kind} p50 (ms)", m[kind]["p50_ms"]), (f"  {kind} p99 (ms)", m[kind]["p99_ms"])]
    out += [("  daemon CPU during the mix (cores)", m.get("daemon_cores", 0.0)),
            ("  get hits / pages asked", m["get_hit_share"]),
            ("evictions (after the mix)", r["evictions"])]
    return out


def _show(v: float | str | None) -> str:
    if isinstance(v, str) or v is None:
        return str(v)
    return f"{v:,.0f}" if abs(v) >= 1000 or v == int(v) and abs(v) >= 10 else f"{v:.3g}"


def print_table(results: list[dict], daemon_args: str = "") -> None:
    """One row a metric: its value for each tree, then current / baseline for each baseline."""
    r0 = results[0]
    sizing = f"daemon args {daemon_args!r}" if daemon_args else "default presence sizing"
    print(f"bench_index: {PAGE_BYTES // 1024} KiB pages, 64-hex keys, arena {r0['l2_size']}, "
          f"{sizing}, L3 off; {r0['mixed']['clients']} mixed-load clients for "
          f"{r0['mixed']['seconds']:.1f} s, "
          + (f"{r0['mixed']['rate']:,.0f} ops/s offered (latencies from each op's arrival)"
             if r0["mixed"].get("rate") else "closed loop"))
    for i, r in enumerate(results):
        print(f"  [{'current' if i == 0 else f'baseline{i}'}] {r['tree']}")
    heads = ["current"] + [f"baseline{i}" for i in range(1, len(results))]
    heads += [f"ratio{i}" if len(results) > 2 else "ratio" for i in range(1, len(results))]
    table = [rows(r) for r in results]
    lines = []
    for i, (name, v0) in enumerate(table[0]):
        cells = [_show(t[i][1]) for t in table]
        for t in table[1:]:
            vb = t[i][1]
            ok = isinstance(v0, (int, float)) and isinstance(vb, (int, float)) and vb
            cells.append(f"{v0 / vb:.2f}" if ok else "-")
        lines.append((name, cells))
    name_w = max(len(name) for name, _ in lines) + 2
    cell_w = max(12, *(len(c) + 2 for _, cells in lines for c in cells))
    print(f"{'metric':{name_w}s}" + "".join(f"{h:>{cell_w}s}" for h in heads))
    for name, cells in lines:
        print(f"{name:{name_w}s}" + "".join(f"{c:>{cell_w}s}" for c in cells))
