"""The ``--eviction`` names: one line per policy, and ``module:Class`` for one out of tree.

Each name maps to a factory of no argument that makes a fresh policy: a class (``LruPolicy``,
``HybridPolicy``) or a function that configures one (``prefix.py``, ``demote.py``: a
``HybridPolicy`` with other parts or weights). An unknown name raises ``ValueError`` listing the
valid ones. An out-of-tree policy is named ``package.module:Class`` (as an L3 backend is,
``backends/base.py``; both load through ``hicached/classref.py``): the class must subclass
``EvictionPolicy`` and take no constructor argument (``set_alpha`` gets ``--eviction-alpha``).
"""

from __future__ import annotations

from collections.abc import Callable

from hicached.classref import is_class_ref, load_class
from hicached.daemon.eviction.demote import demote_policy
from hicached.daemon.eviction.hybrid import HybridPolicy
from hicached.daemon.eviction.interface import EvictionPolicy
from hicached.daemon.eviction.lru import LruPolicy
from hicached.daemon.eviction.prefix import prefix_policy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "prefix": prefix_policy,
    "hybrid": HybridPolicy,
    "demote": demote_policy,
}

EVICTIONS = tuple(POLICIES)  # the in-tree names, in the order the docs list them


def is_policy_name(name: str) -> bool:
    """A registry name, or ``package.module:Class`` naming an out-of-tree policy (its syntax:
    whether it loads is ``make_policy``'s question)."""
    return name in POLICIES or is_class_ref(name)


def policy_factory(name: str) -> Callable[[], EvictionPolicy]:
    """What makes ``--eviction name``'s policy: the registry's factory, or the out-of-tree
    class (ValueError: unknown, or cannot be loaded; TypeError: not an ``EvictionPolicy``)."""
    factory = POLICIES.get(name)
    if factory is not None:
        return factory
    if not is_policy_name(name):
        raise ValueError(f"eviction: {name!r} is not one of {', '.join(EVICTIONS)} "
                         "or 'package.module:Class'")
    return load_class(name, EvictionPolicy, "eviction:")


def make_policy(name: str, alpha: float = 1.0) -> EvictionPolicy:
    """A new policy ``name`` (``POLICIES``, or ``module:Class``), given ``alpha``
    (``--eviction-alpha``: ``set_alpha``)."""
    policy = policy_factory(name)()
    policy.set_alpha(alpha)
    return policy
