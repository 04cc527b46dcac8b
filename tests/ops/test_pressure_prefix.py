"""``tools/pressure_prefix.py``: issue 48's pressure pattern against real daemons. The newest
chain is kept whole under every policy; the third chain's usable hybrid prefix (its first 32
pages with the states at pages 15 and 31), which fits in the room left, is kept exactly by the
chain-aware policies (``prefix``, ``hybrid``); ``lru`` cannot keep it (a strict xfail that
says why)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent.parent / "tools"
POLICIES = ("lru", "prefix", "hybrid")
_RUNS: dict[str, list] = {}  # policy -> what its daemon kept (one daemon per policy and process)


@pytest.fixture
def pressure(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import pressure_prefix

    return pressure_prefix


def _kept(pressure, policy: str) -> list:
    if policy not in _RUNS:
        _RUNS[policy] = pressure.run(policy)
    return _RUNS[policy]


def test_usable_prefix_needs_every_page_before_it_and_a_state_at_its_end(pressure):
    kv = np.ones(pressure.CHAIN_PAGES, bool)
    st = np.zeros(pressure.CHAIN_PAGES, bool)
    st[[15, 31, 47]] = True
    kv[40] = False  # the prefix breaks at page 40: the state at 47 is of no use, 41.. orphans
    k = pressure.kept(3, kv, st)
    assert k == pressure.ChainKept(3, pressure.CHAIN_PAGES - 1, (15, 31, 47), 32,
                                   pressure.CHAIN_PAGES - 41)
    assert pressure.kept(1, kv, np.zeros_like(st)).usable_pages == 0  # no state: no hit


@pytest.mark.parametrize("policy", POLICIES)
def test_the_newest_chain_is_kept_whole(pressure, policy):
    chains = _kept(pressure, policy)
    assert [k.chain for k in chains] == [1, 2, 3, 4]
    assert chains[3] == pressure.ChainKept(4, 160, tuple(range(15, 160, 16)), 160, 0)
    used = sum(k.kv_pages for k in chains) * pressure.KV_PAGE_BYTES + sum(
        len(k.state_pages) for k in chains) * pressure.STATE_BYTES
    assert used <= pressure.L2_BYTES


LRU_REASON = ("lru knows no chains: a call's pages are used in chain order, so it evicts each "
              "older chain from its head (page 0 first) and its states oldest first (the state at "
              "15 before the one at 159); what it keeps of a chain is a tail no hit can use")


@pytest.mark.parametrize("policy", [
    pytest.param("lru", marks=pytest.mark.xfail(strict=True, reason=LRU_REASON)),
    "prefix", "hybrid"])
def test_the_third_chain_keeps_a_usable_hybrid_prefix(pressure, policy):
    third = _kept(pressure, policy)[2]
    assert third.usable_pages >= 32, third
    assert {15, 31} <= set(third.state_pages), third


@pytest.mark.parametrize("policy", ["prefix", "hybrid"])
def test_the_chain_aware_policies_keep_exactly_what_fits(pressure, policy):
    """The room the module docstring draws, and nothing more: chains 1 and 2 gone whole, the
    third's first 32 pages with their states (two KV slabs, two slots of the state slabs)."""
    chains = _kept(pressure, policy)
    assert chains[:3] == [pressure.ChainKept(1, 0, (), 0, 0), pressure.ChainKept(2, 0, (), 0, 0),
                          pressure.ChainKept(3, 32, (15, 31), 32, 0)]
