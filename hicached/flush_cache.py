"""``python -m hicached.flush_cache --url URL``: the path SGLang operators type (and keep in their
scripts) for ``hicached.ops.flush_cache``."""

import sys

from hicached.ops.flush_cache import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
