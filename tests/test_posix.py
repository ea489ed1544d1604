"""The POSIX surface that engines rely on, through a real kvfs mount."""
import ctypes
import errno
import mmap
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from filedata import pattern, write_file
from kvfsmount import slow_writes

MiB = 1 << 20
libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE = 1
AT_FDCWD = -100


def renameat2(src, dst, flags):
    if libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def test_create_flags(kvfs):
    path = kvfs.mnt / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"abc")
    os.close(fd)
    with pytest.raises(FileExistsError):
        os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"def")
    os.close(fd)
    assert path.read_bytes() == b"abcdef"
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert path.read_bytes() == b""
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_odirect_round_trip_and_statfs(kvfs):
    st = os.statvfs(kvfs.mnt)
    assert st.f_bsize == 4096
    assert st.f_blocks * st.f_frsize == kvfs.stats()["capacity_bytes"]
    assert 0 < st.f_bavail <= st.f_blocks
    assert st.f_namemax == 255
    size = 4 * MiB
    buf = mmap.mmap(-1, size)
    payload = os.urandom(size)
    buf[:] = payload
    path = kvfs.mnt / "direct.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)   # LMCache's use_odirect form
    assert os.write(fd, buf) == size
    os.close(fd)
    out = mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    assert os.readv(fd, [out]) == size
    os.close(fd)
    assert out[:] == payload


def test_in_place_rewrite_at_any_offset(kvfs):
    path = kvfs.mnt / "rw"
    base = bytearray(os.urandom(3 * MiB + 17))
    path.write_bytes(base)
    with open(path, "r+b", buffering=0) as f:
        for off, n in [(0, 10), (MiB - 3, 7), (2 * MiB + 5, 4096), (3 * MiB + 10, 50)]:
            patch = os.urandom(n)
            f.seek(off)
            f.write(patch)
            base[off:off + n] = patch
            if off + n > len(base):
                pass
    assert path.read_bytes() == bytes(base)
    kvfs.flush()
    kvfs.remount()
    assert path.read_bytes() == bytes(base)


def test_truncate_and_sparse_reads(kvfs):
    path = kvfs.mnt / "t"
    data = os.urandom(2 * MiB + 100)
    path.write_bytes(data)
    os.truncate(path, MiB + 5)
    assert path.read_bytes() == data[:MiB + 5]
    os.truncate(path, 3 * MiB)
    assert path.read_bytes() == data[:MiB + 5] + bytes(3 * MiB - MiB - 5)
    with open(path, "r+b") as f:
        f.seek(5 * MiB)
        f.write(b"end")
    assert path.stat().st_size == 5 * MiB + 3
    got = path.read_bytes()
    assert got[:MiB + 5] == data[:MiB + 5] and got[-3:] == b"end" and got.count(0) >= 3 * MiB
    kvfs.remount()
    assert path.read_bytes() == got


def test_unlinked_open_file_stays_readable(kvfs):
    path = kvfs.mnt / "ghost"
    data = os.urandom(3 * MiB)
    path.write_bytes(data)
    kvfs.flush()
    used = kvfs.stats()["used_bytes"]
    with open(path, "rb", buffering=0) as f:
        os.unlink(path)
        assert not path.exists()
        assert f.read() == data
        kvfs.flush()
        assert kvfs.stats()["used_bytes"] == used       # still held by the open file
    deadline = time.monotonic() + 10
    while kvfs.stats()["used_bytes"] != used - 3 * MiB and time.monotonic() < deadline:
        kvfs.flush()                                     # the kernel's forget may lag the close
        time.sleep(0.1)
    assert kvfs.stats()["used_bytes"] == used - 3 * MiB


def test_rename_replaces_atomically_and_noreplace(kvfs):
    mnt = kvfs.mnt
    (mnt / "target").write_bytes(b"old")
    (mnt / "tmp.123").write_bytes(b"new contents")
    os.replace(mnt / "tmp.123", mnt / "target")
    assert (mnt / "target").read_bytes() == b"new contents"
    assert not (mnt / "tmp.123").exists()
    (mnt / "a").write_bytes(b"a")
    (mnt / "b").write_bytes(b"b")
    with pytest.raises(FileExistsError):
        renameat2(mnt / "a", mnt / "b", RENAME_NOREPLACE)
    renameat2(mnt / "a", mnt / "c", RENAME_NOREPLACE)
    assert (mnt / "c").read_bytes() == b"a"
    (mnt / "d1" / "sub").mkdir(parents=True)
    with pytest.raises(OSError) as err:
        os.rename(mnt / "d1", mnt / "d1" / "sub" / "x")
    assert err.value.errno == errno.EINVAL
    (mnt / "d2").mkdir()
    (mnt / "d2" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as err:
        os.rename(mnt / "d1", mnt / "d2")
    assert err.value.errno == errno.ENOTEMPTY
    os.rename(mnt / "d1", mnt / "d3")
    assert (mnt / "d3" / "sub").is_dir()
    kvfs.remount()
    assert (mnt / "target").read_bytes() == b"new contents"
    assert sorted(os.listdir(mnt)) == sorted([".kvfs", "target", "b", "c", "d2", "d3"])


def test_links_and_directories(kvfs):
    mnt = kvfs.mnt
    (mnt / "orig").write_bytes(b"payload")
    os.link(mnt / "orig", mnt / "hard")
    os.symlink("orig", mnt / "soft")
    assert os.readlink(mnt / "soft") == "orig"
    assert (mnt / "soft").read_bytes() == b"payload"
    assert (mnt / "orig").stat().st_nlink == 2
    assert (mnt / "orig").stat().st_ino == (mnt / "hard").stat().st_ino
    os.unlink(mnt / "orig")
    assert (mnt / "hard").read_bytes() == b"payload"
    (mnt / "dir").mkdir()
    with pytest.raises(OSError) as err:
        os.link(mnt / "dir", mnt / "dirlink")
    assert err.value.errno == errno.EPERM
    with pytest.raises(OSError) as err:
        os.rmdir(mnt / "hard")
    assert err.value.errno == errno.ENOTDIR
    with pytest.raises(IsADirectoryError):
        os.unlink(mnt / "dir")
    os.rmdir(mnt / "dir")
    os.mkfifo(mnt / "fifo")                      # a metadata-only inode, as on any filesystem
    kvfs.remount()
    assert (mnt / "hard").read_bytes() == b"payload"
    assert os.readlink(mnt / "soft") == "orig"
    assert stat.S_ISFIFO(os.lstat(mnt / "fifo").st_mode)


def test_attributes_persist(kvfs):
    path = kvfs.mnt / "attrs"
    path.write_bytes(b"x")
    os.chmod(path, 0o640)
    os.chown(path, 1234, 5678)
    os.utime(path, ns=(1_000_000_000_123, 2_000_000_000_456))
    kvfs.remount()
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert st.st_mtime_ns == 2_000_000_000_456
    assert st.st_atime_ns == 1_000_000_000_123


def test_permissions_are_enforced(kvfs):
    (kvfs.mnt / "private").write_bytes(b"secret")
    os.chmod(kvfs.mnt / "private", 0o600)
    os.chmod(kvfs.mnt, 0o755)
    code = ("import os, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n open(sys.argv[1] + '/private', 'rb')\nexcept PermissionError: pass\n"
            "else: sys.exit('read a 0600 root file')\n"
            "try:\n open(sys.argv[1] + '/new', 'wb')\nexcept PermissionError: pass\n"
            "else: sys.exit('created in a 0755 root directory')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(kvfs.mnt)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_posix_fallocate_fallback_is_cheap(kvfs):
    kvfs.flush()
    before = kvfs.stats()
    path = kvfs.mnt / "prealloc"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, 16 * MiB)     # kvfs has no fallocate: glibc writes zeros
        assert os.fstat(fd).st_size == 16 * MiB
        assert os.pread(fd, MiB, 3 * MiB) == bytes(MiB)
    finally:
        os.close(fd)
    kvfs.flush()
    after = kvfs.stats()
    assert after["used_bytes"] - before["used_bytes"] <= MiB       # zeros are holes, not blocks
    assert after["data_bytes_written"] == before["data_bytes_written"]
    kvfs.remount()
    assert path.stat().st_size == 16 * MiB
    assert path.read_bytes() == bytes(16 * MiB)


def test_a_large_flat_directory_lists_each_entry_once_while_entries_go(kvfs):
    """20,000 entries (the 100,000-entry figures are test_engine_patterns.py's and the
    metadata benchmark's): a listing returns each once, and removing entries while a
    listing goes on neither skips nor repeats the others."""
    d = kvfs.mnt / "flat"
    d.mkdir()
    n = 20_000
    for i in range(n):
        os.close(os.open(d / f"meta-llama@1@0@{i:x}@bfloat16.pt", os.O_WRONLY | os.O_CREAT, 0o644))
    names = os.listdir(d)
    assert len(names) == n and len(set(names)) == n
    victims = sorted(names)[-50:]
    with os.scandir(d) as it:
        seen = []
        for i, entry in enumerate(it):
            seen.append(entry.name)
            if i == 10:
                for victim in victims:
                    os.unlink(d / victim)
    survivors = set(names) - set(victims)
    assert len(seen) == len(set(seen))
    assert survivors <= set(seen)
    assert sorted(os.listdir(d)) == sorted(survivors)


def test_by_hash_view_is_read_only(kvfs):
    path = kvfs.mnt / "chunk"
    data = os.urandom(MiB + 1)
    path.write_bytes(data)
    key = os.getxattr(path, "user.kvfs.key").decode()
    view = kvfs.mnt / ".kvfs" / "by-hash" / key
    assert view.read_bytes() == data
    assert key in os.listdir(kvfs.mnt / ".kvfs" / "by-hash")
    with pytest.raises(OSError) as err:
        open(view, "r+b")
    assert err.value.errno in (errno.EROFS, errno.EACCES)
    with pytest.raises(OSError) as err:
        os.unlink(view)
    assert err.value.errno == errno.EROFS
    other = kvfs.mnt / "copy"
    other.write_bytes(data)
    assert os.getxattr(other, "user.kvfs.key").decode() == key


# -- mmap, FIFOs, sockets, device nodes, . and .. (issue 7, items 10-12) ------------------

def test_shared_mmap_of_a_file_with_dirty_blocks(kvfs_factory):
    fs = kvfs_factory(faults=slow_writes(2))
    fs.mkfs()
    fs.mount()
    data = pattern(1, 3 * MiB + 5)
    write_file(fs.mnt / "f", data)
    assert fs.stats()["dirty_bytes"] > 0, "the test needs blocks still dirty at the mmap"
    with open(fs.mnt / "f", "rb") as f, mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        assert m[:] == data


def test_writable_shared_mmap_is_durable_after_msync_and_after_munmap(kvfs):
    data = bytearray(pattern(2, 2 * MiB + 100))
    other = bytearray(data)
    write_file(kvfs.mnt / "synced", data)
    write_file(kvfs.mnt / "unmapped", other)
    fd = os.open(kvfs.mnt / "synced", os.O_RDWR)
    with mmap.mmap(fd, 0, mmap.MAP_SHARED) as m:
        m[MiB - 3:MiB + 3] = b"ABCDEF"
        m.flush()                                   # msync: must be durable now
        data[MiB - 3:MiB + 3] = b"ABCDEF"
        kvfs.kill9()
    os.close(fd)
    kvfs.mount()
    assert (kvfs.mnt / "synced").read_bytes() == data
    fd = os.open(kvfs.mnt / "unmapped", os.O_RDWR)
    with mmap.mmap(fd, 0, mmap.MAP_SHARED) as m:
        m[0:4] = b"WXYZ"
        m[-4:] = b"wxyz"
    os.close(fd)
    other[0:4], other[-4:] = b"WXYZ", b"wxyz"
    kvfs.umount()
    kvfs.mount()
    assert (kvfs.mnt / "unmapped").read_bytes() == other


def test_fifos_sockets_and_device_nodes_are_stored(kvfs):
    mnt = kvfs.mnt
    os.mkfifo(mnt / "fifo", 0o640)
    os.mknod(mnt / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(mnt / "loop", 0o660 | stat.S_IFBLK, os.makedev(7, 0))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(mnt / "sock"))
    sock.close()
    # The FIFO really is a pipe (the kernel serves it; kvfs only stores the inode).
    r = os.open(mnt / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    w = os.open(mnt / "fifo", os.O_WRONLY | os.O_NONBLOCK)
    os.write(w, b"through the pipe")
    assert os.read(r, 100) == b"through the pipe"
    os.close(w)
    os.close(r)
    os.rename(mnt / "loop", mnt / "loop0")
    os.link(mnt / "null", mnt / "null2")
    os.chmod(mnt / "fifo", 0o600)
    os.chown(mnt / "null2", 1000, 1000)
    os.mkdir(mnt / "d")
    os.rename(mnt / "sock", mnt / "d" / "sock")

    def check():
        st = os.lstat(mnt / "fifo")
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        st = os.lstat(mnt / "null")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3) and st.st_nlink == 2
        assert (st.st_uid, st.st_gid) == (1000, 1000)
        st = os.lstat(mnt / "loop0")
        assert stat.S_ISBLK(st.st_mode) and st.st_rdev == os.makedev(7, 0)
        assert stat.S_ISSOCK(os.lstat(mnt / "d" / "sock").st_mode)
        assert not os.path.lexists(mnt / "loop")

    check()
    kvfs.umount()
    kvfs.assert_fsck_clean()
    kvfs.mount()
    check()
    # FUSE mounts are nodev: a device node is stored, but opening it is refused
    # by the kernel, as on any nodev mount.
    with pytest.raises(PermissionError):
        open(mnt / "null", "wb")
    os.unlink(mnt / "null")
    os.unlink(mnt / "null2")
    os.unlink(mnt / "d" / "sock")
    assert sorted(os.listdir(mnt)) == sorted([".kvfs", "d", "fifo", "loop0"])


def test_readdir_returns_dot_and_dotdot(kvfs):
    (kvfs.mnt / "a" / "b").mkdir(parents=True)
    (kvfs.mnt / "a" / "f").write_bytes(b"1")

    def listing(path):
        out = subprocess.run(["ls", "-ai1", "-f", str(path)], check=True, capture_output=True,
                             text=True).stdout.split("\n")
        return {name: int(ino) for ino, name in (line.split(None, 1) for line in out if line)}

    a = listing(kvfs.mnt / "a")
    assert set(a) == {".", "..", "b", "f"}
    assert a["."] == os.stat(kvfs.mnt / "a").st_ino
    assert a[".."] == os.stat(kvfs.mnt).st_ino
    b = listing(kvfs.mnt / "a" / "b")
    assert set(b) == {".", ".."} and b[".."] == a["."]
    root = listing(kvfs.mnt)
    assert set(root) == {".", "..", ".kvfs", "a"}
    assert set(listing(kvfs.mnt / ".kvfs")) == {".", "..", "by-hash"}
