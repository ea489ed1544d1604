"""An O_TRUNC open under readers (kvfs/namespace/truncation.py), in-process: reads
through the other descriptors see the old content until the kernel has finished
the truncating open, never the emptied file's short answer."""
import os

from kvfs.namespace import ROOT_INO

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, running, write_file


async def read_fh(ns, fh, size):
    return bytes(await ns.read(fh, 0, size))


async def test_reads_through_other_descriptors_see_the_old_content_until_the_open_is_done(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    old, new = pattern(1, 3 * BS + 100), pattern(2, 2611)
    async with running(fs):
        ino = await write_file(ns, ROOT_INO, b"f", old[:2 * BS])            # stored blocks ...
        w0, _, _ = ns.open(ino, os.O_WRONLY)
        await ns.write(w0, 2 * BS, old[2 * BS:])                            # ... and dirty ones
        await ns.release(w0)
        reader, _, _ = ns.open(ino, os.O_RDONLY)
        w, _, _ = ns.open(ino, os.O_WRONLY | os.O_TRUNC)
        assert ns.inode(ino).size == 0                                      # what stat says
        # A READ the kernel sent before it had the open's answer, answered now:
        assert await read_fh(ns, reader, 4 * BS) == old
        fs.cache.drop_clean()
        assert await read_fh(ns, reader, 4 * BS) == old                     # the old blocks stay pinned
        await ns.write(w, 0, new)                                           # the kernel is done with it
        assert await read_fh(ns, reader, 4 * BS) == new
        await ns.release(w)
        await ns.release(reader)

        # Without another descriptor open there is nothing to keep.
        w, _, _ = ns.open(ino, os.O_WRONLY | os.O_TRUNC)
        assert ns.inode(ino).pre_truncate is None
        await ns.release(w)

        # A request on the truncating descriptor ends it too (here its release).
        w0, _, _ = ns.open(ino, os.O_WRONLY)
        await ns.write(w0, 0, old)
        await ns.release(w0)
        reader, _, _ = ns.open(ino, os.O_RDONLY)
        w, _, _ = ns.open(ino, os.O_RDWR | os.O_TRUNC)
        assert await read_fh(ns, reader, 4 * BS) == old
        assert await read_fh(ns, w, 4 * BS) == b""                          # its own reads: the new file
        assert await read_fh(ns, reader, 4 * BS) == b""
        await ns.release(w)
        await ns.release(reader)
        assert ns.inode(ino).pre_truncate is None
        await ns.flush_all()
        assert fs.index.entries == {}, "a snapshot kept blocks pinned"
    close_and_check(fs)
