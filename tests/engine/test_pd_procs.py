"""PD as a user runs it: ``python -m hicached.engine.pd`` prefill and decode processes on one real
daemon. Outputs equal a non-disaggregated engine's; a full-prefix hit moves no KV page; a second
decode process finds the first one's generated tokens through L2; a SIGKILLed prefill fails the decode's next request cleanly (timeout) and the decode passes its
leak check; the decode stops on SIGTERM with status 0."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import hicached
from hicached.engine.config import EngineConfig
from hicached.engine.engine import Engine
from hicached.engine.models import load_model
from hicached.engine.pd.protocol import logits_rows
from hicached.engine.pd.server import PDClient

pytest.importorskip("transformers", reason="the reference engine needs the engine extra")

PS = 8
A = torch.randint(0, 256, (43,), generator=torch.Generator().manual_seed(1)).tolist()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hicached.__file__)))


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(extra=("--l3-backend", "none"))


class Proc:
    def __init__(self, tmp, name, args):
        self.log = open(tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed by the test
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "hicached.engine.pd", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def output(self):
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout_s=120.0):
        end = time.monotonic() + timeout_s
        while "READY" not in self.output():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < end, self.output()
            time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def test_pd_processes(daemon, tmp_path):
    path = str(tmp_path / "ckpt")
    lm = load_model("qwen3_next", path=path)
    boot, front = f"ipc://{tmp_path}/boot.sock", f"ipc://{tmp_path}/front.sock"
    front2 = f"ipc://{tmp_path}/front2.sock"
    common = ["--model", "qwen3_next", "--model-path", path, "--page-size", str(PS),
              "--kv-pages", "64", "--state-slots", "24", "--track-interval", "16",
              "--debug-pools", "--hicache-storage-backend", "hicached",
              "--hicached-endpoint", daemon.endpoint, "--disaggregation-bootstrap-endpoint", boot]
    procs = [Proc(tmp_path, "prefill", ["--disaggregation-mode", "prefill", *common]),
             Proc(tmp_path, "decode", ["--disaggregation-mode", "decode", *common,
                                       "--disaggregation-decode-enable-radix-cache",
                                       "--disaggregation-timeout-s", "3",
                                       "--serve-endpoint", front]),
             Proc(tmp_path, "decode2", ["--disaggregation-mode", "decode", *common,
                                        "--disaggregation-decode-enable-radix-cache",
                                        "--serve-endpoint", front2])]
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
            p.log.close()
