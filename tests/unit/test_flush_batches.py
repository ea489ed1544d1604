"""Small blocks are flushed in batches: one hashing hand-off and one device call per batch.

BlockIndex.store_blocks is store_block for many blocks at once; a block that
dedups, repeats one earlier in the batch or fails its write must come out
exactly as it would have alone. The write-back side forms the batches from
the small blocks waiting for a worker.
"""
import errno

import trio

from kvfs.blockcache import FileData
from kvfs.blockcache.writeback import BATCH_BLOCKS
from kvfs.errors import DeviceError

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, running, slow_writes, wait_until

SMALL = 5000            # bytes: a small file's only block, well under a quarter block


def blocks(*seeds):
    return [(pattern(seed, SMALL), None, 0) for seed in seeds]


async def test_a_batch_stores_new_blocks_once_and_dedups_the_rest(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    index, device = fs.index, fs.device
    existing = await index.store_block(pattern(9, SMALL))
    writes_before = device.statistics().writes
    outcomes = await index.store_blocks(blocks(1, 2, 1, 9, 3))
    assert outcomes == [index.key_of(pattern(s, SMALL)) for s in (1, 2, 1, 9, 3)]
    assert outcomes[3] == existing
    st = index.statistics()
    assert st.blocks_written == 4 and st.dedup_hits == 2          # 9 (stored before) and the second 1
    assert device.statistics().writes - writes_before == 3         # 1, 2 and 3, each once
    assert index.entries[outcomes[0]].pins == 2                    # one pin per block of the batch
    assert index.entries[existing].pins == 2
    for key, seed in zip(outcomes, (1, 2, 1, 9, 3)):
        assert bytes(await index.read_block(key)) == pattern(seed, SMALL)
    for key in outcomes + [existing]:
        index.unpin(key)
    assert index.block_count() == 0 and index.used_bytes == 0
    close_and_check(fs)


async def test_a_failed_write_fails_its_block_alone(tmp_path):
    fs = open_fs(mkfs(tmp_path), faults=[{"op": "write", "effect": "eio", "count": 1}])
    index = fs.index
    free_before = fs.store.statistics().free_bytes
    outcomes = await index.store_blocks(blocks(1, 2, 3))
    failed = [o for o in outcomes if isinstance(o, DeviceError)]
    stored = [o for o in outcomes if isinstance(o, bytes)]
    assert len(failed) == 1 and failed[0].errno == errno.EIO and len(stored) == 2
    assert index.block_count() == 2 and index.statistics().blocks_written == 2
    for key in stored:
        index.unpin(key)
    # The failed block's extent came straight back; the others' go with their last pin,
    # reusable once a commit makes the frees durable.
    await fs.index.commit()
    await wait_until(lambda: fs.store.statistics().free_bytes == free_before, what="extents to come back")
    close_and_check(fs)


async def test_small_files_waiting_for_a_worker_are_flushed_together(tmp_path):
    # One worker, and device writes slow enough that files queue up behind the first flush.
    fs = open_fs(mkfs(tmp_path), faults=slow_writes(0.05), flush_workers=1, dirty_limit=16 * BS,
                 cache_size=64 * BS)
    cache = fs.cache
    files = [FileData() for _ in range(40)]
    async with running(fs):
        for seed, filedata in enumerate(files):
            await cache.write(filedata, 0, pattern(seed, SMALL + seed))
        async with trio.open_nursery() as nursery:
            for filedata in files:
                nursery.start_soon(cache.flush_file, filedata)
        st = cache.statistics()
        assert st.blocks_flushed == 40 and st.dirty_bytes == 0
        assert 1 < st.flush_batch_max <= BATCH_BLOCKS
        assert st.flush_batches < 40
        assert fs.index.statistics().blocks_written == 40
        for seed, filedata in enumerate(files):
            assert isinstance(filedata.blocks[0], bytes)
            assert bytes(await cache.read(filedata, 0, SMALL + seed)) == pattern(seed, SMALL + seed)
        for filedata in files:
            cache.release(filedata)
        assert fs.index.block_count() == 0 and fs.index.reserved_bytes == 0
    close_and_check(fs)


async def test_large_blocks_are_flushed_one_per_call(tmp_path):
    fs = open_fs(mkfs(tmp_path), faults=slow_writes(0.05), flush_workers=1)
    cache = fs.cache
    filedata = FileData()
    async with running(fs):
        await cache.write(filedata, 0, pattern(1, 4 * BS + SMALL))
        await cache.flush_file(filedata)
        st = cache.statistics()
        # Four whole blocks and the small tail: five calls (the tail may not join a whole block).
        assert st.blocks_flushed == 5 and st.flush_batches == 5 and st.flush_batch_max == 1
        assert bytes(await cache.read(filedata, 0, 4 * BS + SMALL)) == pattern(1, 4 * BS + SMALL)
        cache.release(filedata)
    close_and_check(fs)
