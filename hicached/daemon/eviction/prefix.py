"""``prefix``: keep the pages that can still give a hit, least recently used first.

``HybridPolicy`` (``hybrid.py``: the rules, the key tree of ``keytree.py``) with ``alpha`` 0,
fixed: of the candidates ``make_room`` scores (leaf segments and mid-chain states), the least
recently used goes; a page's value never weighs. ``--eviction-alpha`` does not apply to it.
"""

from __future__ import annotations

from hicached.daemon.eviction.hybrid import HybridPolicy


def prefix_policy() -> HybridPolicy:
    """A ``HybridPolicy`` named ``prefix`` whose score is recency alone (module docstring):
    ``alpha`` 0, which ``set_alpha`` leaves as it is."""
    return HybridPolicy(0.0, name="prefix", alpha_fixed=True)
