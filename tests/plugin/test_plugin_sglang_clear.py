"""SGLang's ``clear()`` through the plugin: by default one engine's clear flushes its own
namespace's pages (L2 and the file L3), never another engine's; ``clear_scope: node`` keeps the
node-wide flush. Two engines of different models share one real daemon with a file L3."""

import pytest
import torch
from conftest import wait_until
from sglang_env import idx, keys_of, kv_bytes, kv_pool

from hicached import PoolTransfer
from hicached.plugin.settings import PluginSettings

KEYS = keys_of("c-", 6)  # the same keys in both engines' namespaces


def engine(plugin, daemon, model, seed, **extra):
    """A plugin of ``model`` holding KEYS in L2 and (written through) in L3."""
    b = plugin(daemon.endpoint, {"kv": kv_pool(seed=seed)}, model=model, extra=extra)
    assert b.batch_set_v1(KEYS, idx(0, 6)) == [True] * 6
    b.client().wait_stored([PoolTransfer("kv", keys=KEYS)])
    return b


def reads_back(b, seed):
    """Every KEY loads into the engine's pool, byte-equal to what an engine of ``seed`` set."""
    if b.batch_get_v1(KEYS, idx(10, 6)) != [True] * 6:
        return False
    return torch.equal(kv_bytes(b.mem_pool_host, 10, 6), kv_bytes(kv_pool(seed=seed), 0, 6))


def l2_pages(daemon):
    with daemon.client("probe") as probe:
        return probe.stats()["l2_pages"]


def test_clear_flushes_the_engines_own_namespace_and_no_other(sg, plugin, daemon):
    a = engine(plugin, daemon, "org/model-a", seed=1)
    b = engine(plugin, daemon, "org/model-b", seed=2)
    assert a.namespace.namespace != b.namespace.namespace
    assert l2_pages(daemon) == 12
    assert a.clear() is True
    assert a.batch_exists(KEYS) == 0  # neither in L2 nor in L3
    assert l2_pages(daemon) == 6
    assert b.batch_exists(KEYS) == 6 and reads_back(b, seed=2)  # from L2
    with daemon.client("probe") as probe:  # the node's L2 goes: B's pages are in L3 alone
        # (once B's get released its leases: a flush passes over pinned pages)
        assert wait_until(lambda: probe.flush("l2") or probe.stats()["l2_pages"] == 0)
    assert b.batch_exists(KEYS) == 6 and reads_back(b, seed=2)
    assert a.batch_exists(KEYS) == 0
    counters = a.get_stats().counters
    assert counters["errors"] == counters["unavailable"] == 0


def test_clear_tier_l2_keeps_the_engines_l3_copies(sg, plugin, daemon):
    a = engine(plugin, daemon, "org/model-a", seed=1, clear_tier="l2")
    b = engine(plugin, daemon, "org/model-b", seed=2)
    assert a.clear() is True
    assert l2_pages(daemon) == 6  # B's
    assert a.batch_exists(KEYS) == 6 and reads_back(a, seed=1)  # loaded back from L3
    assert b.batch_exists(KEYS) == 6


def test_clear_scope_node_flushes_every_engines_pages(sg, plugin, daemon):
    a = engine(plugin, daemon, "org/model-a", seed=1, clear_scope="node")
    b = engine(plugin, daemon, "org/model-b", seed=2)
    assert a.clear() is True
    assert l2_pages(daemon) == 0
    assert a.batch_exists(KEYS) == b.batch_exists(KEYS) == 0


def test_clear_scope_is_checked():
    assert PluginSettings.from_extra_config({}).clear_scope == "namespace"
    assert PluginSettings.from_extra_config({"clear_scope": "node"}).clear_scope == "node"
    with pytest.raises(ValueError, match=r"clear_scope must be one of \('namespace', 'node'\), "
                       r"got 'engine'"):
        PluginSettings.from_extra_config({"clear_scope": "engine"})
