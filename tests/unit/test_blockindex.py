"""BlockIndex: keyed content keys, dedup, refs/pins, verified reads, space reservation."""
import errno
import os

import pytest
import trio
import trio.testing
import xxhash

from kvfs import schema
from kvfs.blockindex import BlockEntry
from kvfs.device import Device
from kvfs.errors import CorruptBlock, FormatError, KvfsError, NoSpace, SpaceAwaitsCommit
from kvfs.namespace import ROOT_INO
from kvfs.store.loader import load

from .helpers import BS, DIR_MODE, close_and_check, flip_byte, mkfs, open_fs, pattern, running, slow_writes


def aligned(n):
    return (n + 4095) // 4096 * 4096


def written_checkpoint(path):
    """The CheckpointState on the device now (read beside the open stack, as fsck would)."""
    device = Device.open(str(path), readonly=True, lock=False)
    try:
        return load(device).state
    finally:
        device.close()


async def test_content_keys_are_keyed_by_the_seed_and_the_secret(tmp_path):
    p1, p2 = mkfs(tmp_path, name="one"), mkfs(tmp_path, name="two")
    fs1, fs2 = open_fs(p1), open_fs(p2)
    data = pattern(1, BS)
    k1, k2 = fs1.index.key_of(data), fs2.index.key_of(data)
    assert len(k1) == 16
    sb = fs1.store.sb
    assert k1 == xxhash.xxh3_128_digest(sb.key_secret + data, seed=sb.hash_seed)   # docs/format.md
    assert k1 != xxhash.xxh3_128_digest(data, seed=sb.hash_seed)          # the secret is in it
    assert fs1.index.key_of(data, domain=7) == xxhash.xxh3_128_digest(
        sb.key_secret + (7).to_bytes(8, "little") + data, seed=sb.hash_seed)
    assert k1 != k2                                   # different filesystems, different keys
    assert await fs1.index.hash(data) == k1           # the threaded path computes the same key
    assert fs1.index.key_of(data[:-1] + b"\x00") != k1
    close_and_check(fs1)
    close_and_check(fs2)


async def test_identical_data_is_written_once(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    index, device = fs.index, fs.device
    data = pattern(2, BS)
    before = device.statistics().bytes_written
    k1 = await index.store_block(data)
    after_first = device.statistics().bytes_written
    assert after_first - before == BS
    k2 = await index.store_block(bytes(data))        # same bytes, another buffer
    assert k2 == k1
    assert device.statistics().bytes_written == after_first   # no device write at all
    e = index.entries[k1]
    assert (e.refs, e.pins) == (0, 2)
    st = index.statistics()
    assert (st.unique_blocks, st.blocks_written, st.dedup_hits, st.used_bytes) == (1, 1, 1, BS)
    # Different data is a different block.
    k3 = await index.store_block(pattern(3, BS))
    assert k3 != k1 and index.statistics().unique_blocks == 2
    assert index.extent(k3)[0] != index.extent(k1)[0]
    # What was written is what reads back (verified).
    assert await index.read_block(k1) == data
    await fs.ns.checkpoint()                      # pinned-only blocks are free in a checkpoint
    close_and_check(fs)


async def test_concurrent_stores_of_the_same_block_write_it_once(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.2))     # slow device: both stores overlap
    index = fs.index
    data = pattern(4, BS)
    keys = []

    async def store():
        keys.append(await index.store_block(data))

    before = fs.device.statistics().bytes_written
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(store)
        await trio.testing.wait_all_tasks_blocked()
    assert len(set(keys)) == 1 and len(keys) == 4
    assert fs.device.statistics().bytes_written - before == BS
    st = index.statistics()
    assert (st.blocks_written, st.dedup_hits) == (1, 3)
    assert index.entries[keys[0]].pins == 4
    await fs.ns.checkpoint()
    close_and_check(fs)


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
async def test_corrupt_block_raises_and_never_returns_wrong_bytes(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    index = fs.index
    data = pattern(5, BS)
    key = await index.store_block(data)
    off, length = index.extent(key)
    assert length == BS
    flip_byte(path, off + 1234)
    with pytest.raises(CorruptBlock) as info:
        await index.read_block(key)
    assert info.value.errno == errno.EIO
    assert key.hex() in str(info.value)
    assert index.statistics().corrupt_reads == 1
    # The cache surfaces the same error; it never caches or returns the bad bytes.
    with pytest.raises(KvfsError) as info:
        await fs.cache.get(key)
    assert info.value.errno == errno.EIO
    st = fs.cache.statistics()
    assert (st.cache_bytes, st.cache_misses, st.cache_hits) == (0, 1, 0)     # nothing was kept
    flip_byte(path, off + 1234)                       # repaired behind our back: reads work again
    assert await index.read_block(key) == data
    assert await fs.cache.get(key) == data            # a miss again: the bad bytes were never cached
    assert await fs.cache.get(key) == data            # now a hit
    st = fs.cache.statistics()
    assert (st.cache_bytes, st.cache_misses, st.cache_hits) == (BS, 2, 1)
    await fs.ns.checkpoint()
    close_and_check(fs)


async def test_short_blocks_use_aligned_space(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    index = fs.index
    key = await index.store_block(pattern(6, 5000))
    assert index.extent(key)[1] == 5000
    assert index.statistics().used_bytes == 8192
    assert fs.store.statistics().free_bytes == fs.store.sb.data_len - 8192
    assert await index.read_block(key) == pattern(6, 5000)
    await fs.ns.checkpoint()
    close_and_check(fs)


async def test_a_remount_builds_each_entry_as_its_constructor_would(tmp_path):
    """BlockIndex.load sets each entry's slots without BlockEntry's call (a million at a
    remount): the same values, the common lengths one object, domain 0 Python's own."""
    path = mkfs(tmp_path)
    fs = open_fs(path, dedup_groups=None)
    lengths = [1, 300, 300, 4096, 5000, 5000, BS]
    async with running(fs):
        for uid in (0, 1000):
            parent = fs.ns.make(ROOT_INO, b"u%d" % uid, DIR_MODE, uid, uid)
            for i, length in enumerate(lengths):
                ino = fs.ns.make(parent, b"f%d" % i, 0o100644, uid, uid)
                fh, _, _ = fs.ns.open(ino, os.O_WRONLY)
                await fs.ns.write(fh, 0, pattern(uid + i, length))
                await fs.ns.release(fh)
    before = {key: (e.off, e.length, e.refs, e.domain) for key, e in fs.index.entries.items()}
    used = fs.index.used_bytes
    close_and_check(fs)
    fs = open_fs(path, dedup_groups=None)
    entries = fs.index.entries
    assert len(entries) == 2 * len(lengths) and {e.domain for e in entries.values()} != {0}
    for key, e in entries.items():
        made = BlockEntry(e.off, e.length, e.refs, 0, e.domain, key)
        assert [getattr(e, s) for s in BlockEntry.__slots__] == [getattr(made, s) for s in BlockEntry.__slots__]
        assert (e.off, e.length, e.refs, e.domain) == before[key] and e.key is key
    assert fs.index.used_bytes == used == sum(aligned(e.length) for e in entries.values())
    for length in (300, 5000):
        assert len({id(e.length) for e in entries.values() if e.length == length}) == 1
    close_and_check(fs)


async def test_refs_and_pins_keep_a_block_until_both_are_gone(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    index, store = fs.index, fs.store
    key = await index.store_block(pattern(7, BS))
    off, length = index.extent(key)
    index.add_ref(key, off, length)                   # a content record names it
    index.add_ref(key, off, length)                   # twice (two files, or twice in one file)
    with pytest.raises(FormatError, match="two extents"):
        index.add_ref(key, off + 4096, length)
    index.unpin(key)
    index.drop_ref(key)
    assert key in index.entries and store.pending_free_bytes == 0
    # While referenced by durable content, a checkpoint lists it with its refs.
    blocks, transient = index.snapshot()
    assert blocks == [schema.BlockRow(key=key, off=off, length=length, refs=1)]
    assert transient == []
    await fs.ns.checkpoint()
    state = written_checkpoint(path)
    assert state.blocks == [schema.BlockRow(key=key, off=off, length=length, refs=1)]
    assert all(not (s <= off < s + n) for s, n in state.free)
    index.pin(key)
    index.drop_ref(key)
    assert key in index.entries                        # still pinned
    blocks, transient = index.snapshot()               # ... but no longer durable: free in checkpoints
    assert blocks == [] and transient == [(off, length)]
    await fs.ns.checkpoint()
    state = written_checkpoint(path)
    assert state.blocks == []
    assert any(s <= off and off + aligned(length) <= s + n for s, n in state.free)
    assert key in index.entries and all(not (s <= off < s + n) for s, n in store.free_extents())
    index.unpin(key)
    assert key not in index.entries
    assert index.statistics().used_bytes == 0
    assert store.pending_free_bytes == aligned(length)     # freed, once a record makes it durable
    fs.ns.make(ROOT_INO, b"x", DIR_MODE, 0, 0)
    await fs.ns.commit()
    assert store.pending_free_bytes == 0
    assert store.statistics().free_bytes == store.sb.data_len
    await fs.ns.checkpoint()
    close_and_check(fs)


async def test_replayed_content_record_allocates_its_extent(tmp_path):
    """During replay add_ref claims the recorded extent from the free map."""
    path = mkfs(tmp_path)
    fs = open_fs(path)
    index, store = fs.index, fs.store
    store.replaying = True
    key = b"k" * 16
    off = store.sb.data_off + 10 * BS
    index.add_ref(key, off, BS)
    assert index.entries[key].refs == 1
    assert all(not (s <= off < s + n) for s, n in store.free_extents())
    with pytest.raises(FormatError, match="referenced twice"):
        index.add_ref(b"j" * 16, off, BS)             # a second key at the same extent
    index.drop_ref(key)                                # replay frees at once
    assert store.statistics().free_bytes == store.sb.data_len
    assert store.free_extents() == [(store.sb.data_off, store.sb.data_len)]
    store.replaying = False
    close_and_check(fs)


async def test_reserve_refuses_what_is_not_there(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    index, store = fs.index, fs.store
    total = store.statistics().free_bytes
    assert store.free_slots() * BS == total == index.available_bytes()
    await index.reserve(total - BS)
    assert index.available_bytes() == BS
    await index.reserve(BS)
    with pytest.raises(NoSpace) as info:
        await index.reserve(4096)
    assert info.value.errno == errno.ENOSPC
    assert index.statistics().reserved_bytes == total
    index.unreserve(total)
    assert index.available_bytes() == total
    close_and_check(fs)


async def test_reserve_gets_space_freed_by_unpinned_blocks(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    index, store = fs.index, fs.store
    fs.ns.make(ROOT_INO, b"dir", DIR_MODE, 0, 0)
    await fs.ns.commit()                              # nothing is pending from here on
    filler = store.allocate(store.statistics().free_bytes - 2 * BS)
    k1 = await index.store_block(pattern(10, BS))     # e.g. flushed blocks of a file still open
    k2 = await index.store_block(pattern(11, BS))
    with pytest.raises(NoSpace):
        await index.store_block(pattern(12, BS))      # the device really is full
    # The writer truncates its file: its never-recorded blocks are unpinned and freed.
    index.unpin(k1)
    assert store.pending_free_bytes == BS
    assert store.statistics().records_pending == 0
    # No durable record names k1's extent, so the space is free once a commit
    # says so. The index does not commit itself (it never calls up): it says that
    # space awaits a commit, the namespace commits (here: no record, nothing
    # written), and the retried reservation finds the space.
    with pytest.raises(SpaceAwaitsCommit) as info:
        await index.reserve(BS)
    assert isinstance(info.value, NoSpace) and info.value.errno == errno.ENOSPC
    assert index.statistics().reserved_bytes == 0
    commits = store.statistics().commits
    await fs.ns.commit()
    assert store.statistics().commits == commits       # no frame was needed
    assert store.pending_free_bytes == 0
    await index.reserve(BS)
    index.unreserve(BS)
    assert store.statistics().free_bytes == BS
    index.unpin(k2)
    store.free(filler, store.sb.data_len - 2 * BS)
    fs.ns.make(ROOT_INO, b"dir2", DIR_MODE, 0, 0)
    await fs.ns.commit()
    assert store.statistics().free_bytes == store.sb.data_len
    await fs.ns.checkpoint()
    close_and_check(fs)
