"""The layer tests run in-process, as any user: no root, no FUSE, no mount.

tests/conftest.py asks for root and /dev/fuse only in the fixtures that mount a
real kvfs. This hook keeps that promise for the layer tests: a test under
tests/unit that asks for a mounting fixture, or a module here that imports the
mount harness, is a collection error, so it is noticed by whoever adds it
rather than by the first unprivileged run.

To see it for real, as root, run the layer tests as nobody:

    setpriv --reuid 65534 --regid 65534 --clear-groups \
        .venv/bin/python -m pytest tests/unit -p no:cacheprovider

A second guard: every ``kvfs`` module a test uses comes from this checkout. An
editable install of another checkout (a shared virtual environment) maps ``kvfs.*``
names this tree does not define to *that* tree's files, so a test importing a module
renamed here would quietly exercise stale code. Fail instead.
"""
import pathlib
import sys
from pathlib import Path

import pytest

import kvfs
from kvfsmount import MOUNT_FIXTURES

HERE = Path(__file__).parent
KVFS_DIR = pathlib.Path(kvfs.__file__).resolve().parent


def pytest_collection_modifyitems(items):
    offenders = []
    for item in items:
        if HERE not in item.path.parents:
            continue
        used = sorted(set(getattr(item, "fixturenames", ())) & set(MOUNT_FIXTURES))
        if used:
            offenders.append(f"{item.nodeid} uses {', '.join(used)}")
        module = getattr(item, "module", None)
        if module is not None and "KvfsMount" in vars(module):
            offenders.append(f"{item.nodeid}: its module imports KvfsMount")
    if offenders:
        raise pytest.UsageError("layer tests in tests/unit must not mount (they run without root "
                                "or FUSE):\n  " + "\n  ".join(offenders))


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
