"""Page copies between engine host pools and arena slots.

- ``reference``: plain-torch, page-by-page definition of the arena page format (the spec).
- ``cpu``: fast torch copies over page-major views of a pool's tensors (``PageCopier``).
- ``pageio``: ``PageIO``, the interface every page path implements (the client's and ``cuda``'s).
- ``pointers``: ``memmove`` of SGLang ``get_page_buffer_meta`` segments (``SegmentPlan``).

``hicached.client.hostpool.make_page_io`` picks among them for a given pool. Nothing here imports
``hicached.client`` (``tests/test_layout.py`` holds that).
"""

from hicached.kernels.cpu import PageCopier, page_major_parts
from hicached.kernels.pointers import SegmentPlan, mha_layer_first_order

__all__ = ["PageCopier", "SegmentPlan", "mha_layer_first_order", "page_major_parts"]
