"""Block cache races with the device, in-process and deterministic (a delayed device
through a fault plan): what a device read or write is working on must stay what
it was while the call is in flight."""
import json
import os

import trio

from kvfs import faults as kvfs_faults
from kvfs.namespace import ROOT_INO

from .helpers import BS, assert_fsck_clean, mkfs, open_fs, pattern, poke, running, wait_until, write_file


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
        offsets = [fs.index.entries[key].off for key in fs.ns.inode(ino).data.blocks]
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
