"""ENOSPC from the data side, through a real mount: the writer hears it, the mount stays up.

Free space in holes too small for a block, and a host disk that fills under a
sparse store file. Found in the review of issue 7 (items 3 and 7); the metadata
side of running out of space is tests/test_metadata_exhaustion.py. The fixtures
end every test with a clean fsck.
"""
import errno
import os
import subprocess

import pytest

from filedata import pattern, write_file
from kvfsmount import KvfsMount

MiB = 1 << 20


# -- fragmented free space: ENOSPC goes to the writer --------------------------------------

def write_or_enospc(path, data, flags=os.O_TRUNC):
    """Write a whole file; return the errno if ENOSPC stopped it (at write or close)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        return exc.errno
    try:
        assert os.write(fd, data) == len(data)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        return exc.errno
    finally:
        os.close(fd)
    return 0


def test_fragmented_free_space_gives_enospc_to_the_writer_not_the_reader(kvfs_factory):
    fs = kvfs_factory(size="64M", mount_options=["eviction_policy=none"])   # ENOSPC, not eviction
    fs.mkfs()
    fs.mount()
    names = []
    for i in range(1000):
        name = fs.mnt / f"f{i:04d}"
        if write_or_enospc(name, pattern(i, 512 << 10)):
            break
        names.append(name)
    fs.flush()
    assert len(names) > 20, "the store should hold dozens of 512 KiB files"
    for name in names[::2]:
        os.unlink(name)
    fs.flush()
    st = os.statvfs(fs.mnt)
    big = pattern(99999, 4 * MiB)
    # 512 KiB holes with used neighbours: no room for a 1 MiB block. Either the writer
    # hears ENOSPC, or what it wrote is readable. Never a successful write that reads back
    # as ENOSPC (the bug), and never wrong bytes.
    if write_or_enospc(fs.mnt / "big", big) == 0:
        fs.flush()
        assert (fs.mnt / "big").read_bytes() == big
    else:
        assert st.f_bavail * st.f_frsize < 4 * MiB, "statfs promised room that writes do not get"
    # Rewriting the name with O_TRUNC works once there is room again, without a remount.
    for name in names[1::2][:8]:
        os.unlink(name)
    fs.flush()
    small = pattern(5, 2 * MiB)
    assert write_or_enospc(fs.mnt / "big", small) == 0
    fs.flush()
    assert (fs.mnt / "big").read_bytes() == small


# -- the host runs out under a sparse store: a failed flush never kills the daemon ----------

@pytest.mark.expect_errors(
    r"kvfs\.blockcache(\.\w+)?: flushing a block failed \(attempt \d\): device write at \d+ failed: No space left on device",
    r"kvfs\.namespace(\.\w+)?: inode \d+: writing back its content failed: flushing the file to the device failed",
)
def test_host_enospc_below_a_sparse_store_keeps_the_mount_up(tmp_path):
    """The store is a sparse file on a small tmpfs: the host runs out before kvfs does.

    mkfs gives the metadata regions real host space, so the journal can always
    commit the deletes that make room again.
    """
    host = tmp_path / "host"
    host.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80M", "tmpfs", str(host)], check=True)
    fs = KvfsMount(tmp_path, size="512M")
    fs.device = host / "store.kvfs"
    try:
        fs.mkfs()
        fs.mount("commit_interval=0.2")
        kept = pattern(1, 4 * MiB)
        write_file(fs.mnt / "kept", kept, fsync=True)
        failed_at = None
        for i in range(40):
            try:
                write_file(fs.mnt / f"fill{i}", pattern(100 + i, 4 * MiB), fsync=True)
            except OSError as exc:
                failed_at = (i, exc.errno)
                break
        assert failed_at is not None, "the 80 MiB host should fill before 160 MiB of files fit"
        assert failed_at[1] in (errno.ENOSPC, errno.EIO), failed_at
        assert fs.stats()["pid"] == fs.pid                # the daemon is still serving
        assert (fs.mnt / "kept").read_bytes() == kept
        for i in range(failed_at[0] + 1):
            if (fs.mnt / f"fill{i}").exists():
                os.unlink(fs.mnt / f"fill{i}")
        fs.flush()                                        # frees are discarded: the host has room again
        write_file(fs.mnt / "after", pattern(7, 2 * MiB), fsync=True)
        fs.umount()
        fs.assert_fsck_clean()
        fs.mount()
        assert (fs.mnt / "kept").read_bytes() == kept
        assert (fs.mnt / "after").read_bytes() == pattern(7, 2 * MiB)
    finally:
        fs.teardown()
        subprocess.run(["umount", "-l", str(host)], capture_output=True)
