"""Opens and stat() while a descriptor writes through the kernel's page cache.

A write through the page cache (an O_RDWR descriptor: kvfs gives only
write-only ones direct_io) copies its bytes into the kernel's pages before it
sends the WRITE. Whatever drops those pages in between (an open without
keep_cache, or a GETATTR reply with a new mtime under auto_inval_data) lets a
reader cache the daemon's older bytes for good: tests/test_stress.py saw
zeros after a write boundary of a chunked O_TRUNC rewrite. So while such a
writer is open, opens keep the pages and stat() shows the mtime the kernel
already had, and within 0.1 s of the close the real one
(kvfs/namespace/pagecache.py). These checks go through a real mount; the
race itself is what the stress test (O_RDWR and O_WRONLY chunked O_TRUNC
rewriters under buffered readers and cache drops) hunts, and what
tests/test_page_writer_races.py makes happen on purpose.
"""
import os
import time


def pattern(seed, n):
    return bytes((seed * 131 + i * 7 + (i >> 8)) % 251 + 1 for i in range(n))


def test_an_open_under_a_page_cache_writer_keeps_the_cached_pages(kvfs):
    path = kvfs.mnt / "f"
    path.write_bytes(pattern(1, 256 * 1024))
    writer = os.open(path, os.O_RDWR)
    try:
        os.pwrite(writer, pattern(2, 64 * 1024), 0)
        reader = os.open(path, os.O_RDONLY)
        try:
            expected = pattern(2, 64 * 1024) + pattern(1, 256 * 1024)[64 * 1024:]
            assert os.pread(reader, len(expected), 0) == expected      # now cached
            before = kvfs.stats()["read_requests"]
            for _ in range(5):
                fd = os.open(path, os.O_RDONLY)
                try:
                    assert os.pread(fd, len(expected), 0) == expected
                finally:
                    os.close(fd)
            assert kvfs.stats()["read_requests"] == before, "an open dropped the page-cache writer's pages"
        finally:
            os.close(reader)
    finally:
        os.close(writer)
    # With the writer gone, the next open drops the pages as after any change.
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 16, 0) == pattern(2, 16)
    finally:
        os.close(fd)
    kvfs.umount()
    kvfs.assert_fsck_clean()


def test_stat_shows_the_writes_mtime_once_the_page_cache_writer_closes(kvfs):
    path = kvfs.mnt / "f"
    path.write_bytes(pattern(1, 8192))
    before = os.stat(path).st_mtime_ns
    time.sleep(0.01)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, pattern(3, 100), 0)
        during = os.stat(path)
        assert during.st_mtime_ns == before             # what the kernel already had
        assert during.st_size == 8192
        os.pwrite(fd, pattern(4, 9000), 0)
        assert os.stat(path).st_size == 9000            # sizes are never held back
    finally:
        os.close(fd)
    # close() does not wait for the daemon to see the RELEASE, so allow it a
    # moment, but much less than the kernel's attribute timeout (1 s).
    deadline = time.monotonic() + 0.5
    while (after := os.stat(path).st_mtime_ns) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert after > before, "the kernel cached the held-back mtime past the close"
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, 10)                            # a setattr reply carries the real mtime
        assert os.fstat(fd).st_mtime_ns > after
    finally:
        os.close(fd)
    assert path.read_bytes() == pattern(4, 10)
    kvfs.umount()
    kvfs.assert_fsck_clean()
