"""PD as a user runs it: ``python -m hicached.engine.pd`` prefill and decode processes on one real
daemon. Outputs equal a non-disaggregated engine's; a full-prefix hit moves no KV page; a second
decode process finds the first one's generated tokens through L2; a SIGKILLed prefill fails the
decode's next request cleanly (timeout) and the decode passes its leak check; the decode stops on
SIGTERM with status 0. A decode SIGKILLed while it holds a get lease leaves nothing pinned in
the daemon once the lease TTL has passed, and the prefill serves a new decode."""

import os
import random
import signal
import threading
import time

import pytest
import torch
from conftest import sigstop

from hicached.client.api import Client
from hicached.engine.config import EngineConfig
from hicached.engine.engine import Engine
from hicached.engine.models import load_model
from hicached.engine.pd.procs import EngineProc
from hicached.engine.pd.protocol import logits_rows
from hicached.engine.pd.server import PDClient

pytest.importorskip("transformers", reason="the reference engine needs the engine extra")

PS = 8
A = torch.randint(0, 256, (43,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(extra=("--l3-backend", "none"))


def test_pd_processes(daemon, tmp_path):
    path = str(tmp_path / "ckpt")
    lm = load_model("qwen3_next", path=path)
    boot, front = f"ipc://{tmp_path}/boot.sock", f"ipc://{tmp_path}/front.sock"
    front2 = f"ipc://{tmp_path}/front2.sock"
    common = ["--model", "qwen3_next", "--model-path", path, "--page-size", str(PS),
              "--kv-pages", "64", "--state-slots", "24", "--track-interval", "16",
              "--debug-pools", "--hicache-storage-backend", "hicached",
              "--hicached-endpoint", daemon.endpoint, "--disaggregation-bootstrap-endpoint", boot]
    radix = ["--disaggregation-mode", "decode", *common,
             "--disaggregation-decode-enable-radix-cache"]
    procs = [EngineProc(str(tmp_path), "prefill", ["--disaggregation-mode", "prefill", *common]),
             EngineProc(str(tmp_path), "decode", [*radix, "--disaggregation-timeout-s", "3",
                                                  "--serve-endpoint", front]),
             EngineProc(str(tmp_path), "decode2", [*radix, "--serve-endpoint", front2])]
    prefill, decode, decode2 = procs
    twin = Engine(lm, EngineConfig(page_size=PS, kv_pages=64, state_slots=24,
                                   track_interval=16))
    try:
        for p in procs:
            p.wait_ready()
        with PDClient(front) as user:
            for i, want in enumerate([(0, 5), (40, 0)]):  # a miss, then a full-prefix hit
                got = user.generate(f"a{i}", A, 6)
                ref = twin.generate(A, 6)
                assert got.error == "" and got.output_ids == ref.output_ids
                for g, r in zip(logits_rows(got.logits, lm.vocab_size), ref.logits, strict=True):
                    assert (g - r).abs().max().item() <= 1e-5
                assert (got.decode_prefix_len, got.moved_pages, got.moved_states) == (*want, 1)
                # where the TTFT went: the prefill's part holds its publishing, and the load
                assert 0 < got.publish_s < got.prefill_s < got.ttft_s
                assert 0 < got.load_s < got.ttft_s - got.prefill_s
            assert user.check_idle().ok
            with PDClient(front2) as user2:  # A's output is in decode's cache, and in L2
                seq_a = A + got.output_ids
                got2 = user2.generate("a2", seq_a + [3] * 10, 4)
                ref = twin.generate(seq_a + [3] * 10, 4)
                assert got2.error == "" and got2.output_ids == ref.output_ids
                assert (got2.decode_prefix_len, got2.moved_pages) == (48, 1)
                assert user2.check_idle().ok
            prefill.stop(signal.SIGKILL)
            got = user.generate("b", A[:40] + [1] * 20, 6)
            assert got.output_ids == [] and "did not answer" in got.error
            checked = user.check_idle()
            assert checked.ok, checked.message
            bad = user.generate("c", [], 6)
            assert "non-empty prompt" in bad.error
        assert decode.stop() == 0, decode.output()
        assert decode2.stop() == 0, decode2.output()
    finally:
        twin.close()
        for p in procs:
            p.stop(signal.SIGKILL)


LEASE_TTL_S = 2.0


def test_a_killed_decode_leaves_nothing_pinned_after_the_lease_ttl(make_daemon, tmp_path):
    """A decode without the radix cache loads every page of every prompt (a leased get: it never
    saw them). It is stopped (SIGSTOP) right when the daemon shows a lease that stays while it
    is stopped, i.e. its own (the prefill reads nothing: every prompt is new), then SIGKILLed.
    Within the lease TTL (plus a sweep) the daemon holds no lease, reservation or fenced slot,
    and a flush leaves no page in L2: nothing is pinned. The prefill then serves a new decode,
    with the outputs the dead decode gave for the same prompt."""
    daemon = make_daemon(extra=("--l3-backend", "none", "--lease-ttl-s", str(LEASE_TTL_S),
                                "--reservation-ttl-s", str(LEASE_TTL_S)))
    path = str(tmp_path / "ckpt")
    load_model("qwen3_next", path=path)
    boot = f"ipc://{tmp_path}/boot.sock"
    common = ["--model", "qwen3_next", "--model-path", path, "--page-size", str(PS),
              "--kv-pages", "256", "--state-slots", "32", "--track-interval", "16",
              "--hicache-storage-backend", "hicached", "--hicached-endpoint", daemon.endpoint,
              "--disaggregation-bootstrap-endpoint", boot]
    front, front2 = f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/front2.sock"
    prefill = EngineProc(str(tmp_path), "prefill", ["--disaggregation-mode", "prefill", *common])
    decode = EngineProc(str(tmp_path), "decode", ["--disaggregation-mode", "decode", *common,
                                                  "--serve-endpoint", front])
    procs = [prefill, decode]
    stop = threading.Event()

    def load():  # new prompts, one after the other, until the decode is gone
        g = random.Random(2)
        with PDClient(front, timeout_s=10.0) as user:
            while not stop.is_set():
                try:
                    user.generate(f"l{g.random()}", [g.randrange(256) for _ in range(60)], 2)
                except TimeoutError:
                    return

    admin = Client(daemon.endpoint, "admin")
    loader = threading.Thread(target=load, daemon=True)
    try:
        for p in procs:
            p.wait_ready()
        with PDClient(front) as user:
            first = user.generate("a", A, 4)
        assert first.error == "" and first.moved_pages == len(A) // PS
        loader.start()
        deadline = time.monotonic() + 60
        while True:  # stop the decode while it holds a lease
            assert time.monotonic() < deadline, "never caught the decode holding a lease"
            if admin.stats()["leases"] == 0:
                time.sleep(0.002)
                continue
            sigstop(decode.proc.pid)
            time.sleep(0.2)  # a release already sent would have reached the daemon
            if admin.stats()["leases"] > 0:
                break
            os.kill(decode.proc.pid, signal.SIGCONT)
        decode.stop(signal.SIGKILL)
        killed = time.monotonic()
        stop.set()
        decode2 = EngineProc(str(tmp_path), "decode2", ["--disaggregation-mode", "decode",
                                                        *common, "--serve-endpoint", front2])
        procs.append(decode2)
        while True:
            st = admin.stats()
            held = (st["leases"], st["reservations"], st["fenced_bytes"])
            if held == (0, 0, 0):
                break
            assert time.monotonic() - killed < LEASE_TTL_S + 1.5, f"still held: {held}"
            time.sleep(0.05)
        admin.flush("l2")
        assert admin.stats()["l2_pages"] == 0  # no page pinned by the dead decode
        decode2.wait_ready()
        with PDClient(front2) as user:
            again = user.generate("a", A, 4)
            assert again.error == "" and again.output_ids == first.output_ids
            assert again.moved_pages == len(A) // PS
            assert user.check_idle().ok
    finally:
        stop.set()
        admin.close()
        for p in procs:
            p.stop(signal.SIGKILL)
        loader.join(10)
