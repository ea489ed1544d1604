"""The FUSE operations class in-process: errno mapping, privileges, negative lookups, statfs.

No kernel is involved: the handlers are called directly, as pyfuse3 would call
them, over the real layer stack on a real store file. What pyfuse3 needs from
a request context is the caller's uid and gid.
"""
import errno
import os
import stat
import types

import pyfuse3
import pytest
import trio

from kvfs.server.daemon import MountOptions
from kvfs.errors import InternalError
from kvfs.fuse.ops import CONTROL_XATTR, STATS_XATTR, KvfsOperations
from kvfs.namespace import BY_HASH_INO, KEY_XATTR, ROOT_INO
from kvfs.server.stack import Filesystem
from kvfs.store.mkfs import make_filesystem

ROOT = types.SimpleNamespace(uid=0, gid=0, pid=1, umask=0o022)
USER = types.SimpleNamespace(uid=1000, gid=1000, pid=1, umask=0o022)


class Control:
    """What the daemon answers through the control channel, recorded."""

    def __init__(self):
        self.commands = []

    def stats(self):
        return {"pid": 1, "files": 0}

    async def command(self, name):
        self.commands.append(name)


@pytest.fixture
async def ops(tmp_path):
    path = tmp_path / "store.kvfs"
    make_filesystem(str(path), 64 << 20, 64 << 10)
    fs = Filesystem.open(str(path), MountOptions(cache_size=2 << 20, dirty_limit=1 << 20, flush_workers=2))
    control = Control()
    async with trio.open_nursery() as nursery:
        await nursery.start(fs.cache.run)
        operations = KvfsOperations(fs.ns, control)
        operations.test_control = control
        yield operations
        await fs.ns.flush_all()
        await fs.ns.checkpoint()
        nursery.cancel_scope.cancel()
    fs.close()


def fuse_errno(excinfo):
    return excinfo.value.errno


async def test_kvfs_errors_become_their_errno(ops):
    await ops.mkdir(ROOT_INO, b"d", 0o755, ROOT)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.mkdir(ROOT_INO, b"d", 0o755, ROOT)
    assert fuse_errno(e) == errno.EEXIST
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.create(ROOT_INO, b"x" * 256, stat.S_IFREG | 0o644, os.O_WRONLY, ROOT)
    assert fuse_errno(e) == errno.ENAMETOOLONG
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.rmdir(ROOT_INO, b".kvfs", ROOT)
    assert fuse_errno(e) == errno.EPERM
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.rename(ROOT_INO, b"d", ROOT_INO, b"e", pyfuse3.RENAME_EXCHANGE, ROOT)
    assert fuse_errno(e) == errno.EINVAL
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.read(12345, 0, 10)
    assert fuse_errno(e) == errno.EBADF


@pytest.mark.expect_errors(r"kvfs\.fuse\.ops: bug in statfs", r"kvfs\.fuse\.ops: internal error in statfs")
async def test_a_bug_is_eio_and_logged_never_a_crash(ops, monkeypatch, caplog):
    def broken(*args):
        raise InternalError("invariant broken on purpose")

    monkeypatch.setattr(ops.ns, "statfs", broken)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.statfs(ROOT)
    assert fuse_errno(e) == errno.EIO
    monkeypatch.setattr(ops.ns, "statfs", lambda: 1 / 0)     # not even a KvfsError
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.statfs(ROOT)
    assert fuse_errno(e) == errno.EIO
    logged = [r for r in caplog.records if r.name == "kvfs.fuse.ops" and r.levelname == "ERROR"]
    assert len(logged) == 2 and "bug in statfs" in logged[0].getMessage()
    caplog.clear()                      # these two errors were the point of the test


@pytest.mark.expect_errors(r"kvfs\.fuse\.ops: bug in lookup", r"kvfs\.fuse\.ops: internal error in getattr")
async def test_lookup_and_getattr_map_errors_as_every_handler_does(ops, monkeypatch, caplog):
    """The two map their errors themselves (no second coroutine a request); same errnos, same logs."""
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.lookup(ROOT_INO, b"x" * 256, ROOT)
    assert fuse_errno(e) == errno.ENAMETOOLONG
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.getattr(123456, ROOT)
    assert fuse_errno(e) == errno.ENOENT

    def broken(*args):
        raise InternalError("invariant broken on purpose")

    monkeypatch.setattr(ops.ns, "lookup", broken)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.lookup(ROOT_INO, b"f", ROOT)
    assert fuse_errno(e) == errno.EIO
    monkeypatch.setattr(ops.ns, "attr", lambda ino: 1 / 0)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.getattr(ROOT_INO, ROOT)
    assert fuse_errno(e) == errno.EIO
    logged = [r.getMessage() for r in caplog.records if r.name == "kvfs.fuse.ops" and r.levelname == "ERROR"]
    assert logged == ["bug in lookup", "internal error in getattr"]
    caplog.clear()


async def test_a_missing_name_is_a_cached_negative_entry(ops):
    miss = await ops.lookup(ROOT_INO, b"not-there", ROOT)
    assert miss.st_ino == 0 and miss.entry_timeout > 0
    with pytest.raises(pyfuse3.FUSEError) as e:          # by-hash misses are never cached
        await ops.lookup(BY_HASH_INO, b"00" * 16, ROOT)
    assert fuse_errno(e) == errno.ENOENT


async def test_write_read_and_the_content_key(ops):
    info, entry = await ops.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, os.O_WRONLY | os.O_CREAT, ROOT)
    assert info.direct_io                         # write-only: straight to the daemon
    data = os.urandom(200_000)
    assert await ops.write(info.fh, 0, data) == len(data)
    await ops.release(info.fh)
    info = await ops.open(entry.st_ino, os.O_RDONLY, ROOT)
    assert not info.direct_io
    assert bytes(await ops.read(info.fh, 0, 1 << 20)) == data
    await ops.release(info.fh)
    key = bytes.fromhex((await ops.getxattr(entry.st_ino, KEY_XATTR, ROOT)).decode())
    view = await ops.lookup(BY_HASH_INO, key.hex().encode(), ROOT)
    assert view.st_size == len(data) and view.st_mode & 0o222 == 0
    attrs = await ops.getattr(entry.st_ino, ROOT)
    assert attrs.st_size == len(data) and attrs.st_blksize == 64 << 10


async def test_statistics_and_control_are_for_root_and_the_owner(ops):
    assert b'"pid"' in await ops.getxattr(ROOT_INO, STATS_XATTR, ROOT)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.getxattr(ROOT_INO, STATS_XATTR, USER)
    assert fuse_errno(e) == errno.EACCES
    assert STATS_XATTR not in await ops.listxattr(ROOT_INO, USER)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.setxattr(ROOT_INO, CONTROL_XATTR, b"flush", USER)
    assert fuse_errno(e) == errno.EPERM
    await ops.setxattr(ROOT_INO, CONTROL_XATTR, b"flush", ROOT)
    assert ops.test_control.commands == ["flush"]
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.setxattr(ROOT_INO, b"user.other", b"1", ROOT)
    assert fuse_errno(e) == errno.EOPNOTSUPP
    with pytest.raises(pyfuse3.FUSEError) as e:                  # by-hash is root-only by default
        await ops.opendir(BY_HASH_INO, USER)
    assert fuse_errno(e) == errno.EACCES


async def test_statfs_reports_space_and_inodes(ops):
    before = await ops.statfs(ROOT)
    assert before.f_bsize == 4096 and before.f_namemax == 255
    assert before.f_files == before.f_ffree + 1                    # the root
    await ops.mkdir(ROOT_INO, b"d", 0o755, ROOT)
    after = await ops.statfs(ROOT)
    assert after.f_ffree < before.f_ffree and after.f_blocks == before.f_blocks


async def test_setgid_directories_and_setuid_on_unprivileged_direct_writes(ops):
    d = await ops.mkdir(ROOT_INO, b"shared", 0o2777, ROOT)
    assert d.st_mode & stat.S_ISGID
    await ops.setattr(d.st_ino, types.SimpleNamespace(st_gid=50), _fields(update_gid=True), None, ROOT)
    sub = await ops.mkdir(d.st_ino, b"sub", 0o755, USER)
    assert sub.st_gid == 50 and sub.st_mode & stat.S_ISGID       # group and bit inherited
    info, f = await ops.create(d.st_ino, b"f", stat.S_IFREG | 0o6755, os.O_WRONLY | os.O_CREAT, USER)
    assert f.st_gid == 50
    await ops.write(info.fh, 0, b"x")                            # unprivileged direct_io write
    await ops.release(info.fh)
    mode = (await ops.getattr(f.st_ino, ROOT)).st_mode
    assert not mode & (stat.S_ISUID | stat.S_ISGID), oct(mode)


def _fields(**set_):
    names = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
             "update_size")
    return types.SimpleNamespace(**{n: set_.get(n, False) for n in names})
