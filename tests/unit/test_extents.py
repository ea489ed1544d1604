"""ExtentStore (kvfs.store): journal commit/replay, torn tails, checkpoints and slot rotation, delayed frees."""
import errno
import os
import stat

import pytest
import trio
import trio.testing

from kvfs import schema
from kvfs.device import Device
from kvfs.errors import DeviceError, FormatError, JournalFull, NoSpace
from kvfs.namespace import ROOT_INO
from kvfs.store import ExtentStore
from kvfs.store.loader import load

from .helpers import (BS, DIR_MODE, Clock, close_and_check, assert_fsck_clean, flip_byte, lookup_path,
                      mkfs, open_fs, pattern, running, write_file)

S = schema.SECTOR


def reopen_store(path):
    """Open the store read-only the way mount does; returns (store, device).

    ``store.loaded`` is what mount replays: the CheckpointState, the journal's
    records (schema records) and the replay report.
    """
    device = Device.open(str(path), readonly=True)
    return ExtentStore.open(device), device


def names(fs):
    return sorted(fs.ns.tree.inodes[ROOT_INO].entries.names())


async def test_commit_then_reopen_replays_exactly_the_committed_records(tmp_path):
    path = mkfs(tmp_path)
    clock = Clock()
    fs = open_fs(path, now=clock)
    t0 = clock.t
    for i in range(3):
        fs.ns.make(ROOT_INO, b"d%d" % i, DIR_MODE, 1000, 1000)
    st = fs.store.statistics()
    assert st.records_pending == 3 and st.commits == 0 and st.journal_bytes == 0
    await fs.store.commit()
    st = fs.store.statistics()
    assert (st.records_pending, st.commits, st.journal_frames, st.journal_bytes) == (0, 1, 1, S)
    await fs.store.commit()                     # nothing new: no frame is written
    assert fs.store.statistics().commits == 1
    fs.ns.make(ROOT_INO, b"lost", DIR_MODE, 0, 0)   # appended, never committed: a crash loses it
    fs.close()

    store, device = reopen_store(path)
    try:
        expected = [schema.Make(parent=ROOT_INO, name=b"d%d" % i, ino=16 + i, mode=DIR_MODE, uid=1000,
                                gid=1000, rdev=0, ns=t0 + 1000 * (i + 1), target=None)
                    for i in range(3)]
        assert store.loaded.records == expected
        report = store.loaded.replay_report
        assert report["frames"] == 1 and report["records"] == 3
        assert report["stopped"] == "no further frame"
    finally:
        device.close()

    fs = open_fs(path)
    assert names(fs) == [b"d0", b"d1", b"d2"]
    assert fs.ns.tree.next_ino == 19
    assert fs.ns.tree.inodes[ROOT_INO].nlink == 5
    # Appending after replay continues the same journal generation.
    fs.ns.make(ROOT_INO, b"d3", DIR_MODE, 0, 0)
    await fs.store.commit()
    assert fs.store.statistics().journal_frames == 2
    fs.close()
    fs = open_fs(path)
    assert names(fs) == [b"d0", b"d1", b"d2", b"d3"]
    close_and_check(fs)


@pytest.mark.parametrize("where", ["payload", "header"])
async def test_torn_last_frame_is_dropped(tmp_path, where):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    fs.ns.make(ROOT_INO, b"first", DIR_MODE, 0, 0)
    await fs.store.commit()
    second_frame = fs.store.sb.journal_off + fs.store.statistics().journal_bytes
    fs.ns.make(ROOT_INO, b"second", DIR_MODE, 0, 0)
    await fs.store.commit()
    assert fs.store.statistics().journal_frames == 2
    fs.close()

    # Damage the last frame as a torn write would.
    flip_byte(path, second_frame + (schema.JOURNAL_FRAME.size + 3 if where == "payload" else 20))
    store, device = reopen_store(path)
    try:
        assert [r.name for r in store.loaded.records] == [b"first"]
        assert store.loaded.replay_report["frames"] == 1
        want = "torn frame" if where == "payload" else "no further frame"
        assert want in store.loaded.replay_report["stopped"]
    finally:
        device.close()

    fs = open_fs(path)
    assert names(fs) == [b"first"]
    # The next commit overwrites the torn frame with the next sequence number.
    fs.ns.make(ROOT_INO, b"third", DIR_MODE, 0, 0)
    await fs.store.commit()
    fs.close()
    fs = open_fs(path)
    assert names(fs) == [b"first", b"third"]
    assert fs.replayed["frames"] == 2
    close_and_check(fs)


async def test_frames_that_straddle_the_read_window_replay(tmp_path):
    """Large frames (symlink targets) crossing the 4 MiB replay window are read whole."""
    path = mkfs(tmp_path)
    fs = open_fs(path)
    made = {}
    for frame in range(8):
        for j in range(10):
            name = b"l%d_%d" % (frame, j)
            made[name] = pattern(frame * 10 + j, 64 << 10)
            fs.ns.make(ROOT_INO, name, stat.S_IFLNK | 0o777, 0, 0, target=made[name])
        await fs.store.commit()
    st = fs.store.statistics()
    assert st.journal_frames == 8 and st.generation == 1
    assert st.journal_bytes > 4 << 20              # the window boundary was crossed
    fs.close()
    fs = open_fs(path)
    assert fs.replayed["frames"] == 8 and fs.replayed["records"] == 80
    for name, target in made.items():
        assert fs.ns.tree.inodes[lookup_path(fs.ns, name.decode())].target == target
    close_and_check(fs)


async def test_full_journal_turns_the_commit_into_a_checkpoint(tmp_path):
    """The store says when the journal is full (JournalFull, nothing written, records kept);
    the namespace, which drives durability, then writes a checkpoint instead."""
    path = mkfs(tmp_path)
    fs = open_fs(path)
    made = 0
    while True:
        for _ in range(10):
            fs.ns.make(ROOT_INO, b"l%d" % made, stat.S_IFLNK | 0o777, 0, 0, target=pattern(made, 64 << 10))
            made += 1
        before = fs.store.statistics()
        try:
            await fs.store.commit()
        except JournalFull as exc:
            assert exc.errno == errno.ENOSPC
            break
        assert made < 200, "the journal never filled"
    st = fs.store.statistics()
    assert st == before                             # the refused commit wrote and dropped nothing
    assert st.generation == 1 and st.records_pending == 10 and st.checkpoints == 0
    await fs.ns.commit()
    st = fs.store.statistics()
    assert st.generation == 2 and st.checkpoints == 1 and st.journal_bytes == 0
    assert st.records_pending == 0
    fs.close()
    fs = open_fs(path)
    assert fs.replayed["records"] == 0            # everything is in the checkpoint
    assert "another generation" in fs.replayed["stopped"]
    assert len(fs.ns.tree.inodes[ROOT_INO].entries) == made
    close_and_check(fs)


def slot_headers(path, sb):
    device = Device.open(str(path), readonly=True, lock=False)   # the store may be open
    try:
        return [schema.decode_checkpoint_header(device.pread_sync(off, S), sb.checkpoint_len, sb.hash_seed)
                for off in (sb.checkpoint_a_off, sb.checkpoint_b_off)]
    finally:
        device.close()


async def test_checkpoint_rotates_slots_and_starts_a_new_generation(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    sb = fs.store.sb
    assert fs.store.generation == 1
    fs.ns.make(ROOT_INO, b"a", DIR_MODE, 0, 0)
    await fs.store.commit()
    await fs.ns.checkpoint()
    assert fs.store.generation == 2
    st = fs.store.statistics()
    assert (st.journal_bytes, st.journal_frames, st.records_pending, st.checkpoints) == (0, 0, 0, 1)
    a, b = slot_headers(path, sb)
    assert a[0] == 1 and b[0] == 2                  # the new one went to slot B, A kept
    fs.ns.make(ROOT_INO, b"b", DIR_MODE, 0, 0)      # journaled in generation 2
    await fs.store.commit()
    await fs.ns.checkpoint()
    a, b = slot_headers(path, sb)
    assert a[0] == 3 and b[0] == 2                  # back to slot A
    fs.close()
    store, device = reopen_store(path)
    try:
        assert store.generation == 3 and store.loaded.active_slot == 0
        assert store.loaded.records == []
        rows = {row.ino for row in store.loaded.state.inodes}
        assert {ROOT_INO, 16, 17} <= rows
    finally:
        device.close()
    fs = open_fs(path)
    assert names(fs) == [b"a", b"b"]
    close_and_check(fs)


async def test_torn_newer_checkpoint_falls_back_to_the_older_slot(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    sb = fs.store.sb
    fs.ns.make(ROOT_INO, b"in-checkpoint", DIR_MODE, 0, 0)
    await fs.ns.checkpoint()                        # generation 2, slot B
    fs.ns.make(ROOT_INO, b"in-journal", DIR_MODE, 0, 0)
    await fs.store.commit()                            # generation 2 journal, frame 0
    await fs.ns.checkpoint()                        # generation 3, slot A ...
    fs.close()
    # ... whose header write was torn. (The header is written after the payload
    # is durable, so a torn write never leaves a valid gen-3 header over a bad
    # payload; that case is damage, see test_store_salvage.py.)
    flip_byte(path, sb.checkpoint_a_off + 9)

    store, device = reopen_store(path)
    try:
        assert store.generation == 2 and store.loaded.active_slot == 1
        assert [r.name for r in store.loaded.records] == [b"in-journal"]
    finally:
        device.close()
    fs = open_fs(path)
    assert names(fs) == [b"in-checkpoint", b"in-journal"]
    # The next checkpoint overwrites the torn slot, never the good one.
    await fs.ns.checkpoint()
    assert fs.store.generation == 3
    a, b = slot_headers(path, sb)
    assert a[0] == 3 and b[0] == 2
    fs.close()
    fs = open_fs(path)
    assert names(fs) == [b"in-checkpoint", b"in-journal"]
    close_and_check(fs)


async def test_no_valid_checkpoint_is_a_format_error(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    await fs.ns.checkpoint()
    sb = fs.store.sb
    fs.close()
    flip_byte(path, sb.checkpoint_a_off + 3)           # header magic of slot A
    flip_byte(path, sb.checkpoint_b_off + S + 1)       # payload of slot B
    device = Device.open(str(path), readonly=True)
    try:
        with pytest.raises(FormatError, match="no valid checkpoint in either slot"):
            ExtentStore.open(device)
    finally:
        device.close()
    flip_byte(path, sb.checkpoint_b_off + S + 1)       # undo: slot B is whole again
    assert_fsck_clean(path)


async def test_pending_frees_are_not_reused_before_the_freeing_record_is_durable(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    store = fs.store
    sb = store.sb
    assert not store.replaying
    whole = store.allocate(sb.data_len)                # take the entire data region
    assert whole == sb.data_off and store.statistics().free_bytes == 0
    # A live free (as record application does) only queues the extent ...
    store.free(whole, sb.data_len)
    assert store.pending_free_bytes == sb.data_len
    assert store.statistics().free_bytes == 0 and store.free_extents() == []
    with pytest.raises(NoSpace):
        store.allocate(S)                              # ... so it cannot be handed out again
    # The record describing the change; once it is durable the space comes back.
    fs.ns.make(ROOT_INO, b"freeing-record", DIR_MODE, 0, 0)
    await store.commit()
    assert store.pending_free_bytes == 0
    assert store.free_extents() == [(sb.data_off, sb.data_len)]
    assert store.statistics().free_bytes == sb.data_len

    # Again, and this time a checkpoint is taken while the free is still queued:
    # the checkpoint's free map already counts it as free (no durable record
    # names it), and the checkpoint makes it reusable.
    assert store.allocate(sb.data_len) == sb.data_off
    store.free(sb.data_off, sb.data_len)
    assert store.pending_free_bytes == sb.data_len and store.free_extents() == []
    await fs.ns.checkpoint()
    assert store.pending_free_bytes == 0
    assert store.free_extents() == [(sb.data_off, sb.data_len)]
    device = Device.open(str(path), readonly=True, lock=False)     # the store is still open
    try:
        written = load(device)
    finally:
        device.close()
    assert written.generation == 2
    assert written.state.free == [(sb.data_off, sb.data_len)]
    assert written.state.blocks == []
    close_and_check(fs)


async def test_frees_during_replay_take_effect_at_once(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    store = fs.store
    store.replaying = True
    off = store.allocate(3 * S)
    store.free(off, 3 * S)
    assert store.pending_free_bytes == 0 and store.statistics().free_bytes == store.sb.data_len
    assert store.free_extents() == [(store.sb.data_off, store.sb.data_len)]
    store.replaying = False
    close_and_check(fs)


async def test_uncommitted_file_content_is_not_visible_after_a_crash(tmp_path):
    """A file whose content record never reached the journal is absent after a crash.

    Its create record was made durable by the commit (as another file's fsync
    would), but no close or fsync of it finished, so no content of it may show.
    """
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs, persist=False):
        ino = await write_file(fs.ns, ROOT_INO, b"durable", pattern(1, 3 * BS))
        fh, _, _ = fs.ns.open(fs.ns.make(ROOT_INO, b"volatile", 0o100644, 0, 0), os.O_WRONLY)
        await fs.ns.write(fh, 0, pattern(2, 2 * BS))
        await fs.cache.flush_file(fs.ns.handle(fh).inode.data)   # blocks on the device ...
        await fs.ns.commit()                                       # ... but no content record
    fs.close()                                                     # crash: nothing more written
    fs = open_fs(path)
    assert fs.ns.tree.inodes[ino].size == 3 * BS
    assert lookup_path(fs.ns, "volatile") is None
    assert fs.ns.tree.inodes[ROOT_INO].entries.get(b"volatile") is None
    # The orphaned blocks of "volatile" were never referenced: fsck sees free space.
    close_and_check(fs)


@pytest.mark.parametrize("persist", ["commit", "checkpoint"])
async def test_free_by_a_record_appended_during_an_inflight_commit_waits_for_that_record(tmp_path, persist):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    ns, store = fs.ns, fs.store
    async with running(fs, persist=False):
        ino = await write_file(ns, ROOT_INO, b"victim", pattern(7, BS))   # content durable
        key = ns.tree.inodes[ino].committed[0]
        off, length = fs.index.extent(key)
        ns.forget(ino, 1)                                # the kernel lets go of it
        ns.make(ROOT_INO, b"unrelated", DIR_MODE, 0, 0)
        before = store.statistics()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(getattr(ns, persist))      # the namespace drives both
            await trio.testing.wait_all_tasks_blocked()
            inflight = store.statistics()
            assert (inflight.commits, inflight.checkpoints) == (before.commits, before.checkpoints)
            # The frame is being written: a commit has taken the record off the queue;
            # a checkpoint keeps the records it covers queued until it is durable.
            assert inflight.records_pending == (0 if persist == "commit" else 1)
            # While that write is in flight: unlink the file. Its block's extent is freed
            # by the "rm" record, which is *not* part of the frame being written.
            ns.unlink(ROOT_INO, b"victim", directory=False)
            assert key not in fs.index.entries
            assert store.pending_free_bytes == 4096 * ((length + 4095) // 4096)
        st = store.statistics()
        assert (st.commits, st.checkpoints) != (before.commits, before.checkpoints)
        assert st.records_pending == 1                  # the rm record is still not durable ...
        # ... so a crash now brings "victim" back, naming the extent at ``off``. That extent
        # must not be reusable yet.
        assert store.pending_free_bytes > 0, "the extent was released before the rm record was durable"
        assert all(not (s <= off < s + n) for s, n in store.free_extents())
        await ns.commit()
        assert store.pending_free_bytes == 0
        assert any(s <= off < s + n for s, n in store.free_extents())
    await ns.checkpoint()
    close_and_check(fs)


async def test_replay_stops_at_a_frame_that_breaks_the_sequence(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    sb = fs.store.sb
    for name in (b"zero", b"one", b"two"):
        fs.ns.make(ROOT_INO, name, DIR_MODE, 0, 0)
        await fs.store.commit()
    fs.close()
    # Rewrite frame 1 as a well-formed frame with sequence number 7.
    import msgpack
    store, device = reopen_store(path)
    try:
        frame1 = [r.to_wire() for r in store.loaded.records if r.name == b"one"]
    finally:
        device.close()
    from .helpers import poke
    poke(path, sb.journal_off + S, schema.encode_journal_frame(1, 7, msgpack.packb(frame1), sb.hash_seed))
    store, device = reopen_store(path)
    try:
        assert [r.name for r in store.loaded.records] == [b"zero"]
        assert store.loaded.replay_report["frames"] == 1
    finally:
        device.close()
    fs = open_fs(path)
    assert names(fs) == [b"zero"]
    close_and_check(fs)


async def test_failed_checkpoint_and_commit_keep_their_records_queued(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=[{"op": "write", "effect": "eio", "count": 2}])   # two writes fail
    sb = fs.store.sb
    fs.ns.make(ROOT_INO, b"a", DIR_MODE, 0, 0)
    with pytest.raises(DeviceError):
        await fs.ns.checkpoint()
    st = fs.store.statistics()
    assert (st.records_pending, st.generation, st.checkpoints) == (1, 1, 0)
    fs.ns.make(ROOT_INO, b"b", DIR_MODE, 0, 0)
    with pytest.raises(DeviceError):
        await fs.ns.commit()
    st = fs.store.statistics()
    assert (st.records_pending, st.commits, st.journal_bytes) == (2, 0, 0)
    assert fs.device.injected()["eio"] == 2
    a, b = slot_headers(path, sb)
    assert a[0] == 1 and b is None                      # nothing reached the device
    # The device works again: the next commit writes both records, in order, none lost.
    await fs.ns.commit()
    st = fs.store.statistics()
    assert (st.records_pending, st.commits, st.journal_frames) == (0, 1, 1)
    fs.close()
    store, device = reopen_store(path)
    try:
        assert store.generation == 1
        assert [r.name for r in store.loaded.records] == [b"a", b"b"]
    finally:
        device.close()
    fs = open_fs(path)
    assert names(fs) == [b"a", b"b"]
    close_and_check(fs)


async def test_a_failed_checkpoint_on_a_read_only_device_changes_nothing(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, readonly=True)                  # every write fails
    fs.ns.make(ROOT_INO, b"a", DIR_MODE, 0, 0)
    with pytest.raises(DeviceError):
        await fs.ns.checkpoint()
    with pytest.raises(DeviceError):
        await fs.ns.commit()
    st = fs.store.statistics()
    assert (st.records_pending, st.generation, st.checkpoints, st.commits, st.journal_bytes) == (1, 1, 0, 0, 0)
    close_and_check(fs)                                # nothing reached the device
