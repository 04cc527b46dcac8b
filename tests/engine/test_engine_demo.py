"""``hicached demo`` end to end: its own daemon, both models, every phase's hit sources."""

import pytest

from hicached.ops.cli import main

pytest.importorskip("transformers", reason="the reference engine needs the engine extra")


def rows(out, arch, phase):
    """(L1, L2, L3, computed) of each per-turn row of ``phase`` in ``arch``'s table."""
    table = out.split(f"{arch}: TTFT per turn")[1].split("hit rate")[0]
    got = []
    for line in table.splitlines():
        if line.startswith(phase + " "):
            *_, l1, l2, l3, computed = line.split()
            got.append((int(l1), int(l2), int(l3), int(computed)))
    return got


def test_demo_reports_hits_from_every_tier(capsys):
    assert main(["demo", "--conversations", "2", "--systems", "1", "--turns", "2",
                 "--system-tokens", "48", "--user-tokens", "12", "--new-tokens", "2",
                 "--page-size", "8", "--track-interval", "16", "--kv-pages", "128",
                 "--debug-pools"]) == 0
    out = capsys.readouterr().out
    for arch in ("qwen3_next", "deepseek_v32"):
        device = rows(out, arch, "device + L2")
        assert [r[3] for r in device[:1]] == [60]  # the very first prompt is all computed
        assert device[1][0] == 48  # conversation 1 shares the 48-token system prompt (L1)
        new = rows(out, arch, "new engine")
        assert new[0][1] > 0 and all(r[2] == 0 for r in new)  # an empty engine: L2 hits
        l3 = rows(out, arch, "L3")
        assert l3[0][2] > 0 and all(r[1] == 0 for r in l3)  # the daemon's L2 was flushed
        assert "no cache" in out.split(f"{arch}: TTFT per turn")[1]
        # a speed-up only where something came from a cache: where all was computed, "-"
        table = out.split(f"{arch}: TTFT per turn")[1].split("hit rate")[0].splitlines()[2:-1]
        shown = [(line.split()[-5], int(line.split()[-8]), int(line.split()[-1]))
                 for line in table]
        assert shown and ("-", 60, 60) in shown
        for speedup, prompt, computed in shown:
            assert (speedup == "-") == (computed == prompt), (speedup, prompt, computed)
            assert speedup == "-" or speedup.endswith("x")


def test_demo_on_another_daemon_says_it_skips_the_l3_phase(daemon, capsys):
    assert main(["demo", "--models", "qwen3_next", "--conversations", "1", "--systems", "1",
                 "--turns", "1", "--system-tokens", "16", "--user-tokens", "8",
                 "--new-tokens", "1", "--page-size", "8", "--kv-pages", "64",
                 "--hicached-endpoint", daemon.endpoint]) == 0
    out = capsys.readouterr().out
    assert f"the L3 phase is skipped: it flushes the L2 of the daemon at {daemon.endpoint}" in out
    assert "--flush-daemon-l2 runs it" in out
    assert not rows(out, "qwen3_next", "L3") and rows(out, "qwen3_next", "new engine")


def pd_rows(out):
    """(conv, turn, prompt, matched, KiB off, KiB on) of each per-request row of ``--pd``."""
    table = out.split("qwen3_next: PD on one node")[1].split("\nmode")[0]
    return [tuple(int(x) for x in line.split()[:6]) for line in table.splitlines()
            if line.split() and line.split()[0].isdigit()]


def test_demo_pd_shows_what_the_decode_radix_saves(capsys):
    """``hicached demo --pd``: 2 conversations on one 48-token system prompt, 2 turns, 8-token
    pages (4 KiB, a state 12 KiB). Without the decode radix each request moves its prompt's
    whole pages and a state (56 tokens: 40 KiB, then 72: 48 KiB); with it the decode holds the
    system prompt (conversation 1), then each conversation's history, and moves less."""
    assert main(["demo", "--pd", "--conversations", "2", "--systems", "1", "--turns", "2",
                 "--system-tokens", "48", "--user-tokens", "12", "--new-tokens", "2",
                 "--page-size", "8", "--track-interval", "16", "--kv-pages", "128",
                 "--debug-pools"]) == 0
    out = capsys.readouterr().out
    rows = pd_rows(out)
    assert [r[:4] for r in rows] == [(0, 0, 60, 0), (1, 0, 60, 48), (0, 1, 74, 56),
                                     (1, 1, 74, 56)]
    assert [r[4] for r in rows] == [40, 40, 48, 48]
    assert rows[0][5] == 40 and all(r[5] < r[4] for r in rows[1:])
    speedups = [line.split()[-1] for line in out.split("qwen3_next: PD on one node")[1].split(
        "\nmode")[0].splitlines() if line.split() and line.split()[0].isdigit()]
    assert speedups[0] == "-" and all(s.endswith("x") for s in speedups[1:])  # matched 0, then >0
    assert "outputs equal across modes: yes" in out
