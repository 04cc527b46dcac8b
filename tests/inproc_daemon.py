"""A real daemon served on a thread of the test process, for tests that look at its state: the
chains its index learnt (``chain``), read on its control loop (``Daemon.call``), since they are
not on the wire. Clients reach it over its ipc:// socket as they reach a ``hicached serve``."""

from __future__ import annotations

import contextlib
import gc
import os
import threading

from hicached.daemon.loop_gc import freeze_survivors
from hicached.daemon.server import Daemon
from hicached.daemon.sessions import namespace_digest
from hicached.daemon.config import load_config


class InprocDaemon:
    """``endpoint`` to connect to; ``chain(namespace, key)``: the daemon's
    ``PageIndex.chain`` of a key of a namespace (by name), asked on the control loop."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.endpoint = daemon.config.endpoint

    def chain(self, namespace: str, key: str) -> tuple[str | None, int]:
        ns = namespace_digest(namespace)
        return self.daemon.call(lambda: self.daemon.index.chain(ns, key))


@contextlib.contextmanager
def inproc_daemon(tmp_path, **overrides):
    """An ``InprocDaemon`` on ``ipc://<tmp_path>/inproc.sock``, stopped and its files removed
    at the end. The loop tunes the collector for a daemon process (``gc.freeze``, thresholds):
    that is undone here, so the rest of the test run sees its own settings."""
    cfg = load_config(None, {}, {"endpoint": f"ipc://{tmp_path}/inproc.sock",
                                 "state_dir": str(tmp_path / "inproc-state"),
                                 "l2_size": 16 << 20, "slab_size": 1 << 20, **overrides})
    thresholds = gc.get_threshold()
    daemon = Daemon(cfg)
    loop = threading.Thread(target=daemon.serve_forever, name="inproc-daemon", daemon=True)
    loop.start()
    try:
        yield InprocDaemon(daemon)
    finally:
        daemon.stop()
        loop.join(30)
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        if freeze_survivors in gc.callbacks:
            gc.callbacks.remove(freeze_survivors)
        for path in (cfg.arena_path, cfg.arena_path + ".presence", cfg.arena_path + ".meta"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
