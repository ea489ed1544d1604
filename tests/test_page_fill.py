"""Page fills at open (kvfs/fuse/pagefill.py), through a real mount with page_fill=on.

What must hold: a cold buffered read of a sealed file is served from pages the
daemon stored into the kernel before it answered the open (no READ reaches the
daemon); a warm reopen fills nothing; a rewrite, a truncate or an O_RDWR write
after a fill is seen by the next reader, never the filled bytes; a corrupt or
unreadable block still reads as EIO. Every test ends with fsck (the fixture).
"""
import errno
import mmap
import os
import random
import struct
import threading

import pytest

from kvfsmount import drop_kernel_cache, write_new

MiB = 1 << 20


def drop_kvfs_cache(fs):
    """kvfs-admin drop-caches without a process per call (the tests below call it often)."""
    os.setxattr(fs.mnt / ".kvfs", "user.kvfs.control", b"drop-caches")


def make_cold(fs):
    drop_kernel_cache()
    drop_kvfs_cache(fs)


@pytest.fixture
def filled(kvfs_factory):
    fs = kvfs_factory(mount_options=["page_fill=on", "native_reads=off"])
    fs.mkfs()
    fs.mount()
    return fs


def read_whole(path):
    with open(path, "rb", buffering=0) as f:
        return f.read()


def test_a_cold_read_is_served_from_pages_filled_at_open(filled):
    fs = filled
    data = os.urandom(8 * MiB + 123)                  # a short last block and a partial last page
    write_new(fs.mnt / "chunk", data)
    fs.flush()
    fs.remount()                                      # empty caches, fresh statistics
    drop_kernel_cache()
    before = fs.stats()
    assert read_whole(fs.mnt / "chunk") == data
    stats = fs.stats()
    assert stats["page_fills"] - before["page_fills"] == 1, stats
    assert stats["page_fill_bytes"] - before["page_fill_bytes"] == len(data), stats
    assert stats["page_fill_blocks_skipped"] == stats["page_fill_stores_refused"] == 0, stats
    # Every page was in the kernel when read() began: not one READ reached the daemon.
    assert stats["kernel_read_requests"] - before["kernel_read_requests"] == 0, stats
    assert stats["blocks_fetched"] - before["blocks_fetched"] == 9, stats      # from the device, once

    # A warm reopen (kvfs still holds the blocks) stores nothing again.
    assert read_whole(fs.mnt / "chunk") == data
    again = fs.stats()
    assert again["page_fills"] == stats["page_fills"], again
    assert again["blocks_fetched"] == stats["blocks_fetched"], again


def test_o_direct_and_write_opens_fill_nothing(filled):
    fs = filled
    data = os.urandom(4 * MiB)
    write_new(fs.mnt / "chunk", data)
    fs.flush()
    make_cold(fs)
    fd = os.open(fs.mnt / "chunk", os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, len(data))
        assert os.readv(fd, [buf]) == len(data) and buf[:] == data
    finally:
        os.close(fd)
    make_cold(fs)
    with open(fs.mnt / "chunk", "r+b") as f:
        assert f.read() == data
    assert fs.stats()["page_fills"] == 0


def test_a_rewrite_after_a_fill_is_read_back(filled):
    fs = filled
    old, new = os.urandom(6 * MiB), os.urandom(5 * MiB + 77)
    path = fs.mnt / "chunk"
    write_new(path, old)
    fs.flush()
    make_cold(fs)
    assert read_whole(path) == old                    # filled into the kernel
    assert fs.stats()["page_fills"] == 1
    write_new(path, new)                              # O_TRUNC and one write, as LMCache does
    assert read_whole(path) == new                    # filled too if the flush was quicker than this open
    fs.flush()
    make_cold(fs)
    fills = fs.stats()["page_fills"]
    assert read_whole(path) == new                    # the new content, filled in its turn
    assert fs.stats()["page_fills"] == fills + 1


def test_a_truncate_and_an_o_rdwr_write_after_a_fill_are_read_back(filled):
    fs = filled
    data = os.urandom(4 * MiB + 5)
    path = fs.mnt / "chunk"
    write_new(path, data)
    fs.flush()
    make_cold(fs)
    with open(path, "rb") as reader:                  # filled, and kept open across the changes
        assert reader.read() == data
        os.truncate(path, 3 * MiB + 1)                # setattr(size): fenced
        assert read_whole(path) == data[:3 * MiB + 1]
        with open(path, "r+b") as writer:             # a page-cache writer
            writer.seek(MiB + 100)
            writer.write(b"x" * 5000)
        want = data[:MiB + 100] + b"x" * 5000 + data[MiB + 5100:3 * MiB + 1]
        assert read_whole(path) == want
        reader.seek(0)
        assert reader.read() == want
    fs.flush()
    make_cold(fs)
    assert read_whole(path) == want
    assert fs.stats()["page_fills"] >= 2


PAGE = 4096


def version_content(version, size):
    """Version ``version`` of a file: each 4 KiB page starts with (version, page
    index), so any page read back names the version it came from."""
    return b"".join(struct.pack("<QQ", version, page) + random.Random(version * 1_000_003 + page).randbytes(PAGE - 16)
                    for page in range(-(-size // PAGE)))[:size]


def stale_or_torn_pages(got, content_of):
    """What in ``got`` no reader of a file being rewritten may see: a page from no
    version (torn, or bytes nobody wrote), or a page of an older version after a
    page of a newer one (a stale page left in the kernel). A read() racing a
    rewrite may end in the new version where it began in the old one, since the
    kernel copies page by page and Python's readall() reads again after a short
    read: versions may only move forward along the file."""
    problems, newest = [], -1
    for off in range(0, len(got), PAGE):
        piece = got[off:off + PAGE]
        version = struct.unpack_from("<Q", piece)[0] if len(piece) >= 16 else newest
        if content_of(version)[off:off + len(piece)] != piece:
            problems.append((off, "from no version", version))
        elif version < newest:
            problems.append((off, f"version {version} after version {newest}"))
        newest = max(newest, version)
    return problems


def test_readers_racing_a_rewriter_never_see_a_stale_or_torn_page(filled):
    """Cold reopens fill the kernel while another thread rewrites the file: never a
    page of an older version after a newer one, never a page of no version."""
    fs = filled
    path = fs.mnt / "chunk"
    size = 3 * MiB + 4097
    contents = {}

    def content_of(version):
        if version not in contents:
            contents[version] = version_content(version, size)
        return contents[version]

    write_new(path, content_of(0))
    fs.flush()
    stop = threading.Event()
    failures, errors, counts = [], [], {"rewrites": 0, "reads": 0}

    def until_stopped(step, count):
        def loop():
            try:
                while not stop.is_set():
                    step()
                    counts[count] += 1
            except BaseException as exc:     # noqa: BLE001 - reported by the test below
                errors.append(exc)
                stop.set()
        return threading.Thread(target=loop)

    def rewrite():
        write_new(path, version_content(counts["rewrites"] + 1, size))
        fs.flush()                           # stored blocks, so the next cold open fills them
        drop_kvfs_cache(fs)

    def read():
        drop_kvfs_cache(fs)
        got = read_whole(path)
        problems = stale_or_torn_pages(got, content_of)
        if problems:
            failures.append((len(got), problems[:3]))

    threads = [until_stopped(rewrite, "rewrites")] + [until_stopped(read, "reads") for _ in range(2)]
    for t in threads:
        t.start()
    stop.wait(8)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not failures, failures[:3]
    stats = fs.stats()
    assert counts["rewrites"] >= 3 and counts["reads"] > 10 and stats["page_fills"] > 0, (counts, stats["page_fills"])


def test_the_page_check_finds_stale_and_torn_pages():
    """The check above can fail: an older page after a newer one, and a page of no version."""
    size = 5 * PAGE + 1
    old, new = version_content(1, size), version_content(2, size)
    content_of = {1: old, 2: new}.__getitem__
    assert stale_or_torn_pages(old, content_of) == []
    assert stale_or_torn_pages(old[:2 * PAGE] + new[2 * PAGE:], content_of) == []     # old, then new
    assert stale_or_torn_pages(new[:2 * PAGE] + old[2 * PAGE:], content_of)[0] == (2 * PAGE, "version 1 after version 2")
    torn = new[:PAGE + 100] + old[PAGE + 100:]
    assert stale_or_torn_pages(torn, content_of)[:2] == [(PAGE, "from no version", 2),
                                                         (2 * PAGE, "version 1 after version 2")]


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
@pytest.mark.parametrize("effect", ["eio", "flip"])
def test_a_bad_block_is_left_out_of_the_fill_and_reads_as_eio(kvfs_factory, effect):
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0", "page_fill=on", "native_reads=off"])
    fs.mkfs()
    fs.mount()
    start = os.path.getsize(fs.device) - fs.stats()["capacity_bytes"]
    good, bad = os.urandom(MiB), os.urandom(MiB)
    write_new(fs.mnt / "chunk", good)                 # on a fresh store: block 0 first, ...
    fs.flush()
    with open(fs.mnt / "chunk", "ab") as f:           # ... then block 1 right after it
        f.write(bad)
    fs.flush()
    fs.umount()
    fs.set_faults([{"op": "read", "range": [start + MiB, start + 2 * MiB], "effect": effect}])
    fs.mount()
    drop_kernel_cache()
    fd = os.open(fs.mnt / "chunk", os.O_RDONLY)
    try:
        assert os.pread(fd, MiB, 0) == good           # filled
        with pytest.raises(OSError) as info:
            got = os.pread(fd, MiB, MiB)
            assert got == bad, "wrong bytes"          # only if the read succeeded
        assert info.value.errno == errno.EIO
    finally:
        os.close(fd)
    stats = fs.stats()
    assert stats["page_fill_bytes"] == MiB and stats["page_fill_blocks_skipped"] == 1, stats
    assert stats["kernel_read_requests"] >= 1, stats   # the bad block's pages were asked for, and failed
    fs.set_faults([])
