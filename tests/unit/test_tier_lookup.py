"""The namespace's side of the shared tier (kvfs/namespace/remote.py), over a tier port
that hands out given blocks: the file a lookup miss makes, its first open, and a crash
before its seal. The tier itself, with a real Ceph cluster, is tests/test_tier_*.py."""
import os

import trio

from kvfs.namespace import ROOT_INO

from .helpers import BS, close_and_check, lookup_path, mkfs, open_fs, pattern, read_all, running, slow_writes


class BlocksTier:
    """A TierPort whose tier holds one file per path, as (blocks, mode)."""
    miss_ttl = 0.5

    def __init__(self, files):
        self.files = files
        self.offered = []

    def offer(self, read):
        self.offered.append(read)
        return True

    async def fetch(self, path):
        await trio.sleep(0)
        return self.files.get(path)


def tier_blocks(data, size):
    return [data[i:i + size] for i in range(0, len(data), size)]


async def test_a_fetched_file_has_the_bytes_and_its_first_open_fills_the_kernel(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    data = pattern(7, 3 * BS + 1234)
    tier_block = BS // 2                    # the tier's block size need not be the store's
    ns.tier = BlocksTier({b"/chunk": (tier_blocks(data, tier_block), 0o640)})
    async with running(fs):
        ino = await ns.lookup_remote(ROOT_INO, b"chunk")
        assert lookup_path(ns, "chunk") == ino
        assert not [n for n, _ in ns.tree.dir(ROOT_INO).entries.items() if n != b"chunk"]   # no temp left
        assert ns.inode(ino).mode & 0o777 == 0o640
        assert await read_all(ns, ino) == data
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        assert ns.page_fill_size(fh, 1 << 30) == len(data)      # warm here, never in the kernel
        ns.page_fill_done(fh, len(data))
        await ns.release(fh)
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        assert ns.page_fill_size(fh, 1 << 30) == 0               # filled once: a warm reopen
        await ns.release(fh)
        await ns.seal(ns.inode(ino))
        assert ns.tier.offered == []        # a fetched file is not published back
        ns.forget(ino, 1)
    close_and_check(fs)


async def test_a_crash_before_a_fetched_files_seal_leaves_the_name_absent(tmp_path):
    """The rename onto the looked-up name does not wait for the seal (the lookup would
    wait for the device); the file is provisional until then, so a crash after the
    rename is durable but before the content record drops it, name and all."""
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.5))
    ns = fs.ns
    data = pattern(8, 2 * BS + 5)
    ns.tier = BlocksTier({b"/chunk": (tier_blocks(data, BS), 0o644)})
    async with running(fs, persist=False):
        ino = await ns.lookup_remote(ROOT_INO, b"chunk")
        inode = ns.inode(ino)
        assert inode.provisional and inode.content_dirty     # renamed before its blocks are written
        await ns.commit()                                    # the Make and the Move are durable
        ns.forget(ino, 1)
    fs.close()                                               # crash: the seal never finished
    fs = open_fs(path)
    assert lookup_path(fs.ns, "chunk") is None
    assert fs.store.statistics().free_bytes == fs.store.sb.data_len
    close_and_check(fs)

    fs = open_fs(path)                                       # the same, with the seal finished
    fs.ns.tier = BlocksTier({b"/chunk": (tier_blocks(data, BS), 0o644)})
    async with running(fs):
        ino = await fs.ns.lookup_remote(ROOT_INO, b"chunk")
        fs.ns.forget(ino, 1)
    fs.close()
    fs = open_fs(path)
    assert await read_all(fs.ns, lookup_path(fs.ns, "chunk")) == data
    close_and_check(fs)
