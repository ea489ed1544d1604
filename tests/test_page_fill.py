"""Page fills at open (kvfs/pagefill.py), through a real mount with page_fill=on.

What must hold: a cold buffered read of a sealed file is served from pages the
daemon stored into the kernel before it answered the open (no READ reaches the
daemon); a warm reopen fills nothing; a rewrite, a truncate or an O_RDWR write
after a fill is seen by the next reader, never the filled bytes; a corrupt or
unreadable block still reads as EIO. Every test ends with fsck (the fixture).
"""
import errno
import hashlib
import mmap
import os
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
    fs = kvfs_factory(mount_options=["page_fill=on"])
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


def test_readers_racing_a_rewriter_see_one_whole_version(filled):
    """Cold reopens fill the kernel while another thread rewrites the file: a reader
    sees the old bytes or a prefix of the new ones, never old bytes left in a page."""
    fs = filled
    path = fs.mnt / "chunk"
    versions = [os.urandom(3 * MiB + 4097) for _ in range(2)]
    write_new(path, versions[0])
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
        write_new(path, versions[(counts["rewrites"] + 1) % 2])
        fs.flush()                           # stored blocks, so the next cold open fills them
        drop_kvfs_cache(fs)

    def read():
        drop_kvfs_cache(fs)
        got = read_whole(path)
        if not any(v.startswith(got) for v in versions):
            failures.append((len(got), [hashlib.sha256(v[:len(got)]).hexdigest()[:12] for v in versions],
                             hashlib.sha256(got).hexdigest()[:12]))

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


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
@pytest.mark.parametrize("effect", ["eio", "flip"])
def test_a_bad_block_is_left_out_of_the_fill_and_reads_as_eio(kvfs_factory, effect):
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0", "page_fill=on"])
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
