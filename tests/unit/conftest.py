"""Unit-test guard: every ``kvfs`` module a test uses comes from this checkout.

An editable install of another checkout (a shared virtual environment) maps
``kvfs.*`` names that this tree does not define to *that* tree's files, so a
test importing a module that was renamed here (``kvfs.format``,
``kvfs.extents``) would quietly exercise stale code. Fail instead.
"""
import pathlib
import sys

import pytest

import kvfs

KVFS_DIR = pathlib.Path(kvfs.__file__).resolve().parent


def _foreign_kvfs_modules():
    foreign = []
    for name, module in list(sys.modules.items()):
        if name != "kvfs" and not name.startswith("kvfs."):
            continue
        path = getattr(module, "__file__", None)
        if path is None:
            continue
        if not pathlib.Path(path).resolve().is_relative_to(KVFS_DIR):
            foreign.append(f"{name} from {path}")
    return foreign


@pytest.fixture(autouse=True)
def _kvfs_modules_from_this_checkout():
    yield
    foreign = _foreign_kvfs_modules()
    assert not foreign, f"kvfs modules loaded from outside {KVFS_DIR}: {foreign}"
