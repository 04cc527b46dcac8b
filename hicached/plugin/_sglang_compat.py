"""Import SGLang's storage modules without running ``sglang/__init__.py`` when SGLang is not loaded.

Inside an SGLang server the package is already imported and this is a plain import. Outside one
(tests, tools, CPU CI with ``pip install --no-deps sglang``) a plain ``import sglang.srt...`` runs
``sglang/__init__.py``, which needs triton, PIL, IPython, aiohttp and more. The storage ABC does
not: ``sglang.srt`` and ``sglang.srt.mem_cache`` are namespace packages, and
``mem_cache/hicache_storage.py`` / ``mem_cache/storage/backend_factory.py`` import only torch and
``sglang.srt.environ`` (standard library). So, as engine-plugins.md §1.5(b) describes, a bare
package object is registered as ``sglang`` (its ``__path__`` found with ``find_spec``, which locates
without executing) and the wanted submodules are imported under it.

Consequence, by design: in a process where this shim ran, a later ``import sglang`` returns that
bare package (no ``sglang.Engine`` and friends). A process that wants all of SGLang imports it
before importing the plugin, and then the shim does nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

log = logging.getLogger(__name__)

HICACHE_STORAGE = "sglang.srt.mem_cache.hicache_storage"
BACKEND_FACTORY = "sglang.srt.mem_cache.storage.backend_factory"


def sglang_installed() -> bool:
    """Whether an ``sglang`` package can be found (nothing is imported)."""
    return importlib.util.find_spec("sglang") is not None


def import_sglang(module: str = HICACHE_STORAGE) -> types.ModuleType | None:
    """The SGLang submodule ``module``, or None when SGLang is not installed or the submodule
    cannot be imported without the rest of SGLang (logged)."""
    if module in sys.modules:
        return sys.modules[module]
    if "sglang" in sys.modules and sys.modules["sglang"] is None:
        return None  # import of sglang blocked (sys.modules entry None): treat as not installed
    if "sglang" in sys.modules:  # the real package (or our bare one): a normal import
        return importlib.import_module(module)
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    bare = types.ModuleType("sglang", "bare package registered by hicached's SGLang shim")
    bare.__path__ = list(spec.submodule_search_locations)
    bare.__spec__ = spec
    bare.__file__ = spec.origin
    sys.modules["sglang"] = bare
    try:
        return importlib.import_module(module)
    except ImportError as e:
        log.warning("cannot import %s without the rest of SGLang (%s); import sglang first", module,
                    e)
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            if name == "sglang" and sys.modules[name] is not bare:
                continue
            sys.modules.pop(name, None)
        return None
