"""The Mooncake Store L3 backend (``backend.MooncakeBackend``): pages move zero-copy between the
arena and the distributed store."""

from hicached.backends.mooncake.backend import MooncakeBackend

__all__ = ["MooncakeBackend"]
