"""Issue 7, item 6: what /.kvfs/by-hash serves."""
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from kvfsmount import KvfsMount

MiB = 1 << 20


@pytest.fixture
def shared_kvfs():
    """Mount factory: an allow_other kvfs whose root (mode 1777) every uid can reach."""
    made = []

    def make(*options):
        root = Path(tempfile.mkdtemp(prefix="kvfs-view-", dir="/tmp"))
        os.chmod(root, 0o755)
        fs = KvfsMount(root, mount_options=["allow_other", *options])
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


def by_hash(fs, key=""):
    return fs.mnt / ".kvfs" / "by-hash" / key


def key_of(path):
    return os.getxattr(path, "user.kvfs.key").decode()


# -- item 6: the view served content other than the one its key names --------------------

def rewrite_same_size(path, data):
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


def test_view_serves_its_key_after_a_rewrite_with_restored_mtime(shared_kvfs):
    fs = shared_kvfs()
    path = fs.mnt / "chunk"
    x, y = os.urandom(2 * MiB + 5), os.urandom(2 * MiB + 5)
    path.write_bytes(x)
    kx = key_of(path)
    assert by_hash(fs, kx).read_bytes() == x
    rewrite_same_size(path, y)
    assert path.read_bytes() == y
    ky = key_of(path)
    assert ky != kx
    assert by_hash(fs, ky).read_bytes() == y           # the review saw x here
    assert not by_hash(fs, kx).exists()
    assert by_hash(fs, ky).stat().st_ino != os.stat(path).st_ino


def test_open_view_descriptor_keeps_its_content(shared_kvfs):
    fs = shared_kvfs()
    path = fs.mnt / "chunk"
    x, y = os.urandom(3 * MiB + 7), os.urandom(3 * MiB + 7)
    path.write_bytes(x)
    kx = key_of(path)
    fd = os.open(by_hash(fs, kx), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == x[:4096]
        path.write_bytes(y)                            # a rewrite ...
        assert key_of(path) != kx
        fs.flush()                                     # ... made durable: x's blocks lose their refs
        fs.admin("drop-caches", fs.mnt)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # make the kernel ask the daemon again
        assert os.pread(fd, len(x), 0) == x            # the review saw y here
        os.unlink(path)
        fs.flush()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, len(x), 0) == x
        assert os.fstat(fd).st_size == len(x)
    finally:
        os.close(fd)
    assert not by_hash(fs, kx).exists()
    deadline = time.monotonic() + 10                   # the kernel sends RELEASE after close returns
    while fs.stats()["used_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fs.stats()["used_bytes"] == 0              # closing the view let go of x's blocks


def test_view_of_gone_content_is_enoent(shared_kvfs):
    fs = shared_kvfs()
    path = fs.mnt / "chunk"
    x, y = os.urandom(MiB), os.urandom(MiB)
    path.write_bytes(x)
    kx = key_of(path)
    view = by_hash(fs, kx)
    assert view.stat().st_size == len(x)               # the kernel now holds a dentry for it
    path.write_bytes(y)
    assert key_of(path) != kx                          # y is recorded: x is gone
    with pytest.raises(FileNotFoundError):
        open(view, "rb")                               # the review read y here (cached dentry)
    with pytest.raises(FileNotFoundError):
        view.stat()
    assert kx not in os.listdir(by_hash(fs))
    ky = key_of(path)
    assert by_hash(fs, ky).read_bytes() == y
    os.unlink(path)
    with pytest.raises(FileNotFoundError):
        by_hash(fs, ky).stat()

