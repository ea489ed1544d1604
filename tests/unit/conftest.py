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
import json
import os
import pathlib
import sys
from pathlib import Path

import pytest
import trio

import kvfs
from kvfs.namespace import ROOT_INO
from kvfsmount import MOUNT_FIXTURES

from .fuzzing import COUNTS, Image, summary
from .helpers import BS, DIR_MODE, mkfs, open_fs, pattern, running, write_file

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


# -- the fuzzers' base image (tests/unit/test_fuzz_format.py, test_child_check.py) -----------

async def _populate(fs, files):
    """Files in the root and in a subdirectory, a symlink, a hard link; half checkpointed."""
    async with running(fs, persist=False):
        sub = fs.ns.make(ROOT_INO, b"sub", DIR_MODE, 0, 0)
        for i, (path, data) in enumerate(files.items()):
            parent = sub if path.startswith(b"/sub/") else ROOT_INO
            ino = await write_file(fs.ns, parent, path.rsplit(b"/", 1)[1], data)
            if i == 1:
                fs.ns.link(ino, ROOT_INO, b"hardlink")
        fs.ns.make(ROOT_INO, b"symlink", 0o120777, 0, 0, target=b"sub/b")
        await fs.ns.flush_all()
        await fs.ns.checkpoint()
        ino = await write_file(fs.ns, ROOT_INO, b"after-checkpoint", files[b"/a"][:5000])
        fs.ns.make(ROOT_INO, b"dir-after", DIR_MODE, 0, 0)
        await fs.ns.flush_all()
        await fs.ns.commit()
    return ino


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = mkfs(tmp_path_factory.mktemp("fuzz"))
    files = {b"/a": pattern(1, 3 * BS + 123), b"/sub/b": pattern(2, BS), b"/sub/c": b"tiny",
             b"/empty": b""}
    fs = open_fs(path)
    trio.run(_populate, fs, files)
    sb = fs.store.sb
    fs.close()
    files[b"/hardlink"] = files[b"/sub/b"]
    files[b"/after-checkpoint"] = files[b"/a"][:5000]
    img = Image(path, sb, files)
    before = img.read(0, sb.data_off)
    yield img
    assert img.read(0, sb.data_off) == before, "an example left the image damaged"
    text = summary()
    print("\n" + text)
    if os.environ.get("KVFS_FUZZ_REPORT"):
        with open(os.environ["KVFS_FUZZ_REPORT"], "w") as f:
            json.dump({t: dict(c) for t, c in COUNTS.items()}, f, indent=1, sort_keys=True)
