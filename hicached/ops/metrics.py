"""The daemon's metrics, where they were first defined: ``hicached.daemon.metrics`` re-exported
(the daemon owns its metric definitions; ``ops`` imports the daemon, never the reverse)."""

from hicached.daemon.metrics import (  # noqa: F401 - re-exported
    OPS,
    Metrics,
    NullMetrics,
    make_metrics,
    stats_json,
)
