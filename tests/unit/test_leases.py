"""Block-map leases for bypass readers (kvfs/namespace/leases.py, kvfs/fuse/blockmaps.py).

The real layers over a real store file: a lease pins the blocks it names, so a
rewrite, truncate or unlink that drops their last reference leaves them allocated
until the lease ends, and the end says whether the file changed. Leases end by
time too. Each test ends with a clean fsck.
"""
import errno
import os
import types

import msgpack
import pytest
import trio

from kvfs.device import _readcore
from kvfs.errors import AccessDenied, NotPermitted
from kvfs.fuse.blockmaps import BLOCKMAP_XATTR, LEASE_END_PREFIX, BlockMaps, BypassDevice
from kvfs.namespace import ROOT_INO
from kvfs.namespace.leases import check_lease_seconds

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, read_all, running, slow_writes, write_file


def _entries(fs, grant):
    return [fs.index.entries.get(b[2]) for b in grant.blocks if b is not None]


async def _rewrite(ns, ino, data):
    fh, _, _ = ns.open(ino, os.O_WRONLY | os.O_TRUNC)
    await ns.write(fh, 0, data)
    await ns.release(fh)
    await ns.flush_all()


def _device_bytes(fs, grant):
    """The leased blocks as the device holds them now, checked against their keys."""
    fd = os.open(fs.device.path, os.O_RDONLY)
    try:
        blocks = [tuple(b) for b in grant.blocks]
        return _readcore.read_verified(fd, fs.store.hash_seed, blocks, fs.store.key_secret)
    finally:
        os.close(fd)


@pytest.mark.parametrize("change", ["rewrite", "truncate", "unlink", "none"])
async def test_a_lease_keeps_its_blocks_until_it_ends_and_its_end_tells_a_change(tmp_path, change):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    old = pattern(1, 3 * BS + 100)
    async with running(fs):
        ns = fs.ns
        ino = await write_file(ns, ROOT_INO, b"f", old)
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        grant = await ns.lease_blocks(ino)
        assert grant is not None and grant.size == len(old) and len(grant.blocks) == 4
        assert all(e is not None and e.pins >= 2 for e in _entries(fs, grant))    # the open's and the lease's
        await ns.release(fh)
        if change == "rewrite":
            await _rewrite(ns, ino, pattern(2, 3 * BS + 100))
        elif change == "truncate":
            await ns.setattr(ino, size=BS)
            await ns.flush_all()
        elif change == "unlink":
            ns.unlink(ROOT_INO, b"f", directory=False)
            ns.forget(ino, 1)
            await ns.flush_all()
        for _ in range(3):      # new files: space the old blocks would have given back
            await write_file(ns, ROOT_INO, b"n%d" % _, pattern(10 + _, 3 * BS))
        stats = ns.leases.statistics()
        assert stats.leases_held == 1 and stats.lease_bytes_held == len(old)
        if change == "none":
            assert stats.lease_deferred_bytes == 0
        else:
            # Every old block lost its reference (truncate keeps block 0 only): deferred, not freed.
            dropped = grant.blocks[1:] if change == "truncate" else grant.blocks
            assert stats.lease_deferred_bytes == sum(-(-b[1] // 4096) * 4096 for b in dropped)
            assert all(e is not None for e in _entries(fs, grant))
        views = _device_bytes(fs, grant)
        assert all(v is not None for v in views) and b"".join(views)[:len(old)] == old
        before_end = fs.index.used_bytes
        assert ns.end_leases([grant.lease_id]) == [change in ("none", "unlink")]
        assert fs.index.used_bytes == before_end - stats.lease_deferred_bytes     # freed at the end
        after = ns.leases.statistics()
        assert after.leases_held == 0 and after.lease_deferred_bytes == 0
        if change != "none":
            gone = [b for b in grant.blocks if fs.index.entries.get(b[2]) is None]
            assert len(gone) == (4 if change != "truncate" else 3)
        assert ns.end_leases([grant.lease_id]) == [False]         # ended already
    close_and_check(fs)


async def test_no_lease_for_a_file_not_exactly_on_the_device(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs):
        ns = fs.ns
        ino = await write_file(ns, ROOT_INO, b"f", pattern(3, 2 * BS))
        fh, _, _ = ns.open(ino, os.O_RDWR)
        assert await ns.lease_blocks(ino) is None                        # open for writing
        await ns.write(fh, 0, b"dirty")
        assert await ns.lease_blocks(ino) is None
        await ns.release(fh)
        assert await ns.lease_blocks(ROOT_INO) is None                   # not a file
        assert ns.leases.statistics().leases_refused == 3
        await ns.flush_all()
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        grant = await ns.lease_blocks(ino)
        assert grant is not None
        assert ns.end_leases([grant.lease_id]) == [True]
        await ns.release(fh)
    close_and_check(fs)


async def test_a_closed_file_not_sealed_yet_is_sealed_for_its_lease(tmp_path):
    """A file just closed (or just fetched from the shared tier) has its seal still to
    come: the lease waits for it instead of sending the client back to the mount."""
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.05))
    async with running(fs):
        ns = fs.ns
        data = pattern(4, 3 * BS + 7)
        ino = await write_file(ns, ROOT_INO, b"f", data, sync=False)
        assert ns.inode(ino).content_dirty                          # closed, its seal pending
        grant = await ns.lease_blocks(ino)
        assert grant is not None and not ns.inode(ino).content_dirty
        assert b"".join(_device_bytes(fs, grant))[:len(data)] == data
        assert ns.end_leases([grant.lease_id]) == [True]
        assert ns.leases.statistics().leases_refused == 0
        ns.forget(ino, 1)
    close_and_check(fs)


async def test_an_idle_file_is_leased_without_an_open_and_counts_as_read(tmp_path):
    """The client asks by path (an O_PATH descriptor), so nothing opens the file: its live
    content is built for the grant and dropped after, the lease alone pins its blocks, and
    the grant is an access for eviction, as the open it replaces was."""
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs):
        ns = fs.ns
        old = await write_file(ns, ROOT_INO, b"old", pattern(4, 2 * BS))
        new = await write_file(ns, ROOT_INO, b"new", pattern(5, 2 * BS))
        assert ns.inode(old).data is None and ns.inode(new).data is None         # both idle
        assert [i.ino for i in ns.evictor.choose(free_bytes=1)] == [old]           # the older goes first
        grant = await ns.lease_blocks(old)
        assert grant is not None and grant.size == 2 * BS and len(grant.blocks) == 2
        assert ns.inode(old).data is None                      # live content dropped again
        assert all(e is not None and e.pins >= 1 for e in _entries(fs, grant))      # the lease's pins
        assert b"".join(_device_bytes(fs, grant)) == pattern(4, 2 * BS)
        assert [i.ino for i in ns.evictor.choose(free_bytes=1)] == [new]           # "old" was just read
        assert ns.end_leases([grant.lease_id]) == [True]
    close_and_check(fs)


async def test_leases_end_by_time(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    now = [1000.0]
    async with running(fs):
        ns = fs.ns
        ns.leases.clock = lambda: now[0]
        ns.leases.seconds = 5.0
        ino = await write_file(ns, ROOT_INO, b"f", pattern(4, 2 * BS))
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        first = await ns.lease_blocks(ino)
        now[0] += 3
        second = await ns.lease_blocks(ino)
        await ns.release(fh)
        ns.unlink(ROOT_INO, b"f", directory=False)
        ns.forget(ino, 1)
        await ns.flush_all()
        assert ns.leases.statistics().lease_deferred_bytes == 2 * BS
        now[0] += 2.5                    # the first is past its time, the second not
        ns.leases.expire()
        s = ns.leases.statistics()
        assert s.leases_held == 1 and s.leases_expired == 1 and s.lease_deferred_bytes == 2 * BS
        assert ns.end_leases([first.lease_id]) == [False]
        now[0] += 10
        assert ns.end_leases([second.lease_id]) == [False]         # released, but too late
        s = ns.leases.statistics()
        assert s.leases_held == 0 and s.lease_deferred_bytes == 0 and s.leases_stale == 2
        assert all(fs.index.entries.get(b[2]) is None for b in second.blocks)
    close_and_check(fs)


async def test_the_namespace_ends_expired_leases_itself(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs, commit_interval=0.05):
        ns = fs.ns
        ns.leases.seconds = 0.2
        ino = await write_file(ns, ROOT_INO, b"f", pattern(5, BS))
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        assert await ns.lease_blocks(ino) is not None
        await ns.release(fh)
        with trio.fail_after(60):        # a bound, not a timing: it ends 0.2 s after the grant
            while ns.leases.statistics().leases_held:
                await trio.sleep(0.05)
        assert ns.leases.statistics().leases_expired == 1
        assert not ns.leases.sweeping
    close_and_check(fs)


def test_lease_seconds_bounds():
    assert check_lease_seconds("2.5") == 2.5
    for bad in ("0", "0.01", "-3", "inf", "nan", "x", None, 7200):
        with pytest.raises(ValueError, match="lease_seconds"):
            check_lease_seconds(bad)


def _ctx(uid, gid=None, pid=None):
    """What a FUSE request says of its caller (pyfuse3.RequestContext's three fields)."""
    return types.SimpleNamespace(uid=uid, gid=uid if gid is None else gid, pid=pid or os.getpid())


async def test_block_maps_go_to_root_and_to_the_group_for_its_own_files(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs):
        ns = fs.ns
        maps = BlockMaps(ns, BypassDevice(fs.device.path, fs.store.hash_seed, fs.store.key_secret), group=4242)
        ino = ns.make(ROOT_INO, b"g", 0o100644, 1000, 1000)
        fh, _, _ = ns.open(ino, os.O_WRONLY)
        await ns.write(fh, 0, pattern(6, BS + 9))
        await ns.fsync(fh)
        await ns.release(fh)
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        with pytest.raises(NotPermitted):
            await maps.answer(ino, BLOCKMAP_XATTR, _ctx(1000))           # not in the group
        with pytest.raises(AccessDenied):
            await maps.answer(ino, BLOCKMAP_XATTR, _ctx(1001, 4242))     # in the group, not the owner
        for ctx in (_ctx(0), _ctx(1000, 4242)):
            m = msgpack.unpackb(await maps.answer(ino, BLOCKMAP_XATTR, ctx))
            assert m["size"] == BS + 9 and m["device"] == fs.device.path and m["secret"] == fs.store.key_secret
            assert [b[2] for b in m["blocks"]] == [k for k in ns.inode(ino).data.blocks]
            ended = await maps.answer(ino, LEASE_END_PREFIX + b"%x.%x" % (m["lease"], m["lease"]), ctx)
            assert ended == b"10"
        with pytest.raises(NotPermitted):
            await maps.answer(ino, LEASE_END_PREFIX + b"1", _ctx(1000))
        s = maps.statistics()
        assert (s.block_maps_served, s.block_maps_denied, s.bypass_bytes_mapped) == (2, 3, 2 * (BS + 9))
        await ns.release(fh)
        m = msgpack.unpackb(await maps.answer(ino, BLOCKMAP_XATTR, _ctx(0)))   # idle again: no open needed
        assert m["size"] == BS + 9 and await maps.answer(ino, LEASE_END_PREFIX + b"%x" % m["lease"], _ctx(0)) == b"1"
        assert await read_all(ns, ino) == pattern(6, BS + 9)
    close_and_check(fs)
