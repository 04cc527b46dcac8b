"""Real vLLM engines for the connector's tests: each ``Engine`` is its own process
(``engine_proc.py``), as separate vLLM instances on one node are. The tests skip unless vLLM is
installed in the interpreter running them (the README's second test command builds that
environment: ``docs/vllm.md``)."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import random
import subprocess
import sys
import threading

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# (tests/ is on sys.path, where this directory would pass for a "vllm" namespace package)
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin not in (None, "namespace")
START_TIMEOUT_S = 240  # an engine starts in 20-40 s here; far more on a loaded 2-core machine
CALL_TIMEOUT_S = 240

def tokens(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids of the tiny models' vocabulary (no special tokens)."""
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


class Engine:
    """One vLLM engine process; ``generate`` / ``reset`` talk to it over its stdin/stdout."""

    def __init__(self, tmp, name: str, model: str, endpoint: str | None = None,
                 dtype: str = "bfloat16", extra: dict | None = None,
                 kv_transfer_config: dict | None = None, max_model_len: int = 4096,
                 llm_args: dict | None = None, env: dict | None = None):
        self.name = name
        self.log_path = os.path.join(str(tmp), f"vllm-{name}.log")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - open for the process's life
        cfg = {"model": model, "dtype": dtype, "endpoint": endpoint,
               "extra": {"model_name": "tiny", **(extra or {})},
               "kv_transfer_config": kv_transfer_config, "max_model_len": max_model_len,
               "llm": llm_args or {}}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {}),
               "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                             if p)}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "engine_proc.py"), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True)
        self._answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert self._wait(START_TIMEOUT_S) == "ready"

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._answers.put(json.loads(line[3:]))
            else:
                self._log.write(line.encode())
        self._answers.put(EOFError)

    def _wait(self, timeout_s: float):
        try:
            got = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"engine {self.name} did not answer in {timeout_s} s; "
                                 f"log: {self.tail()}") from None
        if got is EOFError:
            raise AssertionError(f"engine {self.name} exited ({self.proc.poll()}); "
                                 f"log: {self.tail()}")
        return got

    def _ask(self, cmd: dict):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._wait(CALL_TIMEOUT_S)

    def generate(self, prompts: list[list[int]], cache_salt: str | None = None,
                 max_tokens: int = 8) -> list[dict]:
        """Per prompt (one request at a time): {"cached": tokens vLLM did not compute,
        "out": greedy output token ids}."""
        return self._ask({"prompts": prompts, "cache_salt": cache_salt,
                          "max_tokens": max_tokens})

    def one(self, prompt: list[int], **kw) -> dict:
        return self.generate([prompt], **kw)[0]

    def reset(self) -> bool:
        return self._ask({"reset": True})

    def tail(self, n: int = 4000) -> str:
        """The end of the engine's log, after its last lines naming an error (a root cause
        is often far above the end)."""
        self._log.flush()
        with open(self.log_path, "rb") as f:
            text = f.read().decode(errors="replace")
        errors = [ln for ln in text.splitlines() if "Error" in ln][-8:]
        return "\n".join(errors) + "\n...\n" + text[-n:]

    def close(self) -> None:
        """End the engine (EOF on its stdin; killed after 60 s) and close its pipes."""
        try:
            self.proc.stdin.close()
        except OSError:  # it died: the pipe is broken
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(30)
        self.proc.stdout.close()
        self._log.close()


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny local models: "llama", "llama_other" (same shapes, another rms_norm_eps: only the
    config tells them apart), "qwen3_next" (hybrid: gated delta net + attention), "granite"
    (Granite-4 hybrid: Mamba2 + attention)."""
    sys.path.insert(0, HERE)
    import tiny_models

    root = tmp_path_factory.mktemp("models")
    out = {"llama": tiny_models.build(str(root / "llama"), "llama"),
           "llama_other": tiny_models.build(str(root / "llama_other"), "llama",
                                            rms_norm_eps=1e-3),
           "qwen3_next": tiny_models.build(str(root / "qwen3_next"), "qwen3_next"),
           "granite": tiny_models.build(str(root / "granite"), "granitemoehybrid")}
    return out
