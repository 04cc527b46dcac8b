"""``extras.install_hint``: the install command for an extra that works where hicached came from
(hicached is not on the package index, so ``pip install 'hicached[engine]'`` never does)."""

import pathlib

import hicached
from hicached.extras import extra_requirements, install_hint

# the Requires-Dist lines of a hicached wheel (pyproject.toml's dependencies and extras)
REQUIRES = ["msgspec>=0.18", "torch", 'pytest>=8; extra == "test"',
            'transformers==5.23.0; extra == "engine"',
            "mooncake-transfer-engine-non-cuda; extra == 'mooncake'"]


def test_in_a_clone_the_hint_is_the_editable_install_of_that_clone():
    root = pathlib.Path(hicached.__file__).resolve().parent.parent  # this tree: a clone
    assert install_hint("engine") == f"pip install -e '{root}[engine]'"


def test_installed_from_a_wheel_the_hint_names_the_extras_packages(tmp_path):
    site = tmp_path / "site-packages" / "hicached" / "extras.py"  # no pyproject.toml above
    assert install_hint("engine", site, REQUIRES) == "pip install transformers==5.23.0"
    assert install_hint("mooncake", site, REQUIRES) == \
        "pip install mooncake-transfer-engine-non-cuda"
    assert install_hint("nosuch", site, REQUIRES) == \
        "pip install -e 'CLONE[nosuch]' (CLONE: a clone of hicached)"


def test_extra_requirements_read_only_that_extra():
    assert extra_requirements("test", REQUIRES) == ["pytest>=8"]
    assert extra_requirements("engine", ["transformers==5.23.0; extra == \"engine-x\""]) == []
    assert extra_requirements("engine", []) == []
