"""What to install for an optional part of hicached (an extra of ``pyproject.toml``: ``engine``,
``mooncake``, ...), in the form that works where this hicached came from. hicached is not on the
package index, so ``pip install 'hicached[engine]'`` does not: in a clone it is
``pip install -e 'CLONE[engine]'``; elsewhere (installed from a wheel built from a clone) the
extra's own packages, as the installed package's metadata lists them."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shlex
from collections.abc import Sequence

_HERE = pathlib.Path(__file__).resolve()


def install_hint(extra: str, module_file: pathlib.Path = _HERE,
                 requires: Sequence[str] | None = None) -> str:
    """The ``pip install`` command that brings ``extra``'s packages. ``module_file``: where the
    hicached package is (a clone when its folder's parent holds ``pyproject.toml``);
    ``requires``: the installed distribution's requirements (default: its metadata)."""
    root = module_file.parent.parent
    if (root / "pyproject.toml").is_file() and (root / "hicached").is_dir():
        return f"pip install -e '{root}[{extra}]'"
    packages = extra_requirements(extra, requires)
    if packages:
        return "pip install " + " ".join(shlex.quote(p) for p in packages)
    return f"pip install -e 'CLONE[{extra}]' (CLONE: a clone of hicached)"


def extra_requirements(extra: str, requires: Sequence[str] | None = None) -> list[str]:
    """The requirements (``transformers==5.23.0``) that ``extra`` adds, from ``requires`` (the
    distribution's ``Requires-Dist`` lines; default: the installed hicached's, none when it is
    not installed)."""
    if requires is None:
        try:
            requires = importlib.metadata.requires("hicached") or []
        except importlib.metadata.PackageNotFoundError:
            requires = []
    marker = re.compile(r"""\bextra\s*==\s*["']""" + re.escape(extra) + r"""["']""")
    return [req.split(";", 1)[0].strip() for req in requires
            if ";" in req and marker.search(req.split(";", 1)[1])]
