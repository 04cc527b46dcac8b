"""The reference engine as a process: ``python -m hicached.engine.pd --disaggregation-mode ...``.

    prefill  binds --disaggregation-bootstrap-endpoint; computes prompts for decode engines and
             publishes their pages through hicached (``prefill.py``): visible in its daemon's
             L2 (--disaggregation-transfer l2, one node) or stored in L3 (l3: the decode's
             daemon shares the store, two nodes)
    decode   connects to the prefill's bootstrap endpoint; binds --serve-endpoint for users
             (``Generate`` -> ``Generated``); with --disaggregation-decode-enable-radix-cache it
             asks the prefill only for the pages past what its radix cache holds (``decode.py``)
    none     a plain engine behind --serve-endpoint (the non-disaggregated baseline)

Every process prints ``READY <mode>`` on stdout once its sockets are bound / connected. The
model: ``--model qwen3_next | deepseek_v32`` built tiny with ``--seed``, saved to (or loaded
from) ``--model-path``: engines that are to share pages must load the same checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import dataclass

import zmq

from hicached.engine.config import EngineConfig, add_engine_args, config_from_args
from hicached.engine.pd import protocol as M
from hicached.engine.pd.router import RouterServer
from hicached.engine.storage import TRANSFER_TIERS

MODES = ("prefill", "decode", "none")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PDConfig:
    """The PD flags (the engine's own are ``EngineConfig``)."""

    mode: str = "none"
    bootstrap_endpoint: str = ""
    serve_endpoint: str = ""
    decode_radix: bool = False
    timeout_s: float = 30.0
    transfer: str = "l2"  # prefill: pages visible in its daemon's L2, or stored in L3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown disaggregation mode {self.mode!r}; valid: {list(MODES)}")
        if self.mode != "none" and not self.bootstrap_endpoint:
            raise ValueError(f"--disaggregation-mode {self.mode} needs "
                             "--disaggregation-bootstrap-endpoint")
        if self.mode != "prefill" and not self.serve_endpoint:
            raise ValueError(f"--disaggregation-mode {self.mode} needs --serve-endpoint")
        if self.decode_radix and self.mode != "decode":
            raise ValueError("--disaggregation-decode-enable-radix-cache is for the decode mode")
        if self.timeout_s <= 0:
            raise ValueError(f"--disaggregation-timeout-s must be > 0, got {self.timeout_s}")
        if self.transfer not in TRANSFER_TIERS:
            raise ValueError(f"unknown --disaggregation-transfer {self.transfer!r}; valid: "
                             f"{list(TRANSFER_TIERS)}")


def make_engine(lm, config: EngineConfig, pd: PDConfig):
    """The engine for ``pd.mode`` (prefill: a ``PrefillEngine``, decode: a ``DecodeEngine``)."""
    if pd.mode == "prefill":
        from hicached.engine.pd.prefill import PrefillEngine
        return PrefillEngine(lm, config, transfer=pd.transfer)
    if pd.mode == "decode":
        from hicached.engine.pd.decode import DecodeEngine
        return DecodeEngine(lm, config, pd.bootstrap_endpoint, radix=pd.decode_radix,
                            timeout_s=pd.timeout_s)
    from hicached.engine.engine import Engine
    return Engine(lm, config)


class FrontServer(RouterServer):
    """``Generate`` / ``CheckIdle`` / ``GetUsage`` on a ROUTER in front of an engine (mode
    decode or none)."""

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = M.decode(frame, "engine")
        except M.PDProtocolError as e:
            log.warning("dropping a front frame: %s", e)
            return
        match msg:
            case M.Generate():
                try:
                    if msg.rid in self.peers:
                        raise ValueError(f"request id {msg.rid!r} is already in use")
                    self.engine.add_request(msg.prompt, msg.max_new_tokens, msg.rid)
                except ValueError as e:
                    self._send(ident, M.Generated(msg.rid, error=str(e)))
                    return
                self.peers[msg.rid] = ident
            case M.CheckIdle():
                try:
                    self.engine.check_idle()
                    self._send(ident, M.Checked(True))
                except Exception as e:  # noqa: BLE001 - the answer carries it
                    self._send(ident, M.Checked(False, f"{type(e).__name__}: {e}"))
            case M.GetUsage():
                self._send(ident, usage(self.engine))

    def _answer(self, req) -> None:
        ident = self.peers.pop(req.rid, None)
        if ident is None:
            return
        t, lb = req.transfer, req.loaded
        self._send(ident, M.Generated(
            req.rid, list(req.output_ids), M.logits_bytes(req.logits), req.error,
            req.ttft_s or 0.0, req.cached_tokens,
            t.decode_prefix_len if t is not None else 0,
            t.moved_pages if t is not None else 0, t.moved_states if t is not None else 0,
            lb.read_pages if lb is not None else 0, lb.read_states if lb is not None else 0,
            *((t.prefill_s, t.publish_s, t.load_s) if t is not None else ())))

def usage(engine) -> M.Usage:
    """An engine's device pools as the front channel reports them (``GetUsage``)."""
    kv, states, tree = engine.kv, engine.states, engine.tree
    page_bytes = kv.host.page_bytes + (engine.indexer.host.page_bytes
                                       if engine.indexer is not None else 0)
    return M.Usage(engine.page_size, kv.allocator.total, kv.allocator.available,
                   tree.kv_evictable + tree.kv_protected, page_bytes,
                   states.allocator.total if states is not None else 0,
                   states.allocator.available if states is not None else 0,
                   states.host.page_bytes if states is not None else 0)


class PDClient:
    """A user of an engine's front endpoint (one request at a time)."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def _roundtrip(self, msg, want: type):
        self.sock.send(M.encode(msg))
        while True:
            if not self.sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                raise TimeoutError(f"no answer to {type(msg).__name__} in {self.timeout_s}s")
            answer = M.decode(self.sock.recv(), "user")
            if isinstance(answer, want) and getattr(answer, "rid", None) == getattr(
                    msg, "rid", None):
                return answer

    def generate(self, rid: str, prompt: list[int], max_new_tokens: int = 8) -> M.Generated:
        return self._roundtrip(M.Generate(rid, list(prompt), max_new_tokens), M.Generated)

    def check_idle(self) -> M.Checked:
        return self._roundtrip(M.CheckIdle(), M.Checked)

    def usage(self) -> M.Usage:
        """The engine's device pools now (between requests: what its radix cache holds)."""
        return self._roundtrip(M.GetUsage(), M.Usage)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hicached.engine.pd",
                                description="the reference engine as a PD process")
    p.add_argument("--disaggregation-mode", dest="mode", choices=MODES, default="none")
    p.add_argument("--disaggregation-bootstrap-endpoint", dest="bootstrap_endpoint", default="",
                   help="the prefill's bootstrap socket (prefill binds, decode connects)")
    p.add_argument("--disaggregation-decode-enable-radix-cache", dest="decode_radix",
                   action="store_true", help="decode: ask the prefill only for the delta")
    p.add_argument("--disaggregation-timeout-s", dest="timeout_s", type=float, default=30.0)
    p.add_argument("--disaggregation-transfer", dest="transfer", choices=TRANSFER_TIERS,
                   default="l2", help="prefill: l2, the decode uses the same daemon (one "
                   "node); l3, the decode's daemon shares this daemon's L3 store (two nodes): "
                   "Ready waits until the pages are stored there")
    p.add_argument("--serve-endpoint", default="", help="decode / none: the users' socket")
    p.add_argument("--model", choices=("qwen3_next", "deepseek_v32"), default="qwen3_next")
    p.add_argument("--model-path", required=True, help="checkpoint dir (made if empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=1)
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        pd = PDConfig(args.mode, args.bootstrap_endpoint, args.serve_endpoint,
                      args.decode_radix, args.timeout_s, args.transfer)
        config = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from hicached.engine.models import load_model

    torch.set_num_threads(args.torch_threads)
    lm = load_model(args.model, seed=args.seed, path=args.model_path, device=config.device)
    engine = make_engine(lm, config, pd)
    if pd.mode == "prefill":
        from hicached.engine.pd.prefill import PrefillServer
        server = PrefillServer(engine, pd.bootstrap_endpoint)
    else:
        server = FrontServer(engine, pd.serve_endpoint)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"READY {pd.mode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        engine.close()
    return 0
