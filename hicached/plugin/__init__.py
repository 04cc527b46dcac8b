"""Engine plugins: thin adapters from an inference engine's storage API to a hicached ``Client``.

- ``hicached.plugin.sglang.HicachedStorage``: SGLang's HiCache L3 storage backend, loaded with
  ``--hicache-storage-backend dynamic`` (see that module for the extra_config).
- ``hicached.plugin.sessions``: the rank's pools and one daemon session (``Client``) per thread.
- ``hicached.plugin.pools``: which SGLang pools TP ranks share; zero-byte pools as marker pages.
- ``hicached.plugin.namespace``: how an engine rank's identity becomes a daemon namespace.
- ``hicached.plugin.health``: the plugins' counters, once-per-episode logging and metrics.

Nothing here imports an engine at package import time; ``sglang`` imports SGLang's storage ABC
when SGLang is installed (``_sglang_compat``) and works as a plain class otherwise.
"""
