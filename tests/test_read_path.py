"""Issue 9, functional: what the read path promises, observed through statistics (not timed).

A cold 32 MiB read must keep many device reads in flight and cost one worker-thread
hand-off per run of adjacent blocks (PREFETCH_RUN_BLOCKS), not one per block, whether
the reader goes through the page cache or uses O_DIRECT (whose requests all arrive
at once and used to race the prefetch, each reading its own block). A corrupt or
unreadable block still gives EIO: tests/test_faults_mounted.py.
"""
import mmap
import os

import pytest

from kvfs.blockcache.reads import PREFETCH_RUN_BLOCKS

MiB = 1 << 20
BLOCKS = 32


def drop_kernel_cache():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_a_cold_read_costs_one_handoff_per_run_and_keeps_reads_in_flight(kvfs, direct):
    data = os.urandom(BLOCKS * MiB)
    (kvfs.mnt / "chunk").write_bytes(data)
    kvfs.remount()                                   # fresh statistics, empty caches
    drop_kernel_cache()
    fd = os.open(kvfs.mnt / "chunk", os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        buf = mmap.mmap(-1, len(data))               # page aligned, as O_DIRECT needs
        assert os.readv(fd, [buf]) == len(data)
        assert buf[:] == data
    finally:
        os.close(fd)
    stats = kvfs.stats()
    assert stats["blocks_fetched"] == BLOCKS         # every block from the device, once
    runs = -(-BLOCKS // PREFETCH_RUN_BLOCKS)
    # One hand-off per run; a request that overtakes the prefetch's window may add one.
    assert runs <= stats["read_handoffs"] <= runs + 2, stats
    assert stats["device_reads_inflight_max"] >= 4, stats
