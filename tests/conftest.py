import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvfsmount import KvfsMount  # noqa: E402  (tests/ is on sys.path via rootdir conftest)


def pytest_configure(config):
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise pytest.UsageError("kvfs tests mount real FUSE filesystems: run them as root with /dev/fuse")


@pytest.fixture
def kvfs(tmp_path):
    """A freshly made 4 GiB sparse kvfs store, mounted; fsck must be clean at the end."""
    fs = KvfsMount(tmp_path)
    fs.mkfs()
    fs.mount()
    yield fs
    fs.teardown()


@pytest.fixture
def kvfs_factory(tmp_path):
    """Build a KvfsMount with custom size/options; the test mkfs's and mounts it."""
    made = []

    def make(name="fs", **kw):
        root = tmp_path / name
        root.mkdir()
        fs = KvfsMount(root, **kw)
        made.append(fs)
        return fs

    yield make
    for fs in made:
        fs.teardown()


@pytest.fixture
def shared_kvfs():
    """Mount factory: an allow_other kvfs whose root (mode 1777) every uid can reach."""
    made = []

    def make(*options, size="4G"):
        root = Path(tempfile.mkdtemp(prefix="kvfs-shared-", dir="/tmp"))
        os.chmod(root, 0o755)
        fs = KvfsMount(root, size=size, mount_options=["allow_other", *options])
        made.append((fs, root))
        fs.mkfs()
        fs.mount()
        os.chmod(fs.mnt, 0o1777)
        return fs

    yield make
    for fs, root in made:
        try:
            fs.teardown()
        finally:
            if not fs.mounted:
                shutil.rmtree(root, ignore_errors=True)
