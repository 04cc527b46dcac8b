"""``python -m hicached``: the ``hicached`` command (``hicached.ops.cli``)."""

import sys

if __name__ == "__main__":
    from hicached.ops import interrupts

    interrupts.install()  # first: until it runs, a Ctrl-C is Python's (ops/interrupts.py)
    from hicached.ops.cli import main

    sys.exit(main())
