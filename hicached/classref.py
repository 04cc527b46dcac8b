"""``package.module:Class``: how an operator names a part kept out of tree (an L3 backend,
``backends/base.py``; an eviction policy, ``daemon/eviction/registry.py``), and how it is loaded.

Shared by both registries so that a name means the same and fails the same way in each. Imports
nothing of hicached (either side may import it)."""

from __future__ import annotations

import importlib
from typing import TypeVar

T = TypeVar("T")


def is_class_ref(name: str) -> bool:
    """Whether ``name`` has the form ``package.module:Class`` (both parts non-empty): its
    syntax only; whether it loads is ``load_class``'s question."""
    return ":" in name and all(name.split(":", 1))


def load_class(ref: str, base: type[T], what: str, name: str | None = None) -> type[T]:
    """The class ``ref`` (``package.module:Class``) names, a subclass of ``base``.

    ``what`` starts the errors (``"L3 backend"``, ``"eviction:"``), ``name`` is the name the
    operator gave (default ``ref``). ValueError: the module or the attribute cannot be loaded
    (the import's error quoted); TypeError: it is not a subclass of ``base``."""
    name = ref if name is None else name
    module, attr = ref.split(":", 1)
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {name!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{what} {name!r} is not an {base.__name__} subclass")
    return cls
