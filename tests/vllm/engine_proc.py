"""A real vLLM engine (offline ``LLM``) in its own process, driven by the vLLM tests.

The tests start it with ``child`` in a process forked from a server that has imported vLLM
once (``vllm_harness.Engine``): importing vLLM takes 15-40 s here, building an engine of a tiny
model a few seconds. It also runs alone, reading commands on stdin::

    python engine_proc.py '{"model": DIR, "dtype": "bfloat16", "endpoint": "ipc://..." | null,
                            "extra": {...}, "kv_transfer_config": {...} | null,
                            "llm": {more keyword arguments of LLM(...)}}'

(``endpoint``: hicached's connector with ``extra`` as its extra config; ``kv_transfer_config``:
any other connector, as given, e.g. LMCache's for ``tools/bench_vllm.py``.)

Alone it reads one JSON command per stdin line and answers one line ``@@ {json}`` on stdout (vLLM
logs to stdout too: the reader skips every other line); under ``child`` commands and answers
are the same values over a ``multiprocessing`` connection::

    {"prompts": [[token ids], ...], "max_tokens": 8, "cache_salt": "x" | null}
        -> [{"cached": num_cached_tokens, "out": [token ids], "s": seconds}, ...]
           (one request at a time; "s": wall time of its generate call)
    {"reset": true}   -> true   (empties vLLM's own prefix cache)

Starts with ``"ready"`` once the engine is built; ends at EOF (the connection closed), shutting
the engine down first (the connector's shutdown logs its worker's summary). Greedy decoding,
eager mode, seed 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable


def build(cfg: dict):
    """The ``LLM`` that ``cfg`` (the dict above) describes."""
    from vllm import LLM

    kw = {}
    if cfg.get("kv_transfer_config"):
        kw["kv_transfer_config"] = cfg["kv_transfer_config"]
    elif cfg.get("endpoint"):
        extra = {"endpoint": cfg["endpoint"], "retry_interval_s": 0.2, "timeout_s": 3.0,
                 **cfg.get("extra", {})}
        kw["kv_transfer_config"] = {
            "kv_connector": "HicachedConnector", "kv_connector_module_path": "hicached.plugin.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return LLM(model=cfg["model"], dtype=cfg.get("dtype", "bfloat16"),
               max_model_len=cfg.get("max_model_len", 4096), enforce_eager=True, seed=0,
               gpu_memory_utilization=0.9, **cfg.get("llm", {}), **kw)


def serve(llm, recv: Callable[[], dict | None], send: Callable[[object], None]) -> None:
    """Answer commands from ``recv`` (None: the end) with ``send`` until the end, then shut the
    engine down."""
    from vllm import SamplingParams

    while (cmd := recv()) is not None:
        if cmd.get("reset"):
            send(bool(llm.reset_prefix_cache()))
            continue
        sp = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
        out = []
        for ids in cmd["prompts"]:
            prompt = {"prompt_token_ids": ids}
            if cmd.get("cache_salt"):
                prompt["cache_salt"] = cmd["cache_salt"]
            t0 = time.perf_counter()
            o = llm.generate([prompt], sp, use_tqdm=False)[0]
            out.append({"cached": o.num_cached_tokens or 0, "out": list(o.outputs[0].token_ids),
                        "s": time.perf_counter() - t0})
        send(out)
    llm.llm_engine.engine_core.shutdown()


def child(cfg: dict, conn, log_path: str, env: dict[str, str]) -> None:
    """The engine process's body under ``multiprocessing``: its stdout and stderr go to
    ``log_path``, ``env`` is set before vLLM reads it, commands come over ``conn``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    import torch

    # one compute thread, as vLLM sets for serving on CPU: in its in-process mode it cannot
    # (its OpenMP setup is the multiprocess executor's), and two threads spinning on a loaded
    # 2-core machine make a step 10-20x slower
    torch.set_num_threads(1)

    def recv():
        try:
            return conn.recv()
        except EOFError:
            return None

    llm = build(cfg)
    conn.send("ready")
    serve(llm, recv, conn.send)
    sys.stdout.flush()
    sys.stderr.flush()


def answer(value) -> None:
    sys.stdout.write("@@ " + json.dumps(value) + "\n")
    sys.stdout.flush()


def main() -> None:
    llm = build(json.loads(sys.argv[1]))
    answer("ready")
    lines = iter(sys.stdin)
    serve(llm, lambda: json.loads(next(lines, "null")), answer)


if __name__ == "__main__":
    main()
