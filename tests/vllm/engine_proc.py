"""A real vLLM engine (offline ``LLM``) in its own process, driven by the vLLM tests.

    python engine_proc.py '{"model": DIR, "dtype": "bfloat16", "endpoint": "ipc://..." | null,
                            "extra": {...}, "kv_transfer_config": {...} | null,
                            "llm": {more keyword arguments of LLM(...)}}'

(``endpoint``: hicached's connector with ``extra`` as its extra config; ``kv_transfer_config``:
any other connector, as given, e.g. LMCache's for ``tools/bench_vllm.py``.)

Reads one JSON command per stdin line and answers one line ``@@ {json}`` on stdout (vLLM logs
to stdout too: the tests skip every other line)::

    {"prompts": [[token ids], ...], "max_tokens": 8, "cache_salt": "x" | null}
        -> [{"cached": num_cached_tokens, "out": [token ids], "s": seconds}, ...]
           (one request at a time; "s": wall time of its generate call)
    {"reset": true}   -> true   (empties vLLM's own prefix cache)
    {"stats": true}   -> the connector counters of this process (scheduler side)

Starts with ``@@ "ready"`` once the engine is built. Greedy decoding, eager mode, seed 0.
"""

from __future__ import annotations

import json
import sys
import time


def answer(value) -> None:
    sys.stdout.write("@@ " + json.dumps(value) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kw = {}
    if cfg.get("kv_transfer_config"):
        kw["kv_transfer_config"] = cfg["kv_transfer_config"]
    elif cfg.get("endpoint"):
        extra = {"endpoint": cfg["endpoint"], "retry_interval_s": 0.2, "timeout_s": 3.0,
                 **cfg.get("extra", {})}
        kw["kv_transfer_config"] = {
            "kv_connector": "HicachedConnector", "kv_connector_module_path": "hicached.plugin.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}
    llm = LLM(model=cfg["model"], dtype=cfg.get("dtype", "bfloat16"),
              max_model_len=cfg.get("max_model_len", 4096), enforce_eager=True, seed=0,
              gpu_memory_utilization=0.9, **cfg.get("llm", {}), **kw)
    answer("ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("reset"):
            answer(bool(llm.reset_prefix_cache()))
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
        answer(out)


if __name__ == "__main__":
    main()
