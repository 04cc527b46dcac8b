"""PD disaggregation on one node: a prefill engine and decode engines, pages through a real daemon.

The engines and their ZeroMQ channels are real; the test drives them from one thread
(``pump``: one prefill poll, one decode step), so failures can be placed exactly. A decode's
outputs must equal a non-disaggregated engine's (1e-5) in every case, its moved pages must be
exactly the delta past its radix cache's match, and its leak identity must hold after each
request and after every failure. ``test_pd_processes`` runs the same through
``python -m hicached.engine.pd`` processes, and kills the prefill.

Conversation A (PS = 8, track interval 16): a 43-token prompt and 6 output tokens; the decode
then holds A's 40 prompt tokens (state at 40, from the prefill) and 48 tokens of A + output
(state at 48, its finish snapshot).
"""

import time

import pytest
import torch

from hicached.engine.config import EngineConfig
from hicached.engine.engine import Engine
from hicached.engine.models import load_model

pytest.importorskip("transformers", reason="the reference engine needs the engine extra")

from hicached.engine.pd.decode import DecodeEngine
from hicached.engine.pd.prefill import PrefillEngine, PrefillServer

TOL = 1e-5
PS = 8
ARCHS = ["qwen3_next", "deepseek_v32"]


def toks(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A = toks(43, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    paths = {}
    for arch in ARCHS:
        paths[arch] = str(tmp_path_factory.mktemp(arch))
        load_model(arch, seed=0, path=paths[arch])  # saved once; every engine loads it
    yield paths
    torch.set_num_threads(threads)


def config(daemon, **kw):
    return EngineConfig(**{"page_size": PS, "kv_pages": 64, "state_slots": 24,
                           "track_interval": 16, "debug_pools": True,
                           "storage_backend": "hicached", "hicached_endpoint": daemon.endpoint,
                           **kw})


class Node:
    """A daemon, one prefill (engine + bootstrap server) and decode engines on it."""

    def __init__(self, arch, path, daemon, tmp_path):
        self.arch, self.path, self.daemon = arch, path, daemon
        self.boot = f"ipc://{tmp_path}/boot-{arch}.sock"
        self.prefill = PrefillEngine(load_model(arch, path=path), config(daemon))
        self.server = PrefillServer(self.prefill, self.boot)
        self.decodes = []
        self.ref = Engine(load_model(arch, path=path),
                          EngineConfig(page_size=PS, disable_radix_cache=True))

    def decode(self, radix=True, timeout_s=30.0):
        d = DecodeEngine(load_model(self.arch, path=self.path), config(self.daemon),
                         self.boot, radix=radix, timeout_s=timeout_s)
        self.decodes.append(d)
        return d

    def run(self, d, prompt, max_new=6, rid=None, prefill_alive=True, deadline_s=60.0):
        req = d.add_request(prompt, max_new, rid)
        end = time.monotonic() + deadline_s
        while not req.done:
            assert time.monotonic() < end, "request did not end"
            if prefill_alive:
                self.server.poll_once(0)
            d.step()
            d.check_busy()
        d.check_idle()
        return req

    def twin(self):
        """A non-disaggregated engine (radix cache, no storage): given the same requests it
        holds the same prefixes as a decode engine, generated tokens' KV included."""
        e = Engine(load_model(self.arch, path=self.path),
                   EngineConfig(page_size=PS, kv_pages=64, state_slots=24, track_interval=16))
        self.decodes.append(e)
        return e

    def assert_equal(self, req, twin):
        """``req``'s outputs equal ``twin``'s for the same prompt; on the hybrid model also a
        cache-less engine's (on DeepSeek-V3.2 reusing generated tokens' KV differs from a
        prompt recompute by up to ~0.04 in any engine: tests/engine compare to live caches)."""
        refs = [twin.generate(req.prompt, req.max_new_tokens)]
        if self.arch == "qwen3_next":
            refs.append(self.ref.generate(req.prompt, req.max_new_tokens))
        for ref in refs:
            assert req.error == "" and req.output_ids == ref.output_ids
            assert len(req.logits) == len(ref.logits)
            for got, want in zip(req.logits, ref.logits):
                assert (got - want).abs().max().item() <= TOL

    def close(self):
        self.server.close()
        self.prefill.close()
        for d in self.decodes:
            d.close()
        self.ref.close()


@pytest.fixture
def daemon(make_daemon):
    """The node's daemon, L2 only: the one-node PD path (an L3 would serve flushed pages)."""
    return make_daemon(extra=("--l3-backend", "none"))


@pytest.fixture(params=ARCHS)
def node(request, checkpoints, daemon, tmp_path):
    n = Node(request.param, checkpoints[request.param], daemon, tmp_path)
    yield n
    n.close()


def moved(req):
    t = req.transfer
    return t.decode_prefix_len, t.moved_pages, t.moved_states


def test_pd_cases_equal_a_plain_engine(node):
    run_cases(node)


def run_cases(node):
    """Every case on one decode, in turn (each builds on what the decode holds by then), each
    equal to the twin with the exact delta moved; the requests run. Two nodes use it too
    (``test_pd_two_nodes.py``)."""
    d, twin = node.decode(), node.twin()
    states = 1 if d.states is not None else 0
    done = []
    seq_a = None
    cases = [  # (name, prompt, (decode_prefix_len, moved pages))
        ("miss", lambda: A, (0, 5)),
        ("full-prefix hit", lambda: A, (40, 0)),
        ("partial hit through generated tokens", lambda: seq_a + toks(10, 2), (48, 1)),
        ("prefix ending mid-page", lambda: seq_a[:46] + toks(13, 3), (40, 2)),
        ("branch mid-conversation", lambda: seq_a[:20] + toks(25, 4), (16, 3)),
        ("page-aligned prompt, miss", lambda: toks(32, 5), (0, 4)),
        ("page-aligned prompt, full hit", lambda: toks(32, 5), (32, 0)),
    ]
    for name, prompt, want in cases:
        req = node.run(d, prompt())
        assert req.status.value == "finished", (name, req.error)
        node.assert_equal(req, twin)
        assert moved(req) == (*want, states), name
        done.append(req)
        if seq_a is None:
            seq_a = req.seq
    short = node.run(d, toks(5, 6), max_new=3)  # shorter than a page: nothing moves
    node.assert_equal(short, twin)
    assert moved(short) == (0, 0, 0)
    one = node.run(d, toks(16, 7), max_new=1)  # aligned, one token: the prefill's only
    node.assert_equal(one, twin)
    assert d.first_token_mismatches == 0  # every tail gave the prefill's first token
    node.prefill.check_idle()
    return [*done, short, one]


def test_pd_without_decode_radix_moves_everything(node):
    d, twin = node.decode(radix=False), node.twin()
    states = 1 if d.states is not None else 0
    for _ in range(2):
        req = node.run(d, A)
        node.assert_equal(req, twin)
        assert moved(req) == (0, 5, states)


def test_second_decode_finds_the_first_ones_prefixes_in_l2(node):
    d1, d2, twin = node.decode(), node.decode(), node.twin()
    seq_a = node.run(d1, A).seq
    twin.generate(A, 6)
    req = node.run(d2, seq_a + toks(10, 2))  # A's output is only in d1's cache, and in L2
    node.assert_equal(req, twin)
    assert req.l2_tokens == 48 and moved(req)[:2] == (48, 1)


def test_decode_reads_no_state_alone_from_l2(node):
    """The decode holds A's KV but none of its states (tombstones) while L2 holds the state at
    A's end: its arrival load-back reads nothing (a state alone), and the prefill sends the
    page past A and the state it needs."""
    d, twin = node.decode(), node.twin()
    seq_a = node.run(d, A).seq
    twin.generate(A, 6)
    if d.states is not None:  # tombstones up to 40 (the leaf below, locked, keeps the KV)
        lock = d.tree.inc_lock(d.tree.match_prefix(seq_a, count_hit=False).kv_node)
        while d.tree.match_prefix(A[:40], count_hit=False).pages:
            assert d.tree.evict_states(1) == 1
        d.tree.dec_lock(lock)
        assert d.tree.match_prefix(A[:40], count_hit=False).kv_len == 40
    prompt = A[:40] + toks(12, 3)
    req = node.run(d, prompt)
    node.assert_equal(req, twin)
    assert (req.loaded.read_pages, req.loaded.read_states) == (0, 0)
    assert moved(req) == (40, 1, 1 if d.states is not None else 0)


def test_prefill_dies_mid_request(node):
    d = node.decode(timeout_s=1.0)
    node.run(d, A)  # something cached and locked by the next request
    req = d.add_request(A[:40] + toks(20, 8), 6)
    node.server.poll_once(0)
    d.step()  # asked
    node.server.poll_once(10_000)  # the prefill took it (once it arrived) and ran a chunk...
    assert node.prefill.running
    node.server.close()  # ...and dies
    while not req.done:
        d.step()
        d.check_busy()
    assert req.status.value == "aborted" and "did not answer" in req.error
    d.check_idle()
    assert d.tree.kv_protected == 0 and not d.transferring


def test_pages_gone_before_the_load(node):
    d = node.decode()
    req = d.add_request(A, 6)
    d.step()
    while not d.sock.poll(0):
        node.server.poll_once(0)  # computed, published, Ready sent
    with node.daemon.client() as c:
        c.flush("l2")
    while not req.done:
        d.step()
    assert req.status.value == "aborted" and "were not in hicached" in req.error
    d.check_idle()
    again = node.run(d, A)  # the decode recovers: the prefill publishes again
    node.assert_equal(again, node.twin())


def test_decode_abort_while_the_prefill_works(node):
    d = node.decode()
    req = d.add_request(A, 6, rid="x")
    d.step()
    node.server.poll_once(10_000)  # the prefill took it (once it arrived)
    assert d.abort("x") and req.status.value == "aborted"
    d.check_idle()
    end = time.monotonic() + 30
    while node.prefill.requests:  # until the abort arrives (a loaded machine: later)
        assert time.monotonic() < end
        node.server.poll_once(100)
    node.prefill.check_idle()


def test_prefill_answers_bad_requests_and_drops_malformed_frames(node):
    import zmq

    from hicached.engine.pd import protocol as M

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(node.boot)
    try:
        s.send(b"\xc1not msgpack")  # dropped, the server goes on
        s.send(M.encode(M.PrefillRequest("bad", A, 3)))
        s.send(M.encode(M.PrefillRequest("ok", A, 0)))
        s.send(M.encode(M.PrefillRequest("ok", A, 0)))  # the id is in use
        got = []
        end = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < end:
            node.server.poll_once(1)
            while s.poll(0):
                got.append(M.decode(s.recv(), "decode"))
        by = {(m.rid, type(m).__name__): m for m in got}
        assert "multiple of page_size 8" in by["bad", "Failed"].message
        assert "already in use" in by["ok", "Failed"].message
        ready = by["ok", "Ready"]
        assert ready.stored_pages == 5 and len(M.logits_rows(ready.logits, 256)) == 1
        node.prefill.check_idle()
    finally:
        s.close()
        ctx.term()


def test_overlapping_requests_in_flight_together(node):
    """Three requests asked before any is ready, two of them the same prompt: the later insert
    frees its duplicate pages and state; every request still equals the twin's."""
    d, twin = node.decode(), node.twin()
    prompts = [A, A, A[:24] + toks(19, 9)]
    reqs = [d.add_request(p, 4) for p in prompts]
    d.step()
    assert len(d.transferring) == 3
    d.check_busy()
    end = time.monotonic() + 60
    while not all(r.done for r in reqs):
        assert time.monotonic() < end
        node.server.poll_once(0)
        d.step()
        d.check_busy()
    d.check_idle()
    assert [moved(r)[:2] for r in reqs] == [(0, 5), (0, 5), (0, 5)]
    for r in reqs:
        node.assert_equal(r, twin)
