"""Columns of the page index's records (``records.py``, the policies' arrays, ``fptable.py``):
numpy arrays whose memory is an anonymous mapping of their own.

A column grows by copying into a larger one (by an eighth, ``entry.GROW_MIN`` at least) and is
read in place through memoryviews. Taken from ``malloc`` (``np.zeros``), such arrays of 1-32
MiB land on the heap once glibc's mmap threshold has risen past them (it rises to the size of
each mapped block freed, up to 32 MiB): ``calloc`` then writes zeros over the whole capacity,
records never used included, and the old copies freed on each growth leave holes in the heap
that the next, larger arrays do not fit. At a million pages that cost ~40 bytes a page of
resident heap over the records in use (issue 24's target is 250 in all). A mapping of its own
is zeroed lazily by the kernel (capacity not yet used is not resident) and given back whole
when the column is freed.
"""

from __future__ import annotations

import mmap

import numpy as np

MAPPED_MIN = 1 << 16  # bytes from which a column gets a mapping of its own (below: malloc)


def zeros(shape: int | tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed, C-contiguous, writable array of ``shape`` and ``dtype``; from
    ``MAPPED_MIN`` bytes on, in an anonymous mapping of its own (the module docstring)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = count * dtype.itemsize
    if nbytes < MAPPED_MIN:
        return np.zeros(shape, dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype, count).reshape(shape)


def grown(old, n: int, dtype) -> np.ndarray:
    """A column of ``n`` items of ``dtype`` that starts with ``old``'s (an array or a
    memoryview of one; ``n`` >= its length)."""
    arr = zeros(n, dtype)
    if len(old):
        arr[:len(old)] = np.asarray(old)
    return arr
