"""Regression tests for defects the crash tests (test_crash_points.py, test_crash_random.py) found."""
import errno
import os

import pytest


def test_recreating_an_evicted_name_at_once_creates_the_file(kvfs_factory):
    """Found by test_crash_random: after ``kvfs-admin evict f`` the kernel still held f's
    dentry (entry_timeout), so open(f, O_CREAT) went to the evicted inode and failed with
    ENOENT for up to a second: an engine rewriting an evicted chunk got an error instead of
    a new file. Now the evicted inode answers ESTALE, and the kernel looks the name up again."""
    fs = kvfs_factory(size="256M", block_size="64K")
    fs.mkfs()
    fs.mount()
    for round_no in range(3):
        path = fs.mnt / "chunk"
        path.write_bytes(b"old" * 1000)
        os.stat(path)                                   # the kernel caches the entry and attributes
        fs.flush()
        out = fs.admin("evict", fs.mnt, path).stdout
        assert "1 file" in out, out
        with pytest.raises(FileNotFoundError):          # a plain open is a cache miss, not ESTALE
            os.open(path, os.O_RDONLY)
        path.write_bytes(b"new" * 1000)
        os.stat(path)
        fs.flush()
        fs.admin("evict", fs.mnt, path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)   # at once: no ENOENT
        try:
            assert os.write(fd, b"again") == 5
        finally:
            os.close(fd)
        assert path.read_bytes() == b"again"
        os.unlink(path)
    with pytest.raises(OSError) as exc:
        os.stat(fs.mnt / "chunk")
    assert exc.value.errno == errno.ENOENT
