"""A read that refetches pages while an O_RDWR writer's WRITE is on its way to the daemon.

A write through the page cache copies its bytes into the kernel's pages, then
sends the WRITE. If the pages are dropped in between (invalidate_inode_pages2:
an open without keep_cache, a GETATTR reply under auto_inval_data, a direct_io
write) and a reader asks for them, the daemon answers with the bytes it has:
the older ones. Without a repair the kernel then keeps those pages, up to date
in its eyes, after the WRITE has landed, and every reader of a descriptor that
keeps its pages sees the old bytes for good (the stress test saw such pages:
old bytes up to a write boundary, new ones after it). kvfs drops the pages
such a read asked for before it answers the WRITE (kvfs/namespace/pagecache.py,
kvfs/fuse/pagedrops.py).

Here the WRITE is held in the daemon on purpose: the dirty limit is two blocks,
another file's two blocks are being flushed to a device that takes 1.5 s per
write, so the WRITE waits for room before the daemon applies it. An open
without keep_cache drops the pages meanwhile (a direct_io write while the
page-cache writer is open ends the protection of its pages,
kvfs/namespace/pagecache.py), and the reader asks for them again.
(posix_fadvise(DONTNEED) and memory reclaim cannot drop them: the in-flight
WRITE holds a reference on each page.)
"""
import mmap
import os
import threading
import time

import pytest

BS = 64 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")
DELAY_S = 1.5                    # each device write, while the WRITE is held


def pattern(seed, n):
    return bytes((seed * 131 + i * 7 + (i >> 8)) % 251 + 1 for i in range(n))


@pytest.mark.parametrize("length", [BS, BS - 100], ids=["whole-pages", "partial-last-page"])
def test_pages_refetched_during_a_page_cache_write_are_dropped_before_its_reply(kvfs_factory, length):
    fs = kvfs_factory(block_size="64K", faults=[],
                      mount_options=["cache_size=1M", "dirty_limit=128K", "eviction_policy=none",
                                     # the heartbeat is a device write too: overdue, the daemon fences
                                     f"mmp_interval={DELAY_S}"])
    fs.mkfs()
    fs.mount()
    path = fs.mnt / "chunk"
    old, new = pattern(1, BS), pattern(2, length)
    path.write_bytes(old)
    fs.flush()                                  # clean: the daemon reads it back from the device
    writer = os.open(path, os.O_RDWR)           # a page-cache writer
    reader = os.open(path, os.O_RDONLY)         # opened under it: keeps its pages
    try:
        direct = os.open(path, os.O_WRONLY)     # direct_io: after it, opens drop the pages again
        try:
            assert os.pwrite(direct, old[:PAGE], 0) == PAGE
        finally:
            os.close(direct)
        assert os.pread(reader, BS, 0) == old   # every page cached and up to date
        mapped = mmap.mmap(reader, BS, mmap.MAP_SHARED, mmap.PROT_READ)
        fs.set_faults([{"op": "write", "effect": "delay", "seconds": DELAY_S}])
        (fs.mnt / "other").write_bytes(os.urandom(2 * BS))  # fills the dirty limit (two blocks, its least)
        throttled = fs.stats()["writers_throttled"]
        done = []
        thread = threading.Thread(target=lambda: done.append(os.pwrite(writer, new, 0)))
        thread.start()
        deadline = time.monotonic() + 30
        while fs.stats()["writers_throttled"] == throttled:  # the WRITE waits in the daemon
            assert time.monotonic() < deadline and thread.is_alive(), "the WRITE was never held"
            time.sleep(0.02)
        # The kernel has copied the new bytes into its pages. An open without
        # keep_cache drops them; the reader asks again, and the daemon does not
        # have the new bytes yet.
        os.close(os.open(path, os.O_RDONLY))
        assert os.pread(reader, BS, 0) == old, "the daemon answered bytes it did not have yet"
        thread.join(60)
        assert done == [length]
        expected = new + old[length:]
        # Through the mapping first: a page fault takes the cached page as it
        # is, where a read() (or mmap(), which fstat()s) may first ask for the
        # attributes and, seeing the new mtime, drop every page
        # (auto_inval_data) and so hide the defect.
        assert mapped[:] == expected, "a page refetched during the WRITE kept the older bytes"
        assert os.pread(reader, BS, 0) == expected
        assert os.pread(writer, BS, 0) == expected
        stats = fs.stats()
        assert stats["kernel_page_drops"] >= 1, stats
        assert stats["kernel_page_drops_failed"] == 0, stats
        mapped.close()
    finally:
        os.close(reader)
        os.close(writer)
    fs.set_faults([])
    assert path.read_bytes() == expected
    fs.umount()
    fs.assert_fsck_clean()
