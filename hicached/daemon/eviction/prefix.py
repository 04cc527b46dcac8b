"""``prefix``: keep the pages that can still give a hit, least recently used first.

``HybridPolicy`` (``hybrid.py``: the rules, the key tree of ``keytree.py``) with ``alpha`` 0: of
the candidates ``make_room`` scores (leaf segments and mid-chain states), the least recently
used goes; a page's value never weighs. ``--eviction-alpha`` does not apply to it.
"""

from __future__ import annotations

from hicached.daemon.eviction.hybrid import HybridPolicy


class PrefixPolicy(HybridPolicy):
    """``HybridPolicy`` whose score is recency alone (module docstring)."""

    name = "prefix"

    def __init__(self):
        super().__init__(0.0)

    def set_alpha(self, alpha: float) -> None:
        """Ignored: recency alone decides (``alpha`` stays 0)."""
