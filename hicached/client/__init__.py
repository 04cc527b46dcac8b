"""The engine side: ``Client`` (SGLang's v2 storage calls over the daemon's socket and shared arena)
and what it builds on: host pools, gets with no lease, set-ahead slots, prefetch.

Nothing here imports ``hicached.daemon`` (``tests/test_layout.py`` holds that).
"""

__all__ = ["Client"]


def __getattr__(name: str):
    # ``from hicached.client import Client`` (SGLang operators have it in their configs) without
    # importing torch and zmq for code that only needs a module of this package.
    if name == "Client":
        from hicached.client.api import Client

        return Client
    raise AttributeError(f"module 'hicached.client' has no attribute {name!r}")
