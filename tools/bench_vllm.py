"""TTFT of a prompt whose 90 % prefix another vLLM engine process served before: recompute (no
connector) against hicached's connector and LMCache's multiprocess server, side by side in one
run, on the same vLLM engine configuration and locally built models.

    PYTHONPATH=. .venv-vllm/bin/python tools/bench_vllm.py [--models llama,qwen3_next]
        [--modes none,hicached,lmcache] [--tokens 4096] [--small]

Needs the vLLM environment (docs/vllm.md); ``lmcache`` mode needs ``pip install lmcache==0.5.6``
in it too (skipped, and said so, without). Per model and mode:

- none:     one engine; TTFT of the full prompt (everything recomputed), and of a prefix-sized
            prompt (the compute a writer does before it stores).
- hicached: a daemon; a writer engine serves the prefix (its pages stored), then a reader engine
            (another process, its own prefix cache empty) serves prefix + 10 % new tokens.
- lmcache:  the same against ``lmcache server`` (``LMCacheMPConnector``).

TTFT is the wall time of a one-token ``generate`` (each engine warms up on another prompt
first). "store" and "load per 1k" are the time the connector spent storing (the writer) and
loading (the reader), per 1000 tokens, as it logs it: hicached's worker at shutdown, LMCache's
server per transfer ("Stored / Retrieved N tokens in S seconds"). Models: a Llama of 8 layers, hidden 1024, and a
Qwen3-Next of 8 layers (4 gated delta net + 4 attention), random weights, local tokenizer
(``tests/vllm/tiny_models.py``). On a 2-core machine vLLM computes on one core, and the Llama
then takes about 100 s to recompute 4k tokens; ``--small`` (4 layers, hidden 256: several
seconds) is what docs/benchmarks.md reports from such a machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))

import tiny_models
from vllm_harness import Engine, tokens

MODELS = {
    "llama": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64},
    "qwen3_next": {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
                       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                       "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                       "linear_num_key_heads": 4, "linear_num_value_heads": 4},
}
SMALL = {"llama": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4},
         "qwen3_next": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LMCacheServer:
    """``lmcache server`` on loopback, as its docs run it on CPU (``vllm-connector.md``)."""

    def __init__(self, tmp: str):
        exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
        self.port, http = free_port(), free_port()
        self.log = open(os.path.join(tmp, "lmcache.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [exe, "server", "--host", "127.0.0.1", "--port", str(self.port), "--l1-size-gb", "2",
             "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--http-host",
             "127.0.0.1", "--http-port", str(http), "--chunk-size", "256"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.5)
        raise RuntimeError("lmcache server did not listen in 120 s")

    def config(self) -> dict:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port}}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# what the connectors log: hicached's worker at shutdown, LMCache's server per transfer
SAVES = (re.compile(r"hicached-vllm worker: saved (\d+) tokens in ([\d.]+) s"),
         re.compile(r"Stored (\d+) tokens in ([\d.]+) seconds"))
LOADS = (re.compile(r"hicached-vllm worker: .*loaded (\d+) tokens in ([\d.]+) s"),
         re.compile(r"Retrieved (\d+) tokens in ([\d.]+) seconds"))


def s_per_1k(log_path: str, patterns) -> float | None:
    """Seconds per 1000 tokens of the transfers a log reports (None: it reports none)."""
    with open(log_path, errors="replace") as f:
        text = f.read()
    pairs = [(int(n), float(t)) for rx in patterns for n, t in rx.findall(text)]
    moved = sum(n for n, _ in pairs)
    return sum(t for _, t in pairs) / moved * 1000 if moved else None


def have_lmcache() -> bool:
    return os.path.exists(os.path.join(os.path.dirname(sys.executable), "lmcache"))


def run_mode(mode: str, model: str, tmp: str, prefix: list[int], full: list[int],
             alone: list[list[int]]) -> dict:
    """Times of one mode (see the module docstring)."""
    length = len(full) + 256
    if mode == "none":
        e = Engine(tmp, f"{mode}", model, max_model_len=length, in_process=False)
        try:
            e.one(tokens(900, 300), max_tokens=1)
            ttft = e.one(full, max_tokens=1)["s"]
            compute = min(e.one(a, max_tokens=1)["s"] for a in alone)
            return {"ttft": ttft, "prefix_compute": compute, "cached": 0}
        finally:
            e.close()
    server = daemon = None
    try:
        if mode.startswith("hicached"):  # hicached-sync: "load_async": false
            from hicached.engine.demo import DaemonLauncher
            daemon = DaemonLauncher(l2_size="2GiB", slab_size="16MiB")
            kw = {"endpoint": daemon.endpoint,
                  "extra": {"load_async": False} if mode == "hicached-sync" else None}
        else:
            server = LMCacheServer(tmp)
            kw = {"kv_transfer_config": server.config()}
        w = Engine(tmp, f"{mode}-writer", model, max_model_len=length, in_process=False, **kw)
        try:
            w.one(tokens(901, 300), max_tokens=1)
            wrote = min(w.one(p, max_tokens=1)["s"] for p in (prefix, alone[0]))
        finally:
            w.close()
        r = Engine(tmp, f"{mode}-reader", model, max_model_len=length, in_process=False, **kw)
        try:
            r.one(tokens(902, 300), max_tokens=1)
            got = r.one(full, max_tokens=1)
        finally:
            r.close()
        logs = (w.log_path, r.log_path) if server is None else (server.log.name,) * 2
        return {"ttft": got["s"], "writer": wrote, "cached": got["cached"],
                "store": s_per_1k(logs[0], SAVES), "load": s_per_1k(logs[1], LOADS)}
    finally:
        if daemon is not None:
            daemon.close()
        if server is not None:
            server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,qwen3_next")
    ap.add_argument("--modes", default="none,hicached,lmcache")
    ap.add_argument("--tokens", type=int, default=4096, help="full prompt length")
    ap.add_argument("--small", action="store_true", help="small models (a smoke run)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    tmp = tempfile.mkdtemp(prefix="bench-vllm-")
    n_prefix = args.tokens * 9 // 10
    prefix = tokens(1, n_prefix)
    full = prefix + tokens(2, args.tokens - n_prefix)
    alone = [tokens(3, n_prefix), tokens(4, n_prefix)]  # prefix-sized prompts of their own
    rows = []
    try:
        for name in args.models.split(","):
            cfg = {**MODELS[name], **(SMALL[name] if args.small else {})}
            model = tiny_models.build(os.path.join(tmp, name), name, **cfg)
            res = {}
            for mode in args.modes.split(","):
                if mode == "lmcache" and not have_lmcache():
                    print(f"{name}: lmcache is not installed in this environment: skipped",
                          flush=True)
                    continue
                try:
                    res[mode] = run_mode(mode, model, tmp, prefix, full, alone)
                except (AssertionError, RuntimeError) as e:
                    why = [ln for ln in str(e).splitlines() if "Error" in ln] or [str(e)]
                    print(f"{name} {mode}: failed: " + "\n".join(why[-6:]), flush=True)
                    continue
                print(f"{name} {mode}: {res[mode]}", flush=True)
            base = res.get("none", {})
            for mode, r in res.items():
                store, load = (f"{r[k]:.4f}" if r.get(k) is not None else "" for k in
                               ("store", "load"))
                ratio = f"{r['ttft'] / base['ttft']:.2f}" if base else ""
                rows.append((name, mode, f"{r['ttft']:.3f}", ratio, str(r["cached"]), store, load))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nprompt {args.tokens} tokens, {n_prefix} of them served before by another process")
    head = ("model", "mode", "TTFT s", "x recompute", "cached tokens", "store s / 1k tokens",
            "load s / 1k tokens")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
