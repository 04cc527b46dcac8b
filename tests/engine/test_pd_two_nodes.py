"""PD disaggregation on two nodes: the prefill engine on one daemon, the decode engine on
another, the two daemons sharing a real ``mooncake_master`` on loopback (``docs/pd.md``).

The prefill says ``Ready`` once its pages are stored in L3 (``--disaggregation-transfer l3``:
``Client.wait_stored``); the decode loads them by name through its own daemon, which found the
same keys absent from L3 at the request's arrival (its load-back), so its short memory of
absent keys must not turn the load into a miss. Every case of ``test_pd.py`` (``run_cases``):
outputs equal a non-disaggregated engine's, the exact delta moved, the leak identity after
every step; and every page the decode moved came through L3.
"""

import pytest
from conftest import wait_until
from mooncake_master import require_mooncake
from test_pd import ARCHS, PS, Node, checkpoints, config, run_cases  # noqa: F401 - a fixture

from hicached.engine.config import EngineConfig
from hicached.engine.engine import Engine
from hicached.engine.models import load_model
from hicached.engine.pd.prefill import PrefillEngine, PrefillServer

require_mooncake()


@pytest.fixture
def daemons(two_node_daemons):
    """(the prefill node's daemon, the decode node's daemon), sharing one master: the
    session's pair (``conftest.two_node_daemons``)."""
    return two_node_daemons


class TwoNodes(Node):
    """``test_pd.Node`` with the prefill on one daemon and the decodes on another."""

    def __init__(self, arch, path, prefill_daemon, decode_daemon, tmp_path):
        self.arch, self.path, self.daemon = arch, path, decode_daemon
        self.boot = f"ipc://{tmp_path}/boot-{arch}.sock"
        self.prefill = PrefillEngine(load_model(arch, path=path), config(prefill_daemon),
                                     transfer="l3")
        self.server = PrefillServer(self.prefill, self.boot)
        self.decodes = []
        self.ref = Engine(load_model(arch, path=path),
                          EngineConfig(page_size=PS, disable_radix_cache=True))
        self.stats_of = [prefill_daemon.client("stats"), decode_daemon.client("stats")]

    def run(self, d, prompt, **kw):
        """As ``Node.run``, once the decode daemon's L3 writes landed: on one node the
        prefill sees the decode's pages (its generated tokens' KV) in the shared L2 at once,
        here once they are in L3. (On DeepSeek-V3.2 a prefill that recomputes them instead
        differs from the twin by up to ~0.04: see ``Node.assert_equal``.)"""
        assert wait_until(lambda: self.stats()[1]["l3_tier"]["jobs_in_flight"] == 0)
        return super().run(d, prompt, **kw)

    def stats(self):
        return [c.stats() for c in self.stats_of]

    def close(self):
        super().close()
        for c in self.stats_of:
            c.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_two_nodes_equal_a_plain_engine(arch, checkpoints, daemons, tmp_path):  # noqa: F811
    node = TwoNodes(arch, checkpoints[arch], *daemons, tmp_path)
    try:
        before = node.stats()
        reqs = run_cases(node)
        after = node.stats()
    finally:
        node.close()
    d = node.decodes[0]
    pools = ["kv", "indexer"] if d.indexer is not None else ["kv"]
    moved = set()  # (pool, key) of every page and state the decode moved
    for r in reqs:
        t = r.transfer
        first = t.decode_prefix_len // PS
        keys = r.keys.keys[first:first + t.moved_pages]
        moved |= {(pool, k) for pool in pools for k in keys}
        if t.moved_states:
            moved.add(("mamba", r.keys.keys[len(r.prompt) // PS - 1]))
    delta = [{k: a[k] - b[k] for k in ("l3_loads", "store_waits", "store_wait_timeouts",
                                       "misses")}
             for a, b in zip(after, before)]
    # every page the decode moved came from L3 into its daemon's L2 (once: a state moved
    # again was still there), and no get missed
    assert delta[1]["l3_loads"] == len(moved) and delta[1]["misses"] == 0
    # the prefill waited for L3 before each Ready, never in vain
    assert delta[0]["store_waits"] >= sum(r.transfer.moved_pages + r.transfer.moved_states > 0
                                          for r in reqs)
    assert delta[0]["store_wait_timeouts"] == 0
