"""``demote``: ``hybrid``, and new pages of classes seldom read again go first (issue 48).

``HybridPolicy`` with ``ReuseClasses`` (``reuse.py``): in a namespace with no trailing pool, a
new page whose class (the call's new keys, the gap since the key it hangs from was used, its
depth) was read again less often than 5 % is demoted, ranked before every page that is not until
it is read. Not the default: through real daemons it gains 1.30x LRU at 2 % of Mooncake's
conversation trace, nothing at 5-25 %, and loses up to 4 % of LRU's hit rate at 5-10 % of the
synthetic one (docs/benchmarks.md, "Real traces").
"""

from __future__ import annotations

from hicached.daemon.eviction.hybrid import HybridPolicy
from hicached.daemon.eviction.reuse import ReuseClasses


def demote_policy(alpha: float = 1.0) -> HybridPolicy:
    """A ``HybridPolicy`` named ``demote`` that demotes new pages of classes seldom read again
    (module docstring): it owns a fresh ``ReuseClasses``."""
    return HybridPolicy(alpha, ReuseClasses(), name="demote")
