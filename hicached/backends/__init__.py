"""L3 backends behind one small interface (``base.L3Backend``)."""

from hicached.backends.base import BACKENDS, L3Backend, NullBackend, create_backend

__all__ = ["BACKENDS", "L3Backend", "NullBackend", "create_backend"]
