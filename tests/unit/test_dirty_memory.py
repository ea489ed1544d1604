"""The write cache's memory: a small file's dirty block takes the pages it uses, not a whole block.

Dirty buffers are block-sized (1 MiB by default) so that a flush can write a
block from them with O_DIRECT. Up to dirty_limit of them wait for the device.
When each was populated whole, every small file waiting for its flush held a
resident 1 MiB: tools/kvfs-bench meta (200,000 files of 4 KiB, the flush
behind the writers) peaked at 1.8 GiB of RSS, 1.4 GiB of it such buffers.
"""
import os

import trio

from kvfs.namespace import ROOT_INO

from .helpers import DIR_MODE, FILE_MODE, close_and_check, mkfs, open_fs, running

MIB = 1 << 20
FILES = 200


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_small_files_waiting_for_their_flush_hold_only_the_pages_they_wrote(tmp_path):
    path = mkfs(tmp_path, size=1 << 30, block_size=MIB)
    fs = open_fs(path, cache_size=512 * MIB, dirty_limit=256 * MIB)
    ns = fs.ns
    grown = {}

    async def write_then_flush():
        d = ns.make(ROOT_INO, b"d", DIR_MODE, 0, 0)
        before = _rss()
        # No flush workers yet: every file's block stays dirty, as when the
        # device is behind the writers.
        for i in range(FILES):
            ino = ns.make(d, b"f%04d" % i, FILE_MODE, 0, 0)
            fh, _, _ = ns.open(ino, os.O_WRONLY)
            await ns.write(fh, 0, (i + 1).to_bytes(8, "little") * 512)     # 4 KiB
            await ns.release(fh)
        grown["rss"] = _rss() - before
        grown["dirty"] = fs.cache.dirty_bytes
        async with running(fs):
            pass                                   # flushes, records and checkpoints all of it

    trio.run(write_then_flush)
    assert grown["dirty"] == FILES * MIB           # what dirty_limit accounts: a block each
    # Resident: a page or two each, not 200 MiB of whole buffers.
    assert grown["rss"] < 40 * MIB, f"{FILES} dirty 4 KiB files grew RSS by {grown['rss'] / MIB:.0f} MiB"
    close_and_check(fs)
