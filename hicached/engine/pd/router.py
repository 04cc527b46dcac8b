"""The ROUTER socket in front of an engine that both PD servers share (``PrefillServer``: the
bootstrap channel; ``FrontServer``: the users' channel). One thread owns the engine and the
socket: ``serve_forever`` (or ``poll_once`` from a test) reads what arrived, runs one engine
step and answers the requests it ended."""

from __future__ import annotations

import logging

import zmq

from hicached.engine.pd.protocol import encode

log = logging.getLogger(__name__)


class RouterServer:
    """A ROUTER bound at ``endpoint`` in front of ``engine``. Subclasses say what a frame means
    (``_on_frame``), what an ended request is answered (``_answer``) and what else each turn
    does (``_tick``); ``peers`` maps a request id to the identity that asked."""

    def __init__(self, engine, endpoint: str):
        self.engine, self.endpoint = engine, endpoint
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.peers: dict[str, bytes] = {}
        self._stop = False

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (from any thread)."""
        self._stop = True

    def serve_forever(self, idle_poll_ms: int = 50) -> None:
        while not self._stop:
            e = self.engine
            busy = e.waiting or e.running or getattr(e, "transferring", None)
            self.poll_once(0 if busy else idle_poll_ms)

    def poll_once(self, timeout_ms: int = 0) -> None:
        """Read what arrived (waiting up to ``timeout_ms``), ``_tick``, run one engine step."""
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            while True:
                try:
                    ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ValueError:  # not [identity, payload]
                    continue
                self._on_frame(ident, frame)
        self._tick()
        for req in self.engine.step():
            self._answer(req)

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        raise NotImplementedError

    def _answer(self, req) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        """Each turn's own work before the engine's step (none here)."""

    def _send(self, ident: bytes, msg) -> None:
        try:
            self.sock.send_multipart([ident, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone: it times out on its side
            log.warning("could not answer %s: %s", getattr(msg, "rid", type(msg).__name__), e)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
