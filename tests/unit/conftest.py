"""The layer tests run in-process, as any user: no root, no FUSE, no mount.

tests/conftest.py asks for root and /dev/fuse only in the fixtures that mount a
real kvfs. This hook keeps that promise for the layer tests: a test under
tests/unit that asks for a mounting fixture, or a module here that imports the
mount harness, is a collection error, so it is noticed by whoever adds it
rather than by the first unprivileged run.

To see it for real, as root, run the layer tests as nobody:

    setpriv --reuid 65534 --regid 65534 --clear-groups \
        .venv/bin/python -m pytest tests/unit -p no:cacheprovider
"""
from pathlib import Path

import pytest

from kvfsmount import MOUNT_FIXTURES

HERE = Path(__file__).parent


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
