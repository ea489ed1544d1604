"""Regression tests for the review's defects in the data path (issue 7, items 3, 4, 7, 10-12).

Each test reproduces a defect through a real mount and ordinary syscalls; the
fixtures end every test with a clean fsck.
"""
import errno
import mmap
import os
import socket
import stat
import subprocess
import time

import pytest

from filedata import pattern, write_file
from kvfsmount import KvfsMount, slow_writes
from threads import Workers

MiB = 1 << 20


# -- item 4: a file is never committed half-rewritten, nor empty ---------------------------

@pytest.mark.parametrize("earlier", [False, True], ids=["new-file", "over-committed-content"])
def test_rewrite_in_flight_at_a_crash_is_never_recorded(kvfs_factory, earlier):
    """write 4 MiB of x, close; reopen, pwrite 1 MiB of y at 0, keep it open; kill -9.

    The seal of the close was still flushing on the slow device when the
    rewrite landed, and it used to record the rewrite with the rest of the file
    (1 MiB of y + 3 MiB of x), a content no close or fsync produced. Now the
    file shows a content that a close or fsync produced (x, or the earlier
    fsynced one), or it is absent if it had none durable yet.
    """
    fs = kvfs_factory(faults=slow_writes(0.4), mount_options=["commit_interval=0.5"])
    fs.mkfs()
    fs.mount()
    path = fs.mnt / "chunk"
    allowed = [b"x" * (4 * MiB)]
    if earlier:
        allowed.append(pattern(7, 4 * MiB))
        write_file(path, allowed[-1], fsync=True)
    write_file(path, b"x" * (4 * MiB))
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"y" * MiB, 0) == MiB
        time.sleep(4)                       # the flushes finish and several commits pass
        fs.kill9()
    finally:
        os.close(fd)
    fs.mount()
    if not earlier and not path.exists():
        return                              # allowed: no close's content had been recorded
    data = path.read_bytes()
    assert data in allowed, f"{len(data)} bytes starting {data[:1]!r}: a mix of two contents"


def test_files_in_flight_at_a_crash_are_whole_or_absent(kvfs_factory):
    """Three writers: create, write, fsync, close. Others' fsyncs commit our create records."""
    fs = kvfs_factory(faults=slow_writes(0.1), mount_options=["commit_interval=0.3"])
    fs.mkfs()
    fs.mount()
    fsynced = set()
    contents = {}

    def writer(w, stop):
        try:
            for i in range(1000):
                if stop.is_set():
                    return
                name = f"w{w}-{i}"
                data = pattern(w * 1000 + i, 2 * MiB + 4096 * w)
                contents[name] = data
                fd = os.open(fs.mnt / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fsynced.add(name)
        except OSError:                     # the mount going away under us ends the writer
            if not stop.is_set():
                raise

    with Workers(timeout=30) as workers:    # on leaving: join the writers, re-raise their failures
        for w in range(3):
            workers.start(writer, w, workers.stop)
        time.sleep(3)
        workers.stop.set()
        # The dead mount stays in place until the writers are joined: detached at
        # once, a writer's next open() created its file in the bare mountpoint
        # directory, fsynced it there, and the remount hid it (seen as "lost").
        fs.kill9(detach=False)
    fs.detach()
    assert len(fsynced) >= 3, "the writers made too little progress to test anything"
    fs.mount()
    present = set(os.listdir(fs.mnt)) - {".kvfs"}
    assert fsynced <= present, f"fsynced files lost: {sorted(fsynced - present)}"
    for name in present:
        assert (fs.mnt / name).read_bytes() == contents[name], f"{name}: not a complete content"


# -- item 10: mmap ------------------------------------------------------------------------

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


# -- item 11: FIFOs, sockets and device nodes ---------------------------------------------

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


# -- item 12: readdir returns . and .. ------------------------------------------------------

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


# -- item 7: ENOSPC from fragmented free space goes to the writer ---------------------------

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


# -- item 3: metadata space; a failed commit never kills the daemon ------------------------

SYMLINK_FLOOD = r"""
import errno, json, os, sys, time
root, batches = sys.argv[1], int(sys.argv[2])
made, error = 0, None
for batch in range(batches):
    try:
        for _ in range(800):
            os.symlink("t" * 4000, os.path.join(root, f"l{made:06d}"))
            made += 1
    except OSError as exc:
        error = exc.errno
        break
    time.sleep(0.5)                # the review's batches, with commits in between
print(json.dumps({"made": made, "errno": error}))
"""


def test_symlink_flood_by_a_user_gets_enospc_and_the_store_stays_mountable(shared_kvfs):
    import json
    fs = shared_kvfs("commit_interval=0.2", size="64M")
    flood = fs.mnt / "flood"
    flood.mkdir(mode=0o777)
    os.chmod(flood, 0o777)
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "/usr/bin/python3", "-c", SYMLINK_FLOOD, str(flood), "10"],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["errno"] == errno.ENOSPC, result
    assert result["made"] > 1000
    stats = fs.stats()                                   # the daemon is alive and says why
    assert stats["metadata_bytes"] > 0.9 * stats["metadata_capacity"]
    ffree = os.statvfs(fs.mnt).f_ffree
    assert ffree < 100
    with pytest.raises(OSError) as e:               # about f_ffree small entries still fit
        for i in range(2 * ffree + 2):
            os.mkdir(fs.mnt / f"small{i}")
    assert e.value.errno == errno.ENOSPC
    for i in range(200):
        os.unlink(flood / f"l{i:06d}")
    os.mkdir(fs.mnt / "after-deletes")
    fs.umount()
    fs.assert_fsck_clean()
    fs.mount()
    assert len(os.listdir(flood)) == result["made"] - 200
    assert (fs.mnt / "after-deletes").is_dir()


@pytest.mark.expect_errors(
    r"kvfs\.server\.daemon: could not checkpoint after replay, serving from the journal: metadata \(\d+ bytes\) exceeds the checkpoint slot",
)
def test_store_whose_state_already_exceeds_its_checkpoint_slot_mounts(kvfs_factory):
    """A store left by the old code: journal + checkpoint hold more than one slot."""
    import trio
    from kvfs import schema
    from unit.helpers import open_fs, running

    fs = kvfs_factory(size="64M")
    fs.mkfs()

    async def overfill():
        store = open_fs(fs.device)
        ns = store.ns
        async with running(store, persist=False):
            i = 0
            while ns.metadata_bytes() < 0.9 * ns.metadata_capacity():
                ns._emit(schema.Make(1, f"l{i:06d}".encode(), ns.tree.next_ino, stat.S_IFLNK | 0o777, 0, 0,
                                     0, ns.now(), b"t" * 4000))   # straight to the journal: no charge
                i += 1
            await ns.checkpoint()
            while ns.metadata_bytes() < 1.1 * store.store.checkpoint_capacity():
                ns._emit(schema.Make(1, f"l{i:06d}".encode(), ns.tree.next_ino, stat.S_IFLNK | 0o777, 0, 0,
                                     0, ns.now(), b"t" * 4000))
                i += 1
            await ns.commit()
        store.close()
        return i

    links = trio.run(overfill)
    fs.mount()                                     # used to die in the post-replay checkpoint
    assert len(os.listdir(fs.mnt)) == links + 1    # + .kvfs
    with pytest.raises(OSError) as e:
        os.symlink("x", fs.mnt / "new")
    assert e.value.errno == errno.ENOSPC
    for i in range(600):
        os.unlink(fs.mnt / f"l{i:06d}")
    fs.admin("checkpoint", fs.mnt)                 # now it fits
    os.symlink("x", fs.mnt / "new")
    fs.umount()
    fs.assert_fsck_clean()
    fs.mount()
    assert len(os.listdir(fs.mnt)) == links - 600 + 2


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
