"""Where a file's new blocks go on the device: in runs, even when files are flushed together.

An engine writes several chunks at once (LMCache's disk_io_threads), and the flush
workers hash blocks in parallel, so plain next-fit used to interleave files and put
a file's blocks out of order: a cold read then cost a device call per block instead
of one per PREFETCH_RUN_BLOCKS (issue 9). The flush now places each block by the
file's blocks already placed (kvfs/blockcache/writeback.py, ``_place``), inside a
window the allocator leaves after a run's first block (kvfs/store/allocator.py).
"""
from kvfs.blockcache import FileData
from kvfs.blockindex.runs import RUN_WINDOW_BLOCKS

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, running

BLOCKS = 16


def runs_of(fs, filedata):
    """How many device runs (adjacent extents, any length) hold the file's blocks."""
    keys = list(dict.fromkeys(filedata.blocks))
    assert all(isinstance(k, bytes) for k in keys)
    return len(fs.index.adjacent_runs(keys, len(keys)))


async def write_interleaved(fs, files, blocks, *, seed=0):
    """Block 0 of every file, then block 1 of every file, ...: what writers running at once send."""
    for idx in range(blocks):
        for n, filedata in enumerate(files):
            await fs.cache.write(filedata, idx * BS, pattern(seed + 1000 * n + idx, BS))
    for filedata in files:
        await fs.cache.flush_file(filedata)


async def test_files_flushed_together_each_lie_in_runs_of_the_window(tmp_path):
    fs = open_fs(mkfs(tmp_path, size=64 << 20))
    files = [FileData() for _ in range(4)]
    async with running(fs):
        await write_interleaved(fs, files, BLOCKS)
        for n, filedata in enumerate(files):
            # Four files of 16 blocks, each block's neighbours written beside three other
            # files: at most one run per window, and the windows follow each other.
            assert runs_of(fs, filedata) <= BLOCKS // RUN_WINDOW_BLOCKS, n
            for idx in range(BLOCKS):
                assert await fs.cache.read(filedata, idx * BS, BS) == pattern(1000 * n + idx, BS)
    close_and_check(fs)


async def test_a_file_written_at_once_is_one_run_though_its_blocks_hash_in_parallel(tmp_path):
    fs = open_fs(mkfs(tmp_path, size=64 << 20))
    filedata = FileData()
    data = b"".join(pattern(idx, BS) for idx in range(BLOCKS))
    async with running(fs):
        await fs.cache.write(filedata, 0, data)           # every block queued at once
        await fs.cache.flush_file(filedata)
        assert runs_of(fs, filedata) == 1
        assert await fs.cache.read(filedata, 0, len(data)) == data
    close_and_check(fs)


async def test_placement_with_dedup_and_holes_keeps_every_byte(tmp_path):
    """Blocks that dedup against another file (placed by where that file keeps them) and
    zero blocks (holes, stored as nothing) only cost runs: every byte reads back, the
    accounting holds and fsck stays clean."""
    fs = open_fs(mkfs(tmp_path, size=64 << 20))
    async with running(fs):
        first = FileData()
        await write_interleaved(fs, [first], BLOCKS, seed=2000)
        mixed, holey = FileData(), FileData()

        def mixed_block(idx):
            return pattern(2000 + idx, BS) if idx % 2 else pattern(7000 + idx, BS)

        for idx in range(BLOCKS):
            await fs.cache.write(mixed, idx * BS, mixed_block(idx))
            if idx % 4:
                await fs.cache.write(holey, idx * BS, pattern(5000 + idx, BS))
        await fs.cache.write(holey, BLOCKS * BS - 1, b"\x01")
        for filedata in (mixed, holey):
            await fs.cache.flush_file(filedata)
        assert sum(b is None for b in holey.blocks) == BLOCKS // 4          # blocks 0, 4, 8 and 12
        for idx in range(BLOCKS):
            assert await fs.cache.read(first, idx * BS, BS) == pattern(2000 + idx, BS)
            assert await fs.cache.read(mixed, idx * BS, BS) == mixed_block(idx)
            want = pattern(5000 + idx, BS) if idx % 4 else bytes(BS)
            if idx == BLOCKS - 1:
                want = want[:-1] + b"\x01"
            assert await fs.cache.read(holey, idx * BS, BS) == want
        assert fs.index.statistics().dedup_hits >= BLOCKS // 2
    close_and_check(fs)


async def test_a_files_short_last_block_follows_it(tmp_path):
    """A chunk whose size is not a multiple of the block size (LMCache's fs connector puts
    a 28-byte header in front) must not cost its reader a device call for the tail."""
    fs = open_fs(mkfs(tmp_path, size=64 << 20))
    files = [FileData() for _ in range(3)]
    size = 2 * BS + 28
    async with running(fs):
        for off in range(0, size, BS):
            for n, filedata in enumerate(files):
                await fs.cache.write(filedata, off, pattern(100 * n + off // BS, min(BS, size - off)))
        for filedata in files:
            await fs.cache.flush_file(filedata)
        for n, filedata in enumerate(files):
            assert len(filedata.blocks) == 3
            assert runs_of(fs, filedata) == 1, n
            assert await fs.cache.read(filedata, 2 * BS, 28) == pattern(100 * n + 2, 28)
    close_and_check(fs)
