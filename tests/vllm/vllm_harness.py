"""Real vLLM engines for the connector's tests: each ``Engine`` is its own process
(``engine_proc.py``), as separate vLLM instances on one node are. The tests skip unless vLLM is
installed in the interpreter running them (the README's second test command builds that
environment: ``docs/vllm.md``).

Importing vLLM takes 15-40 s on this 2-core machine, more than building an engine of a tiny model,
and a default offline engine is three processes that each import it (the ``LLM`` front end, the
engine core, a worker). So the engines are processes forked from one ``multiprocessing``
forkserver that has imported vLLM once per session, and an engine of one rank runs its engine core
and worker in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): the
connector's scheduler and worker sides are two instances in one process, as in vLLM's own
in-process mode. Engines with tensor parallelism keep vLLM's worker processes (spawned, one per
rank): there the connector's metadata crosses processes as in ``vllm serve``.
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing
import os
import queue
import random
import sys
import threading

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:  # (engine_proc is pickled by name into the forkserver's children)
    sys.path.insert(0, HERE)
import engine_proc  # noqa: E402 - needs HERE on sys.path; imports no vLLM itself

# (tests/ is on sys.path, where this directory would pass for a "vllm" namespace package)
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin not in (None, "namespace")
START_TIMEOUT_S = 240  # an engine starts in 5-15 s here; far more on a loaded 2-core machine
CALL_TIMEOUT_S = 240
# what the forkserver imports once, for every engine forked from it
PRELOAD = ["engine_proc", "vllm.entrypoints.llm", "vllm.v1.engine.core",
           "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama",
           "hicached.plugin.vllm"]


@functools.cache
def _context():
    """The forkserver context, its preload set on first use (the server starts on the first
    process started from it and ends with the test session)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def tokens(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids of the tiny models' vocabulary (no special tokens)."""
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


class Engine:
    """One vLLM engine process; ``generate`` / ``reset`` talk to it over a pipe. ``start=False``
    leaves the waiting for its start to ``ready()``, so that several engines start at once.
    ``in_process=False``: vLLM's default processes (an engine core and workers of their own,
    spawned, each importing vLLM), as ``vllm serve`` runs; for timings that must match it."""

    def __init__(self, tmp, name: str, model: str, endpoint: str | None = None,
                 dtype: str = "bfloat16", extra: dict | None = None,
                 kv_transfer_config: dict | None = None, max_model_len: int = 4096,
                 llm_args: dict | None = None, env: dict | None = None, start: bool = True,
                 in_process: bool = True):
        self.name = name
        self.log_path = os.path.join(str(tmp), f"vllm-{name}.log")
        own = {"distributed_executor_backend": "uni"} if in_process else {}
        cfg = {"model": model, "dtype": dtype, "endpoint": endpoint,
               "extra": {"model_name": "tiny", **(extra or {})},
               "kv_transfer_config": kv_transfer_config, "max_model_len": max_model_len,
               "llm": {**own, **(llm_args or {})}}
        env = {"VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1", **(env or {}),
               "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                             if p)}
        ctx = _context()
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=engine_proc.child, name=f"vllm-{name}",
                                args=(cfg, theirs, self.log_path, env))
        self.proc.start()
        theirs.close()
        self._answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._ready = False
        if start:
            self.ready()

    def ready(self) -> Engine:
        """Wait until the engine is built; returns it."""
        if not self._ready:
            try:
                assert self._wait(START_TIMEOUT_S) == "ready"
            except BaseException:
                self.close()
                raise
            self._ready = True
        return self

    def _read(self) -> None:
        while True:
            try:
                self._answers.put(self._conn.recv())
            except (EOFError, OSError):
                break
        self._answers.put(EOFError)

    def _wait(self, timeout_s: float):
        try:
            got = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"engine {self.name} did not answer in {timeout_s} s; "
                                 f"log: {self.tail()}") from None
        if got is EOFError:
            raise AssertionError(f"engine {self.name} exited ({self.proc.exitcode}); "
                                 f"log: {self.tail()}")
        return got

    def _ask(self, cmd: dict):
        self._conn.send(cmd)
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
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        errors = [ln for ln in text.splitlines() if "Error" in ln][-8:]
        return "\n".join(errors) + "\n...\n" + text[-n:]

    def close(self) -> None:
        """End the engine (None, the end of its commands; killed after 60 s) and close the
        pipe."""
        if self._conn.closed:
            return
        try:
            self._conn.send(None)
        except OSError:  # it died: the pipe is broken
            pass
        self.proc.join(60)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        self._reader.join(30)  # (EOF once the process is gone)
        self._conn.close()


def start_all(*engines: Engine) -> tuple[Engine, ...]:
    """Wait for engines made with ``start=False``; if one fails, close them all."""
    try:
        for e in engines:
            e.ready()
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


MODELS = {"llama": ("llama", {}), "llama_other": ("llama", {"rms_norm_eps": 1e-3}),
          "qwen3_next": ("qwen3_next", {}), "granite": ("granitemoehybrid", {})}


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny local models: "llama", "llama_other" (same shapes, another rms_norm_eps: only the
    config tells them apart), "qwen3_next" (hybrid: gated delta net + attention), "granite"
    (Granite-4 hybrid: Mamba2 + attention). Built in a process forked from the engines'
    forkserver, where torch and transformers are imported already."""
    import tiny_models

    root = tmp_path_factory.mktemp("models")
    out = {name: str(root / name) for name in MODELS}
    proc = _context().Process(target=tiny_models.build_all,
                              args=({out[name]: spec for name, spec in MODELS.items()},))
    proc.start()
    proc.join(START_TIMEOUT_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, f"building the tiny models failed ({proc.exitcode}): see above"
    return out
