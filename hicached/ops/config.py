"""The daemon's config, where it was first defined: ``hicached.daemon.config`` re-exported (the
daemon owns its config; ``ops`` imports the daemon, never the reverse)."""

from hicached.daemon.config import (  # noqa: F401 - re-exported
    OTHER_ENV,
    SECRET_KEYS,
    STORE_ENV_NAMES,
    STORE_ENV_PREFIXES,
    DaemonConfig,
    absolute_ipc,
    load_config,
    parse_options,
    read_config_table,
)
from hicached.settings import WRITE_POLICIES  # noqa: F401 - re-exported
