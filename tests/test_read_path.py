"""Issue 9, functional: what the read path promises, observed through statistics (not timed).

A cold 32 MiB read must keep many device reads in flight and cost one worker-thread
hand-off per run of adjacent blocks (PREFETCH_RUN_BLOCKS), not one per block, whether
the reader goes through the page cache or uses O_DIRECT (whose requests all arrive
at once and used to race the prefetch, each reading its own block). A corrupt or
unreadable block still gives EIO: tests/test_faults_mounted.py.
"""
import mmap
import os
import threading

import pytest

from kvfs.blockcache.reads import PREFETCH_RUN_BLOCKS
from kvfsmount import drop_kernel_cache

MiB = 1 << 20
BLOCKS = 32


@pytest.fixture
def kvfs(kvfs_factory):
    """Mounted with native_reads=off: these tests are about the cold read path through
    pyfuse3 and the block cache (prefetch runs, hand-offs); the native read plane
    (kvfs/fuse/readplane.c) answers READs of sealed files without it
    (tests/test_native_reads.py)."""
    fs = kvfs_factory(mount_options=["native_reads=off"])
    fs.mkfs()
    fs.mount()
    return fs


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_a_cold_read_costs_one_handoff_per_run_and_keeps_reads_in_flight(kvfs, direct):
    data = os.urandom(BLOCKS * MiB)
    (kvfs.mnt / "chunk").write_bytes(data)
    kvfs.remount()                                   # fresh statistics, empty caches
    runs = -(-BLOCKS // PREFETCH_RUN_BLOCKS)
    before = {"blocks_fetched": 0, "read_handoffs": 0}
    # The second pass reads the file again once its blocks have left both caches,
    # without a remount: a reopen must prefetch again (it once did not, and a cold
    # re-read then cost a hand-off and a device round trip per block).
    for cold_pass in range(2):
        drop_kernel_cache()
        if cold_pass:
            kvfs.admin("drop-caches", kvfs.mnt)
            assert kvfs.stats()["cache_bytes"] == 0
        fd = os.open(kvfs.mnt / "chunk", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            buf = mmap.mmap(-1, len(data))           # page aligned, as O_DIRECT needs
            assert os.readv(fd, [buf]) == len(data)
            assert buf[:] == data
        finally:
            os.close(fd)
        stats = kvfs.stats()
        # Every block from the device, once per pass.
        assert stats["blocks_fetched"] - before["blocks_fetched"] == BLOCKS, (cold_pass, stats)
        # One hand-off per run; a request that overtakes the prefetch's window may add one.
        handoffs = stats["read_handoffs"] - before["read_handoffs"]
        assert runs <= handoffs <= runs + 2, (cold_pass, stats)
        assert stats["device_reads_inflight_max"] >= 4, stats
        before = stats


def test_chunks_written_at_once_are_read_in_runs(kvfs):
    """Four writers at once, as an engine's I/O threads write its chunks: each chunk still
    lands in runs of adjacent blocks (kvfs/store/allocator.py, "Runs"), so its cold
    read costs about one hand-off per PREFETCH_RUN_BLOCKS, not one per block."""
    files = 4
    datas = [os.urandom(BLOCKS * MiB) for _ in range(files)]
    errors = []

    def write(index):
        try:
            (kvfs.mnt / f"chunk{index}").write_bytes(datas[index])
        except OSError as exc:
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(index,)) for index in range(files)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    assert errors == []
    kvfs.remount()                                   # fresh statistics, empty caches
    drop_kernel_cache()
    buf = mmap.mmap(-1, BLOCKS * MiB)
    for index, data in enumerate(datas):
        fd = os.open(kvfs.mnt / f"chunk{index}", os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.readv(fd, [buf]) == len(data)
        finally:
            os.close(fd)
        assert buf[:] == data, index
    stats = kvfs.stats()
    assert stats["blocks_fetched"] == files * BLOCKS, stats
    runs = -(-BLOCKS // PREFETCH_RUN_BLOCKS)
    # Scattered, as plain next-fit left them, this was 0.5-0.9 hand-offs per block.
    assert stats["read_handoffs"] <= files * (runs + 2), stats
