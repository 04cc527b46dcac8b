"""The 3FS L3 backend (``backend.Hf3fsBackend``): pages in fixed-size slots of per-node segment
files on a shared mount, through usrbio where its binding exists and POSIX I/O otherwise."""

from hicached.backends.hf3fs.backend import Hf3fsBackend

__all__ = ["Hf3fsBackend"]
