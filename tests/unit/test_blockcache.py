"""BlockCache: write-back, back-pressure, reads of dirty data, flush, truncate, holes, LRU, prefetch."""
import collections
import errno
import random
import threading

import pytest
import trio
import trio.testing

from kvfs.blockcache.reads import PREFETCH_RUN_BLOCKS
from kvfs.blockcache import Dirty, FileData
from kvfs.errors import DeviceError, KvfsError
from kvfs.namespace import ROOT_INO

from .helpers import (BS, close_and_check, mkfs, open_fs, pattern, running, slow_writes, wait_until,
                      write_file)


def check_accounting(fs, *filedatas):
    """Pins equal the live references of the given files; dirty bytes equal the dirty buffers."""
    counts = collections.Counter(k for filedata in filedatas for k in filedata.blocks if isinstance(k, bytes))
    for key, entry in fs.index.entries.items():
        assert entry.refs == 0
        assert entry.pins == counts[key], key.hex()
    assert set(counts) <= set(fs.index.entries)
    dirty = sum(isinstance(b, Dirty) for filedata in filedatas for b in filedata.blocks)
    assert fs.cache.dirty_bytes == dirty * BS
    assert fs.index.reserved_bytes == dirty * BS
    for filedata in filedatas:
        assert filedata.dirty_count == sum(isinstance(b, Dirty) for b in filedata.blocks)


async def test_write_returns_before_the_slow_device_has_the_data(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    # The device's writes wait at a gate the test opens only after the write returned:
    # a write that waited for the device would hang until fail_after ends it.
    gate, real_pwrite = threading.Event(), fs.device._sys_pwrite

    def gated_pwrite(view, off):
        assert gate.wait(60), "the device's writes were never let through"
        return real_pwrite(view, off)

    fs.device._sys_pwrite = gated_pwrite
    cache = fs.cache
    filedata = FileData()
    data = pattern(1, 4 * BS)
    async with running(fs):
        with trio.fail_after(30):
            await cache.write(filedata, 0, data)
        assert fs.device.statistics().writes == 0  # did not wait for even one device write
        st = cache.statistics()
        assert st.dirty_bytes == 4 * BS > 0
        assert st.flush_backlog_bytes == 4 * BS
        assert fs.index.statistics().blocks_written == 0
        assert filedata.size == 4 * BS and filedata.dirty_count == 4
        assert await cache.read(filedata, 0, 4 * BS) == data      # served from the dirty buffers
        gate.set()
        await cache.flush_file(filedata)
        assert filedata.dirty_count == 0
        assert all(isinstance(b, bytes) for b in filedata.blocks)
        st = cache.statistics()
        assert (st.dirty_bytes, st.flush_backlog_bytes, st.blocks_flushed) == (0, 0, 4)
        assert fs.index.statistics().blocks_written == 4
        check_accounting(fs, filedata)
        assert await cache.read(filedata, 0, 4 * BS) == data
    close_and_check(fs)


async def test_back_pressure_bounds_dirty_bytes(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, cache_size=8 * BS, dirty_limit=4 * BS, flush_workers=2, faults=slow_writes(0.01))
    cache = fs.cache
    assert cache.dirty_limit == 4 * BS
    files = [FileData(), FileData()]
    contents = [pattern(10, 24 * BS), pattern(11, 24 * BS)]
    peak = 0

    async def writer(filedata, data):
        nonlocal peak
        for off in range(0, len(data), 16 << 10):     # a writer far faster than the device
            await cache.write(filedata, off, data[off:off + (16 << 10)])
            peak = max(peak, cache.dirty_bytes)
            assert cache.dirty_bytes <= cache.dirty_limit

    async with running(fs):
        async with trio.open_nursery() as nursery:
            for filedata, data in zip(files, contents):
                nursery.start_soon(writer, filedata, data)
        st = cache.statistics()
        assert st.dirty_bytes_max <= st.dirty_limit
        assert st.writers_throttled > 0                # the writers really were held back
        assert peak > 0
        for filedata, data in zip(files, contents):
            await cache.flush_file(filedata)
            assert await cache.read(filedata, 0, len(data)) == data
        check_accounting(fs, *files)
        assert cache.statistics().dirty_bytes_max <= cache.dirty_limit
    close_and_check(fs)


async def test_reads_see_dirty_and_stored_data_exactly(tmp_path):
    """Random unaligned writes and reads against a bytearray model, flushing in between."""
    path = mkfs(tmp_path)
    fs = open_fs(path, cache_size=16 * BS, dirty_limit=6 * BS)
    cache = fs.cache
    rng = random.Random(99)
    filedata = FileData()
    model = bytearray()
    async with running(fs):
        for step in range(120):
            op = rng.random()
            if op < 0.6:
                off = rng.randrange(0, 10 * BS)
                n = rng.choice([1, 17, 4096, BS - 3, BS, 2 * BS + 5, rng.randrange(1, 3 * BS)])
                data = pattern(step, n) if rng.random() < 0.8 else bytes(n)
                await cache.write(filedata, off, data)
                if off > len(model):
                    model.extend(bytes(off - len(model)))
                model[off:off + n] = data
            elif op < 0.75:
                size = rng.randrange(0, 11 * BS)
                await cache.truncate(filedata, size)
                if size < len(model):
                    del model[size:]
                else:
                    model.extend(bytes(size - len(model)))
            elif op < 0.85:
                await cache.flush_file(filedata)
                assert filedata.dirty_count == 0
            elif op < 0.9:
                cache.drop_clean()
            assert filedata.size == len(model)
            off = rng.randrange(0, len(model) + 10) if model else 0
            n = rng.randrange(0, 3 * BS)
            assert await cache.read(filedata, off, n) == bytes(model[off:off + n]), step
        assert await cache.read(filedata, 0, len(model) + 100) == bytes(model)
        await cache.flush_file(filedata)
        check_accounting(fs, filedata)
        cache.drop_clean()
        assert await cache.read(filedata, 0, len(model)) == bytes(model)
    close_and_check(fs)


async def test_flush_file_waits_for_every_block_including_partial_ones(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.05))
    cache = fs.cache
    filedata = FileData()
    data = pattern(3, 2 * BS + 100)                 # two full blocks and a partial tail
    async with running(fs):
        await cache.write(filedata, 0, data)
        assert filedata.dirty_count == 3
        tail = filedata.blocks[2]
        assert isinstance(tail, Dirty) and not tail.queued      # partial blocks wait ...
        await cache.flush_file(filedata)                               # ... until someone flushes
        assert filedata.dirty_count == 0 and cache.dirty_bytes == 0
        assert fs.index.extent(filedata.blocks[2])[1] == 100           # the tail is stored short
        assert fs.index.statistics().used_bytes == 2 * BS + 4096
        await cache.flush_file(filedata)                               # idempotent, returns at once
        check_accounting(fs, filedata)
        cache.drop_clean()
        assert await cache.read(filedata, 0, 3 * BS) == data
    close_and_check(fs)


async def test_writes_during_a_flush_are_not_lost(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.1))
    cache = fs.cache
    filedata = FileData()
    async with running(fs):
        await cache.write(filedata, 0, pattern(1, BS))                 # full block: queued for flush
        await trio.testing.wait_all_tasks_blocked()              # the flush is writing it now
        await cache.write(filedata, 10, b"NEW")                        # modifies the block mid-flush
        expected = bytearray(pattern(1, BS))
        expected[10:13] = b"NEW"
        await cache.flush_file(filedata)
        assert await cache.read(filedata, 0, BS) == bytes(expected)
        cache.drop_clean()
        assert await fs.index.read_block(filedata.blocks[0]) == bytes(expected)
        check_accounting(fs, filedata)                                 # the superseded block was unpinned
        assert fs.index.statistics().unique_blocks == 1
    close_and_check(fs)


async def test_truncate_shrinks_extends_and_releases_blocks(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    cache = fs.cache
    filedata = FileData()
    data = pattern(4, 4 * BS)
    async with running(fs):
        await cache.write(filedata, 0, data)
        await cache.flush_file(filedata)
        assert fs.index.statistics().unique_blocks == 4
        # Shrink into the middle of block 1: blocks 2 and 3 go, block 1 is cut.
        await cache.truncate(filedata, BS + 1000)
        assert filedata.size == BS + 1000 and len(filedata.blocks) == 2
        assert isinstance(filedata.blocks[1], Dirty)
        assert fs.index.statistics().unique_blocks == 1          # block 1's old version is unpinned too
        assert await cache.read(filedata, 0, 4 * BS) == data[:BS + 1000]
        # Extending reads zeros, never the old bytes.
        await cache.truncate(filedata, 3 * BS)
        assert await cache.read(filedata, 0, 3 * BS) == data[:BS + 1000] + bytes(3 * BS - (BS + 1000))
        await cache.flush_file(filedata)
        cache.drop_clean()
        assert await cache.read(filedata, 0, 3 * BS) == data[:BS + 1000] + bytes(3 * BS - (BS + 1000))
        assert fs.index.extent(filedata.blocks[1])[1] == BS            # stored as written at flush time
        # Truncating a stored block whose file grew keeps reading zeros past its bytes.
        await cache.truncate(filedata, BS + 10)
        await cache.flush_file(filedata)
        await cache.truncate(filedata, 2 * BS)
        assert await cache.read(filedata, BS, BS) == data[BS:BS + 10] + bytes(BS - 10)
        await cache.truncate(filedata, 0)
        assert filedata.blocks == [] and filedata.size == 0
        assert fs.index.statistics().unique_blocks == 0
        assert await cache.read(filedata, 0, BS) == b""
        check_accounting(fs, filedata)
    close_and_check(fs)


async def test_truncate_while_blocks_are_being_flushed(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.1))
    cache = fs.cache
    filedata = FileData()
    data = pattern(5, 3 * BS)
    async with running(fs):
        await cache.write(filedata, 0, data)                           # three full blocks, all queued
        await trio.testing.wait_all_tasks_blocked()              # flushes are in flight
        await cache.truncate(filedata, BS + BS // 2)
        await cache.flush_file(filedata)
        assert await cache.read(filedata, 0, 3 * BS) == data[:BS + BS // 2]
        assert len(filedata.blocks) == 2
        check_accounting(fs, filedata)                                 # the dropped block's flush was unpinned
        assert fs.index.statistics().unique_blocks == 2
    close_and_check(fs)


async def test_zero_blocks_become_holes(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    cache = fs.cache
    filedata = FileData()
    async with running(fs):
        before = fs.device.statistics().bytes_written
        await cache.write(filedata, 0, bytes(3 * BS))                  # zeros into holes: nothing stored
        assert filedata.size == 3 * BS and filedata.dirty_count == 0 and cache.dirty_bytes == 0
        assert all(b is None for b in filedata.blocks)
        await cache.write(filedata, 5 * BS, bytes(10))                 # sparse extension, still nothing
        assert filedata.size == 5 * BS + 10
        await cache.flush_file(filedata)
        assert fs.device.statistics().bytes_written == before
        assert await cache.read(filedata, 0, filedata.size) == bytes(filedata.size)
        # A block that held data and is overwritten with zeros becomes a hole at flush.
        await cache.write(filedata, BS, pattern(6, BS))
        await cache.flush_file(filedata)
        assert isinstance(filedata.blocks[1], bytes)
        await cache.write(filedata, BS, bytes(BS))
        assert isinstance(filedata.blocks[1], Dirty)
        await cache.flush_file(filedata)
        assert filedata.blocks[1] is None
        assert cache.statistics().zero_blocks == 1
        assert fs.index.statistics().unique_blocks == 0          # the old block was released
        assert await cache.read(filedata, 0, filedata.size) == bytes(filedata.size)
        check_accounting(fs, filedata)
    close_and_check(fs)


async def test_identical_files_share_blocks(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    cache = fs.cache
    a, b = FileData(), FileData()
    data = pattern(7, 3 * BS)
    async with running(fs):
        await cache.write(a, 0, data)
        await cache.flush_file(a)
        written = fs.device.statistics().bytes_written
        await cache.write(b, 0, data)
        await cache.flush_file(b)
        assert fs.device.statistics().bytes_written == written   # the second copy cost no device writes
        assert a.blocks == b.blocks
        assert fs.index.statistics().dedup_hits == 3
        assert fs.index.statistics().unique_blocks == 3
        check_accounting(fs, a, b)
        cache.release(a)
        assert fs.index.statistics().unique_blocks == 3          # b still pins them
        check_accounting(fs, a, b)
        assert await cache.read(b, 0, len(data)) == data
    close_and_check(fs)


async def test_clean_lru_hits_misses_and_bound(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, cache_size=4 * BS, dirty_limit=2 * BS)
    cache = fs.cache
    filedata = FileData()
    data = pattern(8, 8 * BS)
    async with running(fs):
        await cache.write(filedata, 0, data)
        await cache.flush_file(filedata)
        assert cache.statistics().cache_bytes <= cache.cache_size
        cache.drop_clean()
        assert cache.statistics().cache_bytes == 0
        reads = fs.device.statistics().reads
        assert await cache.get(filedata.blocks[0]) == data[:BS]
        assert fs.device.statistics().reads == reads + 1
        assert await cache.get(filedata.blocks[0]) == data[:BS]         # a hit: no device read
        assert fs.device.statistics().reads == reads + 1
        st = cache.statistics()
        assert st.cache_hits >= 1 and st.cache_misses >= 1
        for i in range(8):
            assert await cache.read(filedata, i * BS, BS) == data[i * BS:(i + 1) * BS]
            assert cache.statistics().cache_bytes <= cache.cache_size
    close_and_check(fs)


async def test_prefetch_reads_ahead_with_bounded_depth(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, cache_size=32 * BS, dirty_limit=8 * BS, read_depth=3)
    cache = fs.cache
    filedata = FileData()
    data = pattern(9, 12 * BS)
    async with running(fs):
        await cache.write(filedata, 0, data)
        await cache.flush_file(filedata)
        cache.drop_clean()
        reads = fs.device.statistics().reads
        cache.prefetch(filedata)
        with trio.fail_after(20):
            while cache.statistics().cache_bytes < 12 * BS:
                await trio.sleep(0.01)
        st = cache.statistics()
        # read_depth bounds the runs in flight; a run is up to PREFETCH_RUN_BLOCKS adjacent
        # blocks read with one device call (one hand-off to a worker thread).
        assert 1 <= st.prefetch_inflight_max <= 3 * PREFETCH_RUN_BLOCKS
        assert fs.device.statistics().reads - reads == -(-12 // PREFETCH_RUN_BLOCKS)
        assert await cache.read(filedata, 0, 12 * BS) == data          # all hits now
        assert fs.device.statistics().reads - reads == -(-12 // PREFETCH_RUN_BLOCKS)
    close_and_check(fs)


@pytest.mark.expect_errors(
    r"kvfs\.blockcache(\.\w+)?: flushing a block failed \(attempt \d\): device write at \d+ failed: Bad file descriptor",
)
async def test_failed_flush_marks_the_file_lost_never_wrong(tmp_path, autojump_clock):
    """A device that refuses writes: retries (timed by trio's clock), then EIO-style failure."""
    path = mkfs(tmp_path)
    # io_timeout is measured on trio's clock, which autojump moves on whenever every task
    # waits for a device thread: under a virtual clock the device calls get no bound.
    fs = open_fs(path, readonly=True, io_timeout=None)
    cache = fs.cache
    filedata = FileData()
    async with running(fs, persist=False):
        await cache.write(filedata, 0, pattern(10, BS + 10))
        t0 = trio.current_time()
        with pytest.raises(KvfsError) as info:
            await cache.flush_file(filedata)
        # Three attempts with 0.2 s and 0.4 s back-off between them, in trio's (virtual) time:
        # the virtual clock moved on by the back-off (a blocking sleep would not move it), and
        # the block that failed the file went to the device three times (the other block's
        # last attempt may still be on its way).
        assert trio.current_time() - t0 >= 0.6
        assert fs.device.statistics().write_errors >= 3
        # A write to a read-only descriptor: the device error (EIO by its class) is what the file keeps.
        assert isinstance(info.value, DeviceError) and info.value.errno == errno.EIO
        assert filedata.failed is DeviceError
        assert filedata.blocks == [None, None] and filedata.dirty_count == 0
        assert cache.dirty_bytes == 0 and fs.index.reserved_bytes == 0
        assert fs.index.statistics().unique_blocks == 0
        # Failed writes give their extents straight back (a retry may still be finishing).
        await wait_until(lambda: fs.store.statistics().free_bytes == fs.store.sb.data_len,
                         what="failed flushes to return their extents")
        with pytest.raises(DeviceError) as info:
            await cache.read(filedata, 0, 10)
        assert info.value.errno == errno.EIO
        with pytest.raises(DeviceError) as info:
            await cache.write(filedata, 0, b"x")
        assert info.value.errno == errno.EIO
    close_and_check(fs)                                              # the store was never touched


async def test_flush_file_returns_when_a_partial_block_is_dirtied_during_it(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.1))
    cache = fs.cache
    filedata = FileData()
    finished = trio.Event()
    async with running(fs):
        await cache.write(filedata, 0, pattern(1, BS))          # a full block: queued, being written
        async with trio.open_nursery() as nursery:
            async def fsync():
                await cache.flush_file(filedata)
                finished.set()
            nursery.start_soon(fsync)
            await trio.testing.wait_all_tasks_blocked()   # flush_file is waiting for the file
            await cache.write(filedata, BS, b"tail")            # another writer: a partial block
            try:
                await wait_until(finished.is_set, what="flush_file to return", limit_s=3)
            finally:
                nursery.cancel_scope.cancel()
        assert filedata.dirty_count == 0
        assert await cache.read(filedata, 0, BS + 4) == pattern(1, BS) + b"tail"
    close_and_check(fs)


async def test_concurrent_readers_of_a_block_share_one_device_read(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    cache = fs.cache
    filedata = FileData()
    data = pattern(12, BS)
    async with running(fs):
        await cache.write(filedata, 0, data)
        await cache.flush_file(filedata)
        cache.drop_clean()
        reads = fs.device.statistics().reads
        results = []

        async def reader():
            results.append(bytes(await cache.read(filedata, 0, BS)))

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(reader)
        assert results == [data] * 5
        assert fs.device.statistics().reads - reads == 1
    close_and_check(fs)


@pytest.mark.parametrize("change", ["o_trunc", "truncate", "rewrite"])
async def test_a_read_waiting_for_the_device_sees_the_file_as_it_began(tmp_path, change):
    """A read that waits for the device while the file is emptied (O_TRUNC),
    truncated or rewritten returns the content it began with: never zeros for the
    blocks dropped meanwhile (the stress test's first find), never EIO for a block
    freed under it, never a block of the new content inside the old one."""
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=[{"op": "read", "effect": "delay", "seconds": 0.2}])
    cache = fs.cache
    filedata = FileData()
    old, new = pattern(13, 3 * BS + 17), pattern(14, 3 * BS + 17)
    async with running(fs):
        await cache.write(filedata, 0, old)
        await cache.flush_file(filedata)
        cache.drop_clean()
        got = []

        async def reader():
            got.append(bytes(await cache.read(filedata, 0, 4 * BS)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()       # the read waits for the device
            if change == "o_trunc":
                cache.release(filedata)
                await cache.write(filedata, 0, new[:BS // 2])
            elif change == "truncate":
                await cache.truncate(filedata, BS - 3)
            else:
                await cache.write(filedata, 0, new)
        assert got == [old]
        check_accounting(fs, filedata)                  # the read's pins are gone, the old blocks freed
        assert fs.index.statistics().unique_blocks == sum(isinstance(b, bytes) for b in filedata.blocks)
    close_and_check(fs)


async def test_recycled_dirty_buffers_never_show_their_old_bytes(tmp_path):
    """A recycled buffer is zeroed only as far as its last block wrote (not the whole
    block): whatever the next file leaves unwritten must still read as zeros."""
    path = mkfs(tmp_path)
    fs = open_fs(path, cache_size=32 * BS, dirty_limit=8 * BS)
    cache = fs.cache
    rng = random.Random(5)
    async with running(fs):
        old = FileData()
        noise = rng.randbytes(6 * BS)                 # whole blocks, then a partial one
        await cache.write(old, 0, noise + rng.randbytes(BS // 3))
        await cache.flush_file(old)                   # its buffers go back to the spare pool
        assert cache._spare and all(used > 0 for _, used in cache._spare)
        files = []
        for n in range(10):
            f = FileData()
            off = rng.randrange(0, BS // 2)
            data = rng.randbytes(rng.randrange(1, BS // 4))
            await cache.write(f, off, data)           # a partial block into a recycled buffer
            await cache.truncate(f, off + len(data) + rng.randrange(0, BS // 4))   # grown: zeros
            expect = bytes(off) + data
            expect += bytes(f.size - len(expect))
            assert await cache.read(f, 0, f.size) == expect, n
            files.append((f, expect))
        for f, expect in files:
            await cache.flush_file(f)
        cache.drop_clean()
        for f, expect in files:
            assert await cache.read(f, 0, f.size) == expect
    close_and_check(fs)


async def test_readers_that_waited_for_a_failed_read_each_read_again(tmp_path):
    """Three readers of one block; the first device read fails. The two that waited
    for it each read it again, and both get the bytes: each drops only its own claim
    (the second used to find its claim gone and fail with KeyError)."""
    path = mkfs(tmp_path)
    data = pattern(21, BS)
    fs = open_fs(path)
    async with running(fs):
        ino = await write_file(fs.ns, ROOT_INO, b"f", data)
        key = fs.ns.inode(ino).committed[0]
        off = fs.index.entries[key].off
    close_and_check(fs)
    fs = open_fs(path, faults=[{"op": "read", "range": [off, off + BS], "effect": "eio", "count": 1}])
    outcomes = []

    async def get():
        try:
            outcomes.append(bytes(await fs.cache.get(key)))
        except DeviceError as exc:
            outcomes.append(exc.errno)

    async with running(fs, persist=False):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(get)
        assert sorted(outcomes, key=lambda o: isinstance(o, bytes)) == [errno.EIO, data, data]
        assert key not in fs.cache._reading
    close_and_check(fs)
