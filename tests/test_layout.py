"""The layout is the architecture: the engine side (``hicached/client/``) never imports the daemon
side (``hicached/daemon/``, ``hicached/backends/``, ``hicached/ops/``) and the reverse, and the
contract both sides share (the modules at the top of ``hicached/``) imports neither. Arrows point
down only: ``ops/`` may import ``daemon/``, never the reverse; ``client/`` imports ``kernels/``,
never the reverse. And no module of ``daemon/`` reads another object's underscore fields. Read
from every module's source (ast), so a new import across the line fails here, not in a review."""

import ast
import importlib.util
import pathlib
import re

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
    assert "hicached.protocol" in imports(MODULES["hicached.client.connection"])
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


# ------------------------------------------------------------ arrows down only
# Inside a side, some folders sit above others: ``ops/`` (the CLI, the service, the config file)
# builds the daemon and may import it, never the reverse; ``kernels/`` (page copies, ``PageIO``)
# sits under ``client/``, which imports it, never the reverse.
REFUSED_ARROWS = (
    ("hicached.daemon", "hicached.ops", "the daemon is built by ops/, not the reverse"),
    ("hicached.kernels", "hicached.client", "the client imports the kernels, not the reverse"),
)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(modules: dict[str, pathlib.Path] = MODULES,
                   arrows=REFUSED_ARROWS) -> list[str]:
    """Every import of ``modules`` that points up a refused arrow: ``(lower, upper, why)``
    refuses a module under ``lower`` importing one under ``upper``. Sorted, one line each."""
    bad = []
    for name, path in modules.items():
        for imp in sorted(imports(path, name)):
            if imp not in MODULES and imp.rpartition(".")[0] in MODULES:
                continue  # ``from hicached.x import Name``: the module x is counted
            for lower, upper, why in arrows:
                if _under(name, lower) and _under(imp, upper):
                    bad.append(f"{name} imports {imp} ({why})")
    return sorted(set(bad))


def test_kernels_never_import_client():
    assert [b for b in upward_imports() if b.startswith("hicached.kernels")] == []


def test_daemon_never_imports_ops():
    bad = [b for b in upward_imports() if b.startswith("hicached.daemon")]
    assert not bad, f"{len(bad)} imports of ops/ from daemon/:\n" + "\n".join(bad)


def test_an_upward_import_is_caught(tmp_path):
    # planted: a kernel importing the client, a daemon module importing ops; an ops module
    # importing the daemon is the allowed direction
    kernel = tmp_path / "kernel.py"
    kernel.write_text("from hicached.client.hostpool import HostPool\n")
    daemon = tmp_path / "daemon.py"
    daemon.write_text("def f():\n    from hicached.ops import config\n    return config\n")
    ops = tmp_path / "ops.py"
    ops.write_text("import hicached.daemon.server\n")
    modules = {"hicached.kernels.planted": kernel, "hicached.daemon.planted": daemon,
               "hicached.ops.planted": ops}
    assert upward_imports(modules) == [
        "hicached.daemon.planted imports hicached.ops (the daemon is built by ops/, not the "
        "reverse)",
        "hicached.daemon.planted imports hicached.ops.config (the daemon is built by ops/, not "
        "the reverse)",
        "hicached.kernels.planted imports hicached.client.hostpool (the client imports the "
        "kernels, not the reverse)",
    ]


# ------------------------------------------------------------ objects keep their fields
# A collaborator reads another object through its public methods or a narrow view, never its
# underscore fields: in ``hicached/daemon/``, ``x._y`` is refused unless ``x`` is ``self``,
# ``cls``, ``super()`` or a module the file imports (``os._exit``, ``sys._getframe``).
OWN = frozenset({"self", "cls"})


def _is_module(name: str) -> bool:
    if name in MODULES:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def imported_modules(tree: ast.AST) -> set[str]:
    """The names a module's imports bind to modules (``import a.b`` binds ``a``; ``from a
    import b`` binds ``b`` when ``a.b`` is a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(a.asname or a.name for a in node.names
                         if _is_module(f"{node.module}.{a.name}"))
    return names


def foreign_underscores(modules: dict[str, pathlib.Path], package: str = "hicached.daemon"
                        ) -> list[str]:
    """Every ``x._y`` (read or written; ``__dunder__`` names excepted) in the modules under
    ``package`` whose ``x`` is not ``self``, ``cls``, ``super()`` nor an imported module: one
    ``module:line: x._y`` each, in module and line order."""
    bad: list[tuple[str, int, str]] = []
    for name, path in modules.items():
        if not _under(name, package):
            continue
        tree = ast.parse(path.read_text(), str(path))
        own = OWN | imported_modules(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") and attr.endswith("__"):
                continue
            x = node.value
            if isinstance(x, ast.Name) and x.id in own:
                continue
            if (isinstance(x, ast.Call) and isinstance(x.func, ast.Name)
                    and x.func.id == "super"):
                continue
            bad.append((name, node.lineno, f"{name}:{node.lineno}: {ast.unparse(x)}.{attr}"))
    return [line for _, _, line in sorted(bad)]


def test_no_daemon_module_reads_another_objects_underscore_fields():
    bad = foreign_underscores(MODULES)
    assert not bad, (f"{len(bad)} reads of another object's underscore fields in daemon/:\n"
                     + "\n".join(bad))


def test_an_underscore_read_is_caught(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import os\n"
        "import hicached.protocol\n"
        "from hicached import protocol as P\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = other._theirs\n"             # line 6: other._theirs
        "        os._exit, P._x, hicached._y, super()._z, self.__class__\n"
        "        self.index._tstate += 1\n"                # line 8: self.index._tstate
        "    @classmethod\n"
        "    def g(cls, ix):\n"
        "        return cls._k, ix._slots[0], ix.__dict__\n"  # line 11: ix._slots
    )
    modules = {"hicached.daemon.planted": planted, "hicached.ops.planted": planted}
    assert foreign_underscores(modules) == [
        "hicached.daemon.planted:6: other._theirs",
        "hicached.daemon.planted:8: self.index._tstate",
        "hicached.daemon.planted:11: ix._slots",
    ]


# ------------------------------------------------------------ named modules exist
# Comments, docstrings and docs name modules by file (``leaseless.py``, ``daemon/l3/audit.py``);
# a rename that leaves the old name behind sends a reader to a file that is not there.
REPO = ROOT.parent
TEXT_ROOTS = ("hicached", "tests", "tools", "configs", "docs", "README.md")
# files of other projects the text names on purpose (SGLang's, vLLM's), and README's example
OTHER_FILES = frozenset({"first.py", "mla.py", "mamba.py", "dsa.py", "memory_pool_host.py"})
OWN_FOLDERS = frozenset({"hicached", "tests", "tools", "docs", "configs", "client", "daemon",
                         "kernels", "plugin", "engine", "ops", "backends", "l3", "hf3fs",
                         "mooncake", "pd", "vllm_tests"})
NAMED_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[A-Za-z_]\w*\.py)\b")


def text_files() -> list[pathlib.Path]:
    """The files whose text may name a module: this package, tests, tools, configs, docs."""
    found = []
    for name in TEXT_ROOTS:
        path = REPO / name
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += [p for p in sorted(path.rglob("*"))
                      if p.suffix in (".py", ".md", ".toml") and "__pycache__" not in p.parts]
    return found


def missing_files(files: list[pathlib.Path], existing: set[str]) -> list[str]:
    """``path:line: name.py`` for each file name in ``files``' text that no file in
    ``existing`` (base names) has, other projects' files and paths left out."""
    bad = []
    for path in files:
        if path.name == "test_layout.py":
            continue  # (its planted modules)
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in NAMED_FILE.finditer(line):
                named = m.group(1)
                folder, _, base = named.rpartition("/")
                if base in existing or base in OTHER_FILES:
                    continue
                if folder and folder.split("/")[0] not in OWN_FOLDERS:
                    continue  # another project's path (SGLang's mem_cache/..., vllm/v1/...)
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                bad.append(f"{where}:{i}: {named}")
    return bad


def _existing() -> set[str]:
    """Base names of this project's Python files (the package, tests, tools)."""
    return {p.name for d in ("hicached", "tests", "tools") for p in (REPO / d).rglob("*.py")}


def test_every_module_named_in_the_text_exists():
    bad = missing_files(text_files(), _existing())
    assert not bad, f"{len(bad)} names of modules that do not exist:\n" + "\n".join(bad)


def test_every_module_named_outside_the_daemon_exists():
    daemon_side = (ROOT / "daemon", ROOT / "ops")
    files = [p for p in text_files() if not any(p.is_relative_to(d) for d in daemon_side)]
    assert missing_files(files, _existing()) == []


def test_a_stale_module_name_is_caught(tmp_path):
    planted = tmp_path / "planted.md"
    planted.write_text("the get (``shared_get.py``), the table (client/table_exists.py),\n"
                       "SGLang's mem_cache/hicache_storage.py and a ``tier_audit.py``\n")
    assert [line.split(": ", 1)[1] for line in
            missing_files([planted], {"table_exists.py"})] == ["shared_get.py", "tier_audit.py"]
