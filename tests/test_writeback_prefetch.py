"""Issue 3, functional: write-back cache, back-pressure, prefetch, page-cache reads.

Nothing here is timed: the statistics show what happened. A deliberately slow
device (a fault plan that delays every device write) makes the write-back visible.
"""
import hashlib
import os
import signal

import pytest

from kvfsmount import drop_kernel_cache, slow_writes, write_new
from threads import run_in_threads

MiB = 1 << 20


@pytest.fixture
def kvfs(kvfs_factory):
    """Mounted with native_reads=off: these tests are about the block cache's prefetch and
    clean cache, which READs through pyfuse3 use; the native read plane
    (kvfs/fuse/readplane.c) answers READs of sealed files without them."""
    fs = kvfs_factory(mount_options=["native_reads=off"])
    fs.mkfs()
    fs.mount()
    return fs


def test_close_returns_while_dirty_and_dirty_reads_are_right(kvfs_factory):
    fs = kvfs_factory(faults=slow_writes(0.3))
    fs.mkfs()
    fs.mount()
    data = os.urandom(8 * MiB + 123)
    write_new(fs.mnt / "chunk", data)              # returns although the device is slow
    stats = fs.stats()
    assert stats["dirty_bytes"] > 0, stats
    assert stats["flush_backlog_bytes"] > 0
    assert (fs.mnt / "chunk").read_bytes() == data   # served from the dirty buffers
    fs.flush()
    stats = fs.stats()
    assert stats["dirty_bytes"] == 0 and stats["flush_backlog_bytes"] == 0
    assert stats["data_bytes_written"] >= len(data)
    fs.remount()
    assert (fs.mnt / "chunk").read_bytes() == data


def test_fsync_then_kill9_keeps_data(kvfs_factory):
    fs = kvfs_factory(faults=slow_writes(0.05), mount_options=["commit_interval=3600"])
    fs.mkfs()
    fs.mount()
    data = os.urandom(5 * MiB + 7)
    fd = os.open(fs.mnt / "durable", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    write_new(fs.mnt / "not-fsynced", os.urandom(3 * MiB))   # may or may not survive; never torn
    fs.kill9()
    fs.mount()
    assert (fs.mnt / "durable").read_bytes() == data
    leftover = fs.mnt / "not-fsynced"
    if leftover.exists():
        assert leftover.stat().st_size in (0, 3 * MiB)


def test_back_pressure_bounds_dirty_bytes(kvfs_factory):
    fs = kvfs_factory(faults=slow_writes(0.02), mount_options=["dirty_limit=8M", "cache_size=16M",
                                     "flush_workers=2"])
    fs.mkfs()
    fs.mount()
    digests = {}

    def writer(i):
        data = os.urandom(16 * MiB)
        digests[i] = hashlib.sha256(data).hexdigest()
        write_new(fs.mnt / f"w{i}", data)

    run_in_threads(writer, range(4))                # re-raises a writer's failure here
    fs.flush()
    stats = fs.stats()
    assert stats["dirty_limit"] == 8 * MiB
    assert 0 < stats["dirty_bytes_max"] <= stats["dirty_limit"], stats
    assert stats["writers_throttled"] > 0          # the writers really were faster than the device
    for i, digest in digests.items():
        assert hashlib.sha256((fs.mnt / f"w{i}").read_bytes()).hexdigest() == digest


def test_cold_read_is_prefetched_in_parallel(kvfs):
    data = os.urandom(32 * MiB)
    write_new(kvfs.mnt / "chunk.pt", data)
    stats = kvfs.stats()
    # One write() of 32 MiB arrives as 1 MiB requests (one more when the buffer is not page aligned).
    assert stats["write_requests"] <= 33
    kvfs.remount()                                  # fresh statistics, empty caches
    drop_kernel_cache()
    with open(kvfs.mnt / "chunk.pt", "rb", buffering=0) as f:
        assert f.read() == data
    stats = kvfs.stats()
    assert stats["read_requests"] <= 40             # large requests, not 4 KiB pages
    assert stats["prefetch_inflight_max"] >= 8, stats
    assert stats["device_reads_inflight_max"] >= 8
    assert stats["cache_misses"] >= 32             # every block came from the device once
    # Each block is held by kvfs's cache or, once a page fill stored the whole
    # file, by the kernel's page cache instead (docs/reliability.md, "Page fills").
    assert stats["cache_bytes"] + stats["page_fill_bytes"] >= 32 * MiB, stats


def test_concurrent_readers_share_one_prefetch(kvfs):
    data = os.urandom(32 * MiB + 5)
    write_new(kvfs.mnt / "shared", data)
    kvfs.remount()
    drop_kernel_cache()

    def reader(_):
        fd = os.open(kvfs.mnt / "shared", os.O_RDONLY | os.O_DIRECT)
        try:
            import mmap
            buf = mmap.mmap(-1, 33 * MiB)
            n = os.readv(fd, [buf])
            return hashlib.sha256(buf[:n]).hexdigest()
        finally:
            os.close(fd)

    results = run_in_threads(reader, range(6))
    assert results == [hashlib.sha256(data).hexdigest()] * 6
    stats = kvfs.stats()
    assert stats["cache_misses"] == 33              # each block read from the device exactly once


def test_hot_reads_skip_the_daemon_and_drop_caches_empties(kvfs):
    data = os.urandom(16 * MiB)
    write_new(kvfs.mnt / "hot", data)
    kvfs.flush()
    assert (kvfs.mnt / "hot").read_bytes() == data      # first read: through the daemon
    before = kvfs.stats()
    for _ in range(3):
        assert (kvfs.mnt / "hot").read_bytes() == data  # kernel page cache (keep_cache)
    after = kvfs.stats()
    assert after["read_requests"] == before["read_requests"]
    # The only device reads meanwhile: each multi-mount-protection heartbeat reads
    # its one-sector record first (on a slow machine the window spans one). A
    # heartbeat that straddles a stats() snapshot has read its record but not yet
    # counted itself, so one record either way is allowed; a data block is 1 MiB.
    heartbeat_reads = (after.get("mmp_heartbeats", 0) - before.get("mmp_heartbeats", 0)) * 4096
    device_reads = after["device_bytes_read"] - before["device_bytes_read"]
    assert device_reads % 4096 == 0 and abs(device_reads - heartbeat_reads) <= 4096
    assert after["cache_bytes"] > 0
    kvfs.admin("drop-caches", kvfs.mnt)
    assert kvfs.stats()["cache_bytes"] == 0
    # A changed file is not served from stale pages.
    new = os.urandom(16 * MiB)
    write_new(kvfs.mnt / "hot", new)
    assert (kvfs.mnt / "hot").read_bytes() == new
    for key in ("cache_hits", "cache_misses", "read_bytes_per_s", "write_bytes_per_s",
                "flush_backlog_bytes", "prefetch_inflight_max"):
        assert key in after


def test_sigterm_flushes_before_exit(kvfs_factory):
    # Each device write takes 1 s, so the six blocks are still dirty when stats is
    # read (with 0.1 s a slow machine had flushed them all by then).
    fs = kvfs_factory(faults=slow_writes(1.0), mount_options=["commit_interval=3600"])
    fs.mkfs()
    fs.mount()
    data = os.urandom(6 * MiB)
    write_new(fs.mnt / "pending", data)
    assert fs.stats()["dirty_bytes"] > 0
    os.kill(fs.pid, signal.SIGTERM)
    fs.wait_daemon_exit(fs.pid)
    assert not fs.mounted
    fs.assert_fsck_clean()
    fs.mount()
    assert (fs.mnt / "pending").read_bytes() == data
