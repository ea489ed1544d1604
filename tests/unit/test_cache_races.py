"""Block cache races with the device, in-process and deterministic (a delayed device
through a fault plan): what a device read or write is working on must stay what
it was while the call is in flight."""
import json
import os

import trio

from kvfs.device import testfaults as kvfs_faults
from kvfs.namespace import ROOT_INO

from .helpers import (BS, assert_fsck_clean, mkfs, open_fs, pattern, poke, read_all, running, wait_until,
                      write_file)


def set_plan(path, plan):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan))
    os.replace(tmp, path)


async def wait_for_reload():
    await trio.sleep(kvfs_faults.RELOAD_INTERVAL * 1.5)


def is_free(store, off):
    return any(start <= off < start + n for start, n in store.free_extents())


async def test_a_prefetch_keeps_the_blocks_it_reads(tmp_path, monkeypatch):
    """A prefetch reads blocks nobody pins: a file emptied (and that made durable)
    while the read waits for the device frees them, and free space may be
    rewritten by any new block before the read reaches it. The prefetch then
    read other bytes and reported them as a checksum failure (an ERROR, a
    corrupt read counted) on a block that was never corrupt."""
    path = mkfs(tmp_path)
    plan = tmp_path / "plan.json"
    set_plan(plan, [])
    monkeypatch.setenv(kvfs_faults.ENV, f"@{plan}")
    fs = open_fs(path)
    async with running(fs):
        ino = await write_file(fs.ns, ROOT_INO, b"a", pattern(1, 4 * BS))
        fs.ns.drop_caches()
        offsets = [fs.index.entries[key].off for key in fs.ns.inode(ino).committed]
        set_plan(plan, [{"op": "read", "effect": "delay", "seconds": 0.5}])
        await wait_for_reload()
        fh, _, _ = fs.ns.open(ino, os.O_RDONLY)            # starts the prefetch of all four
        await wait_until(lambda: fs.cache.statistics().prefetch_inflight > 0, what="the prefetch")
        await fs.ns.setattr(ino, size=0)
        await fs.ns.fsync(fh)                             # the emptied file is durable
        reused = [off for off in offsets if is_free(fs.store, off)]
        for off in reused:                                # what a new block would do there
            await trio.to_thread.run_sync(poke, path, off, pattern(2, BS))
        await wait_until(lambda: fs.cache.statistics().prefetch_inflight == 0, what="the prefetch's end")
        set_plan(plan, [])
        await fs.ns.release(fh)
        assert fs.index.statistics().corrupt_reads == 0, f"the extents at {reused} were free during the read"
    fs.close()
    assert_fsck_clean(path)


async def test_a_flush_whose_buffer_is_recycled_meanwhile_enters_no_wrong_block(tmp_path, monkeypatch):
    """A flush hashes a dirty buffer and then writes from it, without a copy. If the
    file is emptied (O_TRUNC) while the device write waits, the buffer goes back
    to the spares and another file's write fills it before the device reads it:
    the extent then holds bytes other than the ones the key was made from. The
    flush's result is void (the block is no longer the file's), and the key,
    entered when the write completed, is unpinned and freed before any other task
    runs, so no flush of the same content elsewhere (waiting for that very write)
    can dedup onto it. Every entry the index holds afterwards verifies."""
    path = mkfs(tmp_path)
    plan = tmp_path / "plan.json"
    set_plan(plan, [])
    monkeypatch.setenv(kvfs_faults.ENV, f"@{plan}")
    fs = open_fs(path)
    x, y = pattern(3, BS), pattern(4, BS)
    ns = fs.ns
    async with running(fs) as nursery:
        set_plan(plan, [{"op": "write", "effect": "delay", "seconds": 0.5}])
        await wait_for_reload()
        a = await write_file(ns, ROOT_INO, b"a", x, sync=False)
        d = ns.inode(a).data.blocks[0]
        buf = d.buf
        nursery.start_soon(fs.cache.flush_file, ns.inode(a).data)
        await wait_until(lambda: fs.index._writing, what="the device write of a's block")
        c = await write_file(ns, ROOT_INO, b"c", x, sync=False)      # the same content, another file
        nursery.start_soon(fs.cache.flush_file, ns.inode(c).data)
        fh, _, _ = ns.open(a, os.O_WRONLY | os.O_TRUNC)                # a's buffer is a spare now
        await ns.release(fh)
        b = await write_file(ns, ROOT_INO, b"b", y, sync=False)
        assert ns.inode(b).data.blocks[0].buf is buf, "b did not get a's buffer: the test proves nothing"
        await wait_until(lambda: not fs.index._writing, what="the device writes", limit_s=30)
        set_plan(plan, [])
        await ns.flush_all()
        for key, e in list(fs.index.entries.items()):
            await trio.to_thread.run_sync(fs.index.read_verified_sync, key, e.off, e.length, None, e.domain)
        assert await read_all(ns, c) == x
        assert await read_all(ns, b) == y
        assert ns.inode(a).size == 0
    fs.close()
    assert_fsck_clean(path)
