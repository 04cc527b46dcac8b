"""``python -m hicached``: the ``hicached`` command (``hicached.ops.cli``)."""

import sys

from hicached.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
