"""The kernel page cache stays coherent with writes through direct_io descriptors.

kvfs opens write-only descriptors with FOPEN_DIRECT_IO and everything else
through the page cache (kvfs/namespace Namespace.open), and relies on the
kernel to drop the cached pages a direct_io write changed. The kernel drops
the written range before it sends the WRITE and again once the write is done,
so a page that a reader caches while the write waits in the daemon (here: for
room under dirty_limit, behind a slow device) holds the bytes from before the
write only until the write returns: never the old bytes of an overwrite
afterwards, nor, where the write grew the file, the zeros the kernel filled
the rest of the old last page with. Both through a mapping (a page fault
checks no attributes) and through read().

This was the suspected cause of the zeros tests/test_stress.py reported from
mmap readers; it is not (those were zeros past the end of a file that an
O_TRUNC rewrite shrank under the mapping, which POSIX prescribes: see
tests/stress_oracle.py). A kernel that drops pages only before the write
fails this test, and kvfs would then have to invalidate them itself after
each direct_io write.
"""
import ctypes
import mmap
import os
import threading
import time

import pytest

from kvfsmount import slow_writes, write_new

BS = 64 * 1024
PAGE = 4096


def pattern(seed, n):
    return bytes((seed * 131 + i * 7 + (i >> 8)) % 251 + 1 for i in range(n))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


class Mapping:
    """A read-only MAP_SHARED mapping of whole pages, the rest of the last page included
    (Python's mmap refuses a length past the end of the file)."""

    def __init__(self, fd, length):
        self.length = length
        self.addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if self.addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")

    def __getitem__(self, span):
        return ctypes.string_at(self.addr + span.start, span.stop - span.start)

    def close(self):
        _libc.munmap(self.addr, self.length)


def describe(got, want):
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"{len(got)} bytes of {len(want)}, first difference at {first}: "
            f"{got[first:first + 8].hex()} instead of {want[first:first + 8].hex()}")


@pytest.mark.parametrize("case", ["overwrite", "append"])
def test_page_cache_never_keeps_pages_from_before_a_direct_io_write(kvfs_factory, case):
    fs = kvfs_factory(size="1G", block_size="64K", faults=[],
                      mount_options=["cache_size=1M", "dirty_limit=128K"])
    fs.mkfs()
    fs.mount()
    f, filler = fs.mnt / "f", fs.mnt / "filler"
    old = pattern(1, 3 * PAGE + 100)                  # the last page holds 100 bytes
    write_new(f, old)
    fs.flush()
    if case == "overwrite":
        at, new = PAGE, pattern(2, PAGE)              # page 1, inside the file
    else:
        at, new = len(old), pattern(3, PAGE - 100)    # the rest of the last page: grows the file
    reader = os.open(f, os.O_RDONLY)                  # page cache
    writer = os.open(f, os.O_WRONLY)                  # direct_io
    mapped = Mapping(reader, 4 * PAGE)
    try:
        fs.set_faults(slow_writes(1.5))
        write_new(filler, pattern(4, 2 * BS))           # the dirty limit is now full for ~1.5 s
        done = threading.Event()

        def write():
            assert os.pwrite(writer, new, at) == len(new)   # waits in the daemon for dirty room
            done.set()

        t = threading.Thread(target=write)
        t.start()
        time.sleep(0.3)
        assert not done.is_set(), "the write did not wait: the test proves nothing"
        page = at - at % PAGE
        # Answered while the write waits: the page as it was (the rest of the last
        # page zero-filled by the kernel), now in the page cache.
        assert mapped[page:page + PAGE] == old[page:page + PAGE].ljust(PAGE, b"\0")
        t.join(30)
        assert done.is_set()
        want = old[:at] + new + old[at + len(new):]
        # The mapping first: a page fault checks no attributes, while read()
        # revalidates them, and a changed mtime makes the kernel drop every
        # cached page (auto_inval_data).
        got = mapped[0:len(want)]
        assert got == want, f"{case}: the mapping shows {describe(got, want)}"
        got = os.pread(reader, len(want) + PAGE, 0)
        assert got == want, (f"{case}: the reader got {describe(got, want)}")
    finally:
        mapped.close()
        os.close(reader)
        os.close(writer)
        fs.set_faults([])
    assert f.read_bytes() == want


def test_a_mapping_reads_zeros_past_the_end_of_a_file_shrunk_under_it(kvfs):
    """What tests/stress_oracle.py allows mmap readers: an O_TRUNC rewrite to a
    shorter content leaves a mapping that reads the new bytes up to the new end
    and zeros after it, to the end of that page (the length copied was the old
    size). kvfs serves only the file's bytes; the zeros are the kernel's."""
    f = kvfs.mnt / "f"
    old, new = pattern(5, 3 * PAGE - 43), pattern(6, 2 * PAGE + 81)     # the same last page
    write_new(f, old)
    fd = os.open(f, os.O_RDONLY)
    mapped = Mapping(fd, len(old))
    try:
        assert mapped[0:len(old)] == old
        write_new(f, new)                             # O_TRUNC, then the new content
        assert mapped[0:len(old)] == new + bytes(len(old) - len(new))
    finally:
        mapped.close()
        os.close(fd)
