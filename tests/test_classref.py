"""``hicached/classref.py``: a ``package.module:Class`` name, checked and loaded the same way by
the eviction registry and the L3 backends' (each error names what was given)."""

from collections import OrderedDict

import pytest

from hicached.backends.base import create_backend
from hicached.classref import is_class_ref, load_class


def test_a_class_ref_is_a_module_and_a_name_both_non_empty():
    assert is_class_ref("collections:OrderedDict") and is_class_ref("a.b.c:D")
    assert not any(map(is_class_ref, ["collections", ":OrderedDict", "collections:", ""]))


def test_a_class_ref_loads_a_subclass_and_names_what_is_wrong():
    assert load_class("collections:OrderedDict", dict, "thing") is OrderedDict
    with pytest.raises(ValueError,
                       match=r"^thing 'mine' cannot be loaded: No module named 'no_such_mod'$"):
        load_class("no_such_mod:X", dict, "thing", "mine")
    with pytest.raises(ValueError, match=r"^thing 'collections:Nope' cannot be loaded: module "
                                         r"'collections' has no attribute 'Nope'$"):
        load_class("collections:Nope", dict, "thing")
    with pytest.raises(TypeError, match=r"^thing 'collections:deque' is not an int subclass$"):
        load_class("collections:deque", int, "thing")


def test_the_backend_registry_loads_through_it():
    with pytest.raises(TypeError, match=r"^L3 backend 'collections:OrderedDict' is not an "
                                        r"L3Backend subclass$"):
        create_backend("collections:OrderedDict")
    with pytest.raises(ValueError, match=r"^L3 backend 'no_such_mod:X' cannot be loaded"):
        create_backend("no_such_mod:X")
