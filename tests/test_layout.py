"""The layout is the architecture: the engine side (``hicached/client/``) never imports the daemon
side (``hicached/daemon/``, ``hicached/backends/``, ``hicached/ops/``) and the reverse, and the
contract both sides share (the modules at the top of ``hicached/``) imports neither. Read from
every module's imports (ast), so a new import across the line fails here, not in a review."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "hicached"
# entry points at the top that only forward to a folder (public paths kept for operators)
FORWARDERS = {"hicached.__main__", "hicached.flush_cache"}
CLIENT = ("hicached.client",)
DAEMON = ("hicached.daemon", "hicached.backends", "hicached.ops")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, name: str | None = None) -> set[str]:
    """Every hicached module ``path`` (module ``name``) imports, at any depth (lazy imports
    included)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            # ``from hicached import protocol`` names a module; ``from hicached import Client`` not
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m == "hicached" or m.startswith("hicached.")}


def side(module: str) -> str | None:
    if module.startswith(tuple(p + "." for p in CLIENT)) or module in CLIENT:
        return "client"
    if module.startswith(tuple(p + "." for p in DAEMON)) or module in DAEMON:
        return "daemon"
    if module.count(".") == 1 or module == "hicached":
        return "contract"
    return None  # kernels, plugin, engine: users of both sides


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def crossings(modules: dict[str, pathlib.Path] = MODULES) -> list[str]:
    bad = []
    for name, path in modules.items():
        if name in FORWARDERS:
            continue
        mine = side(name)
        for imp in sorted(imports(path, name)):
            theirs = side(imp)
            if imp not in MODULES and imp.rpartition(".")[0] in MODULES:
                continue  # ``from hicached.x import Name``: the module x was counted already
            if mine == "client" and theirs == "daemon" or mine == "daemon" and theirs == "client":
                bad.append(f"{name} ({mine} side) imports {imp} ({theirs} side)")
            if mine == "contract" and theirs in ("client", "daemon") and name != "hicached":
                bad.append(f"{name} (the shared contract) imports {imp} ({theirs} side)")
    return bad


def test_no_module_imports_across_the_sides():
    assert crossings() == []


def test_the_walk_sees_the_sides():
    # the check above is only worth something if it finds the modules and their imports
    sides = {side(m) for m in MODULES}
    assert {"client", "daemon", "contract", None} <= sides
    assert "hicached.daemon.server" in MODULES and "hicached.client.api" in MODULES
    assert "hicached.protocol" in imports(MODULES["hicached.client.api"])
    assert "hicached.daemon.l3.tier" in imports(MODULES["hicached.daemon.server"])


def test_a_crossing_is_caught(tmp_path):
    # a client module with a daemon import planted in it: the check must name the import
    planted = tmp_path / "api.py"
    planted.write_text((ROOT / "client" / "api.py").read_text()
                       + "\nfrom hicached.daemon.index import PageIndex\n")
    modules = {**MODULES, "hicached.client.api": planted}
    assert crossings(modules) == [
        "hicached.client.api (client side) imports hicached.daemon.index (daemon side)"]


@pytest.mark.parametrize("public", [
    "from hicached import Client, HostPool, PoolTransfer, PoolHitPolicy, PoolName",
    "from hicached import PoolTransferResult, HicachedError, ProtocolError",
    "from hicached.client import Client",
    "from hicached.plugin.sglang import HicachedStorage",
    "from hicached.backends.base import L3Backend, create_backend",
    "from hicached.backends.hf3fs import Hf3fsBackend",
    "from hicached.backends.mooncake import MooncakeBackend",
    "from hicached.backends.file import FileBackend",
    "from hicached.flush_cache import main",
])
def test_public_imports_keep_working(public):
    exec(public, {})


def test_backend_registry_names_resolve():
    from hicached.backends.base import BACKENDS

    for name, target in BACKENDS.items():
        module, _, cls = target.partition(":")
        assert getattr(__import__(module, fromlist=[cls]), cls).__name__ == cls, name
