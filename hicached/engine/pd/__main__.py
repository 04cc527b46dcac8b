"""``python -m hicached.engine.pd --disaggregation-mode prefill | decode | none``."""

import sys

from hicached.engine.pd.server import main

sys.exit(main())
