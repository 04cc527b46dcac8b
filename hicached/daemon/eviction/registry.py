"""The ``--eviction`` names: one line per policy, and ``module:Class`` for one out of tree.

An unknown name raises ``ValueError`` listing the valid ones. An out-of-tree policy is named
``package.module:Class`` (as an L3 backend is, ``backends/base.py``): the class must subclass
``EvictionPolicy`` and take no constructor argument (``set_alpha`` gets ``--eviction-alpha``).
"""

from __future__ import annotations

import importlib

from hicached.daemon.eviction.demote import DemotePolicy
from hicached.daemon.eviction.hybrid import HybridPolicy
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.eviction.lru import LruPolicy
from hicached.daemon.eviction.prefix import PrefixPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy,
    "prefix": PrefixPolicy,
    "hybrid": HybridPolicy,
    "demote": DemotePolicy,
}

EVICTIONS = tuple(POLICIES)  # the in-tree names, in the order the docs list them


def is_policy_name(name: str) -> bool:
    """A registry name, or ``package.module:Class`` naming an out-of-tree policy (its syntax:
    whether it loads is ``make_policy``'s question)."""
    return name in POLICIES or (":" in name and all(name.split(":", 1)))


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class ``--eviction name`` makes (ValueError: unknown, or cannot be loaded;
    TypeError: not an ``EvictionPolicy``)."""
    cls = POLICIES.get(name)
    if cls is not None:
        return cls
    if not is_policy_name(name):
        raise ValueError(f"eviction: {name!r} is not one of {', '.join(EVICTIONS)} "
                         "or 'package.module:Class'")
    module, attr = name.split(":", 1)
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"eviction: {name!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise TypeError(f"eviction: {name!r} is not an EvictionPolicy subclass")
    return cls


def make_policy(name: str, alpha: float = 1.0) -> EvictionPolicy:
    """A new policy ``name`` (``POLICIES``, or ``module:Class``), given ``alpha``
    (``--eviction-alpha``: ``set_alpha``)."""
    policy = policy_class(name)()
    policy.set_alpha(alpha)
    return policy
