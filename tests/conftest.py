import os
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
