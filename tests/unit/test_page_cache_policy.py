"""What opens tell the kernel about its page cache while a page-cache writer is open
(kvfs/namespace/pagecache.py), in-process: no open drops the pages, the mtime the
kernel is shown stays put until the last such writer closes, and a direct_io
write in between ends both."""
import os

from kvfs.namespace import ROOT_INO

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, running, write_file


async def test_opens_under_a_page_cache_writer_keep_the_pages_and_the_kernels_mtime(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    async with running(fs):
        ino = await write_file(ns, ROOT_INO, b"f", pattern(1, 2 * BS))
        inode = ns.inode(ino)
        reader, _, keep = ns.open(ino, os.O_RDONLY)
        assert keep is False                        # the first open since the write drops stale pages
        shown, held_back = ns.mtime_for_kernel(inode)   # what a GETATTR tells the kernel now
        assert not held_back
        writer, direct_io, keep = ns.open(ino, os.O_RDWR | os.O_TRUNC)
        assert (direct_io, keep) == (False, False)  # the first page-cache writer: nothing to protect yet
        await ns.write(writer, 0, pattern(2, BS + 7))
        assert inode.mtime > shown
        # A changed mtime would make the kernel drop the pages; a held-back one
        # must not be cached by the kernel (attr_timeout 0), so the close shows.
        assert ns.mtime_for_kernel(inode) == (shown, True)
        for flags in (os.O_RDONLY, os.O_RDWR, os.O_WRONLY):
            fh, direct_io, keep = ns.open(ino, flags)
            assert keep is True, f"an open with flags {flags:#o} under a page-cache writer drops its pages"
            assert direct_io is (flags == os.O_WRONLY)
            await ns.release(fh)
        await ns.write(writer, BS + 7, pattern(3, 100))
        assert ns.mtime_for_kernel(inode) == (shown, True)
        await ns.release(writer)
        assert ns.mtime_for_kernel(inode) == (inode.mtime, False)
        fh, _, keep = ns.open(ino, os.O_RDONLY)
        assert keep is False                        # content changed since the pages were cached
        await ns.release(fh)
        await ns.release(reader)
        await ns.flush_all()
    close_and_check(fs)


async def test_a_direct_io_write_under_a_page_cache_writer_ends_the_shield(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    async with running(fs):
        ino = await write_file(ns, ROOT_INO, b"f", pattern(1, BS))
        inode = ns.inode(ino)
        fsyncer, _, _ = ns.open(ino, os.O_RDWR)      # opened only to fsync: a page-cache writer
        shown, _ = ns.mtime_for_kernel(inode)
        direct, direct_io, _ = ns.open(ino, os.O_WRONLY | os.O_TRUNC)
        assert direct_io
        await ns.write(direct, 0, pattern(4, 3 * BS))
        # The kernel did not update its pages for that write, so they are stale:
        # opens must drop them again and the real mtime must show.
        fh, _, keep = ns.open(ino, os.O_RDONLY)
        assert keep is False
        assert ns.mtime_for_kernel(inode) == (inode.mtime, False)
        assert inode.mtime != shown
        await ns.release(fh)
        await ns.release(direct)
        await ns.release(fsyncer)
        assert inode.direct_writes_under_page_writers is False
        await ns.flush_all()
    close_and_check(fs)


async def test_a_setattr_reply_shows_the_real_mtime(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    async with running(fs):
        ino = await write_file(ns, ROOT_INO, b"f", pattern(1, BS))
        inode = ns.inode(ino)
        writer, _, _ = ns.open(ino, os.O_RDWR)
        shown, _ = ns.mtime_for_kernel(inode)
        await ns.write(writer, 0, pattern(5, 10))
        assert ns.mtime_for_kernel(inode) == (shown, True)
        await ns.setattr(ino, size=5)              # ftruncate: the kernel drops no pages for its reply
        assert ns.mtime_for_kernel(inode) == (inode.mtime, False)
        assert inode.mtime != shown
        await ns.setattr(ino, mtime=1_234_567_890)  # utimens
        assert ns.mtime_for_kernel(inode) == (1_234_567_890, False)
        await ns.write(writer, 0, pattern(6, 10))
        assert ns.mtime_for_kernel(inode) == (1_234_567_890, True)
        await ns.release(writer)
        await ns.flush_all()
    close_and_check(fs)
