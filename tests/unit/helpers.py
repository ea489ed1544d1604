"""Shared helpers for the in-process unit tests.

Everything here uses the real kvfs layers over a real sparse store file; the
only thing this module adds is the plumbing every test needs (mkfs, assemble
the stack, run its background tasks, persist, close, fsck).
"""
import contextlib
import os
import stat

import trio
import trio.testing

from kvfs import format as fmt
from kvfs import fsck
from kvfs.blockcache import BlockCache
from kvfs.blockindex import BlockIndex
from kvfs.cli.mkfs import make_filesystem
from kvfs.daemon import Filesystem, MountOptions
from kvfs.device import Device
from kvfs.extents import ExtentStore
from kvfs.namespace import ROOT_INO, Namespace

BS = 64 << 10                 # smallest legal block size: keeps the tests fast
DEV_SIZE = fmt.MIN_DEVICE_SIZE
FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755


def mkfs(tmp_path, *, size=DEV_SIZE, block_size=BS, name="store.kvfs"):
    """A freshly formatted sparse store file; returns its path."""
    path = tmp_path / name
    make_filesystem(str(path), size, block_size)
    return path


class Clock:
    """A deterministic ``now`` for the namespace: 1 µs steps from a fixed epoch."""

    def __init__(self, start=1_700_000_000_000_000_000):
        self.t = start

    def __call__(self):
        self.t += 1000
        return self.t


def options(*, cache_size=32 * BS, dirty_limit=16 * BS, read_depth=8, flush_workers=4,
            write_delay=0.0):
    return MountOptions(cache_size=cache_size, dirty_limit=dirty_limit, read_depth=read_depth,
                        flush_workers=flush_workers, write_delay=write_delay)


def open_fs(path, *, now=None, readonly=False, **kw):
    """Assemble device -> store -> index -> cache -> namespace like the daemon does.

    Without ``now`` this is exactly ``kvfs.daemon.Filesystem.open``. With it the
    same steps are done here so the namespace (and the root it creates on a
    fresh filesystem) uses a deterministic clock.
    """
    opts = options(**kw)
    if now is None:
        return Filesystem.open(str(path), opts, readonly=readonly)
    device = Device.open(str(path), readonly=readonly, write_delay=opts.write_delay)
    try:
        store = ExtentStore.open(device)
        index = BlockIndex(store)
        cache = BlockCache(index, cache_size=opts.cache_size, dirty_limit=opts.dirty_limit,
                           read_depth=opts.read_depth, flush_workers=opts.flush_workers)
        ns = Namespace(cache, store, now=now)
        ns.load(store.checkpoint_state, store.replay_records)
        fs = Filesystem(device, store, index, cache, ns)
        fs.replayed = store.replay_report
        store.finish_replay()
        store.set_snapshot_source(ns.snapshot)
        return fs
    except BaseException:
        device.close()
        raise


@contextlib.asynccontextmanager
async def running(fs, *, commit_interval=None, persist=True):
    """Run the cache's flush workers (and optionally ``Namespace.run``).

    On a normal exit everything is made durable: all dirty data flushed, file
    contents recorded, the journal committed and a checkpoint written.
    """
    async with trio.open_nursery() as nursery:
        await nursery.start(fs.cache.run)
        if commit_interval is not None:
            await nursery.start(fs.ns.run, commit_interval)
        yield nursery
        if persist:
            await fs.ns.flush_all()
            await fs.store.checkpoint()
        nursery.cancel_scope.cancel()


def assert_fsck_clean(path):
    """Run the offline checker (with data verification); it must find nothing."""
    report = fsck.check(str(path))
    assert report.clean, "fsck found problems:\n  " + "\n  ".join(report.problems)
    return report


def close_and_check(fs):
    """Close the stack's device and fsck the store; it must come back clean."""
    path = fs.device.path
    fs.close()
    return assert_fsck_clean(path)


def flip_byte(path, off):
    """Corrupt one byte of the store file in place (behind the device's back)."""
    fd = os.open(str(path), os.O_RDWR)
    try:
        old = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return old


def poke(path, off, data):
    fd = os.open(str(path), os.O_RDWR)
    try:
        os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def peek(path, off, n):
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def pattern(seed, n):
    """``n`` deterministic, incompressible-looking bytes (distinct per seed)."""
    out = bytearray()
    x = (seed * 2654435761 + 1) & 0xFFFFFFFF
    while len(out) < n:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        out += x.to_bytes(4, "little")
    return bytes(out[:n])


async def write_file(ns, parent, name, data, *, mode=FILE_MODE, sync=True):
    """Create a file, write ``data``, optionally fsync it, close it; returns ino (one lookup held)."""
    ino = ns.make(parent, name, mode, 0, 0)
    fh, _, _ = ns.open(ino, os.O_WRONLY)
    if data:
        await ns.write(fh, 0, data)
    if sync:
        await ns.fsync(fh)
    await ns.release(fh)
    return ino


async def read_all(ns, ino, size=None):
    fh, _, _ = ns.open(ino, os.O_RDONLY)
    try:
        n = ns.inode(ino).size if size is None else size
        return bytes(await ns.read(fh, 0, n))        # a copy: reads may return views of cache buffers
    finally:
        await ns.release(fh)


def lookup_path(ns, path):
    ino = ROOT_INO
    for part in path.strip("/").split("/"):
        ino = ns._dir(ino).entries.get(part.encode())
        if ino is None:
            return None
    return ino


async def wait_until(predicate, *, what="condition", limit_s=20.0):
    """Poll ``predicate`` between trio checkpoints, bounded by *real* time.

    Device I/O runs in worker threads, so progress is measured in wall-clock
    time even under a mock clock.
    """
    import time
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.testing.wait_all_tasks_blocked()
        await trio.lowlevel.checkpoint()
        if not predicate():
            await trio.to_thread.run_sync(time.sleep, 0.002)
    return True
