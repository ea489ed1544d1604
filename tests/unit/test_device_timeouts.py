"""Every wait on the device has a bound (io_timeout, kvfs/device/calls.py), and the device's
errors are counted by kind.

A "stall" fault far longer than io_timeout stands for a hung NVMe path: the caller gets
EIO (DeviceTimeout) within the bound, while the abandoned call's thread waits out the
stall and then really makes its system call. These tests check that such a late call
harms nothing: a late read's buffer is never handed out again, a late data write never
lands on an extent given to another block, and a late journal write is never overtaken.
"""
import errno
import os

import pytest
import trio

from kvfs.device import testfaults as faults
from kvfs.device import Device
from kvfs.errors import DeviceFailed, DeviceTimeout, KvfsError
from kvfs.device.testfaults import FaultyDevice
from kvfs.namespace import ROOT_INO

from .helpers import (BS, DEV_SIZE, assert_fsck_clean, lookup_path, mkfs, open_fs, pattern, read_all, running,
                      write_file, write_plan)

S = 4096
OFF = DEV_SIZE - 64 * S          # raw device tests write only here, at the end of the data region
TIMEOUT = 0.5
STALL = 4.0

pytestmark = pytest.mark.expect_errors(r"kvfs\.device\.calls: .* did not return within 0\.5 s \(io_timeout\)")


@pytest.fixture
def store(tmp_path):
    path = mkfs(tmp_path)
    yield path
    assert_fsck_clean(path)


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    """The daemon's test hook: a plan file the test rewrites while the stack runs."""
    path = tmp_path / "plan.json"
    path.write_text("[]")
    monkeypatch.setenv(faults.ENV, f"@{path}")
    return path


async def set_plan(plan_file, plan):
    await trio.to_thread.run_sync(write_plan, plan_file, plan)


async def late_calls_finished(device, limit=STALL + 5):
    """Wait (bounded) until every abandoned device call has really finished."""
    done = trio.Event()
    device.after_abandoned(done.set)           # runs once the late writes are done
    with trio.fail_after(limit):
        await done.wait()
        while device.statistics().late_calls:  # late reads: nothing waits for them
            await trio.sleep(0.05)


def extents_of(fs, keys):
    return {fs.index.extent(k) for k in keys if k is not None}


def unowned_extents(fs):
    """Allocated data-region bytes that no block entry names: [(off, n)]."""
    sb = fs.store.sb
    taken = sorted([(off, n) for off, n in fs.store.free_extents()]
                   + [(e.off, -(-e.length // S) * S) for e in fs.index.entries.values()])
    out, pos = [], sb.data_off
    for off, n in taken:
        if off > pos:
            out.append((pos, off - pos))
        pos = max(pos, off + n)
    if pos < sb.data_off + sb.data_len:
        out.append((pos, sb.data_off + sb.data_len - pos))
    return out


# -- counters ----------------------------------------------------------------------------

@pytest.mark.parametrize("op, call, counter", [
    ("read", lambda d: d.pread_sync(OFF, S), "read_errors"),
    ("read", lambda d: d.read_blocks_sync(OFF, [S, S], [None, None]), "read_errors"),
    ("write", lambda d: d.pwrite_sync(OFF, b"x"), "write_errors"),
    ("sync", lambda d: d.sync_sync(), "sync_errors"),
    ("discard", lambda d: d.discard_sync(OFF, S), "discard_errors"),
])
def test_failed_calls_are_counted_by_kind(store, op, call, counter):
    dev = FaultyDevice(Device.open(str(store), lock=False), [{"op": op, "effect": "eio", "count": 2}])
    try:
        for _ in range(2):
            with pytest.raises(KvfsError):
                call(dev)
        call(dev)                                   # the count is spent: it works again
        st = dev.statistics()
        kinds = {k: getattr(st, k) for k in ("read_errors", "write_errors", "sync_errors", "discard_errors")}
        assert kinds == {k: 2 if k == counter else 0 for k in kinds}, kinds
        assert st.short_transfers == 0 and st.timeouts == 0
    finally:
        dev.close()


def test_short_transfers_are_counted_absorbed_or_not(store):
    dev = FaultyDevice(Device.open(str(store), lock=False), [{"op": "write", "effect": "short", "count": 1}])
    try:
        dev.pwrite_sync(OFF, pattern(1, 8 * S))       # one short call, absorbed by the loop
        assert dev.pread_sync(OFF, 8 * S) == pattern(1, 8 * S)
        st = dev.statistics()
        assert (st.short_transfers, st.write_errors) == (1, 0)
    finally:
        dev.close()
    dev = FaultyDevice(Device.open(str(store), lock=False), [{"op": "read", "effect": "short"}])
    try:
        with pytest.raises(KvfsError, match="short device read"):
            dev.pread_sync(OFF, 8 * S)                 # 8, 4, 2 sectors, then nothing: an error
        st = dev.statistics()
        assert st.short_transfers >= 3 and st.read_errors == 1
    finally:
        dev.close()


def test_io_timeout_must_exceed_io_retry(store):
    with pytest.raises(KvfsError, match="io_timeout") as info:
        Device.open(str(store), retry_window=5.0, timeout=5.0)
    assert info.value.errno == errno.EINVAL
    Device.open(str(store)).close()                   # the refused open released its lock


# -- the time bound on the raw device -------------------------------------------------------

async def test_a_stalled_call_is_eio_within_the_bound_and_finishes_later(store):
    dev = FaultyDevice(Device.open(str(store), lock=False, timeout=TIMEOUT),
                       [{"op": "write", "effect": "stall", "seconds": STALL}])
    try:
        with pytest.raises(DeviceTimeout, match=r"did not answer within 0\.5 s") as info:
            await dev.pwrite(OFF, pattern(2, S))
        assert info.value.errno == errno.EIO
        # Given up on, not finished: the caller has its EIO while the call still runs.
        st = dev.statistics()
        assert (st.timeouts, st.late_calls, st.writes) == (1, 1, 0)
        assert await dev.pread(OFF, S) == bytes(S)     # reads go on; the write has not landed
        await late_calls_finished(dev)
        assert await dev.pread(OFF, S) == pattern(2, S)   # then it did, when the stall ended
        assert dev.statistics().writes == 1
    finally:
        dev.close()


async def test_a_call_that_never_got_a_thread_times_out_and_never_runs(store):
    """With every worker thread held by an unanswered call, the next call waits for a
    thread within its own bound, and once given up it never touches the device."""
    dev = FaultyDevice(Device.open(str(store), lock=False, timeout=TIMEOUT, io_threads=1),
                       [{"op": "write", "range": [OFF, OFF + S], "effect": "stall", "seconds": 2.0}])
    try:
        with pytest.raises(DeviceTimeout):
            await dev.pwrite(OFF, pattern(3, S))        # holds the only thread for 2 s
        with pytest.raises(DeviceTimeout):
            await dev.pwrite(OFF + S, pattern(4, S))    # outside the stall, but no thread for it
        # It gave up within its own bound, while the first call still held the thread.
        st = dev.statistics()
        assert (st.timeouts, st.late_calls, st.writes) == (2, 1, 0)
        await late_calls_finished(dev)
        assert await dev.pread(OFF, 2 * S) == pattern(3, S) + bytes(S)   # the second never ran
        assert dev.statistics().timeouts == 2
    finally:
        dev.close()


async def test_closing_with_a_late_call_keeps_its_descriptor_away_from_other_files(store):
    dev = FaultyDevice(Device.open(str(store), lock=False, timeout=TIMEOUT),
                       [{"op": "write", "effect": "stall", "seconds": 1.5}])
    with pytest.raises(DeviceTimeout):
        await dev.pwrite(OFF, pattern(5, S))
    fd = dev.fd
    dev.close()                                     # the late write has not been made yet
    assert os.readlink(f"/proc/self/fd/{fd}") == os.devnull
    await trio.sleep(2.0)                            # it is made now, into /dev/null
    with open(store, "rb") as f:
        f.seek(OFF)
        assert f.read(S) == bytes(S)


# -- through the whole stack ---------------------------------------------------------------

def pooled_buffers(cache):
    return [*cache._clean_spare, *(buf for _, buf in cache._quarantine)]


async def test_a_read_past_io_timeout_is_eio_and_its_late_buffer_is_never_reused(store, plan_file):
    fs = open_fs(store, io_timeout=TIMEOUT)
    victim, other = pattern(10, 4 * BS), pattern(11, 4 * BS)
    async with running(fs):
        vino = await write_file(fs.ns, ROOT_INO, b"victim", victim)
        oino = await write_file(fs.ns, ROOT_INO, b"other", other)
        await fs.ns.flush_all()
        fs.cache.drop_clean()
        assert await read_all(fs.ns, oino) == other   # fills the clean cache ...
        fs.cache.drop_clean()                          # ... whose buffers now wait for reuse
        pool = pooled_buffers(fs.cache)
        assert pool
        vext = sorted(extents_of(fs, fs.ns.inode(vino).committed))
        await set_plan(plan_file, [{"op": "read", "range": [vext[0][0], vext[-1][0] + vext[-1][1]],
                                    "effect": "stall", "seconds": STALL}])
        with pytest.raises(DeviceTimeout) as info:
            await read_all(fs.ns, vino)
        assert info.value.errno == errno.EIO
        # The reader has its EIO while the stalled reads still run: it did not wait them out.
        st = fs.device.statistics()
        assert st.timeouts >= 1 and st.late_calls >= 1, st
        # Buffers taken from the pool and not back with a read that returned (a read that
        # began just before the window opened may have): the timed-out reads hold them.
        cached = [v.obj for v in fs.cache._clean.values()]
        handed_out = [b for b in pool if not any(b is p for p in pooled_buffers(fs.cache) + cached)]
        assert handed_out, "the timed-out reads took no buffer from the pool"
        assert await read_all(fs.ns, oino) == other   # the other file is served meanwhile
        assert fs.device.statistics().late_calls >= 1
        ran = []
        fs.device.after_abandoned(lambda: ran.append(True))
        assert ran, "frees waited for late reads, which write nothing"
        await late_calls_finished(fs.device)
        await set_plan(plan_file, [])
        assert fs.device.injected()["stall"] >= 1
        # The late reads filled their buffers after the reader had gone: none of them
        # may ever come back into a pool or the cache, and the victim reads right.
        assert await read_all(fs.ns, vino) == victim
        for _ in range(3):
            fs.cache.drop_clean()
            assert await read_all(fs.ns, oino) == other
            assert await read_all(fs.ns, vino) == victim
            held = pooled_buffers(fs.cache) + [v.obj for v in fs.cache._clean.values()]
            assert not any(b is h for b in handed_out for h in held), "a late read's buffer was reused"
        st = fs.stats()
        assert st["device_timeouts"] >= 1 and st["corrupt_reads"] == 0 and st["device_read_errors"] == 0
    fs.close()


@pytest.mark.expect_errors(r"kvfs\.blockcache\.writeback: flushing a block failed",
                           r"kvfs\.namespace\.durability: inode \d+: flush failed")
async def test_a_data_write_past_io_timeout_fails_the_flush_and_keeps_its_extent(store, plan_file):
    fs = open_fs(store, io_timeout=TIMEOUT)
    before, data, later = pattern(20, 2 * BS), pattern(21, BS), pattern(22, 3 * BS)
    sb = fs.store.sb
    async with running(fs):
        kept = await write_file(fs.ns, ROOT_INO, b"kept", before)
        await fs.ns.flush_all()
        assert unowned_extents(fs) == []
        # The next data write (only that one) stalls far longer than io_timeout.
        await set_plan(plan_file, [{"op": "write", "range": [sb.data_off, DEV_SIZE], "effect": "stall",
                                    "seconds": STALL, "count": 1}])
        with pytest.raises(KvfsError) as info:
            await write_file(fs.ns, ROOT_INO, b"lost", data)
        assert info.value.errno == errno.EIO
        # The writer has its EIO while the stalled write still runs: it did not wait it out.
        st = fs.device.statistics()
        assert (st.timeouts, st.late_calls) == (1, 1), st
        lost = lookup_path(fs.ns, "lost")
        # The abandoned write still owns its extent: allocated, named by no block.
        stalled = unowned_extents(fs)
        assert [n for _, n in stalled] == [BS], stalled
        # Meanwhile other files are written, and a checkpoint is taken.
        fresh = await write_file(fs.ns, ROOT_INO, b"later", later)
        assert not extents_of(fs, fs.ns.inode(fresh).committed) & set(stalled)
        await fs.ns.checkpoint()
        assert unowned_extents(fs) == stalled
        with pytest.raises(KvfsError) as info:          # the lost file says so, to readers and fsync
            await read_all(fs.ns, lost)
        assert info.value.errno == errno.EIO
        await late_calls_finished(fs.device)
        assert unowned_extents(fs) == []                 # given back once the late write finished
        fs.cache.drop_clean()
        assert await read_all(fs.ns, kept) == before
        assert await read_all(fs.ns, fresh) == later
        st = fs.stats()
        assert st["device_timeouts"] == 1 and st["device_write_errors"] == 0
        await set_plan(plan_file, [])
    fs.close()
    fs = open_fs(store)                                  # what was committed is intact
    async with running(fs, persist=False):
        assert await read_all(fs.ns, kept) == before
        assert await read_all(fs.ns, fresh) == later
    fs.close()


@pytest.mark.expect_errors(r"kvfs\.store: .*a journal or checkpoint write \(pwrite_sync\) did not complete",
                           r"kvfs\.device\.calls: ")
async def test_a_journal_write_past_io_timeout_stops_all_writes(store, plan_file):
    fs = open_fs(store, io_timeout=TIMEOUT)
    sb = fs.store.sb
    before = pattern(30, 2 * BS)
    async with running(fs, persist=False):
        kept = await write_file(fs.ns, ROOT_INO, b"kept", before)
        await set_plan(plan_file, [{"op": "write", "range": [sb.journal_off, sb.journal_off + sb.journal_len],
                                    "effect": "stall", "seconds": STALL}])
        with pytest.raises(KvfsError) as info:
            await write_file(fs.ns, ROOT_INO, b"pending", pattern(31, BS))
        assert info.value.errno == errno.EIO
        # The writer has its EIO while the stalled journal write still runs.
        st = fs.device.statistics()
        assert st.timeouts >= 1 and st.late_calls >= 1, st
        assert fs.store.fenced and "did not complete within 0.5 s" in fs.store.fenced
        # No later frame may be written over the one still pending: every write is refused.
        for attempt in (fs.ns.commit(), write_file(fs.ns, ROOT_INO, b"more", b"x"), fs.ns.checkpoint()):
            with pytest.raises(DeviceFailed) as info:
                await attempt
            assert info.value.errno == errno.EIO
        fs.cache.drop_clean()
        assert await read_all(fs.ns, kept) == before      # reads go on
        st = fs.stats()
        assert st["device_failed"] == 1 and st["mmp_fenced"] == 0 and st["device_timeouts"] == 1
        await late_calls_finished(fs.device)
        await set_plan(plan_file, [])
    fs.close()
    fs = open_fs(store)
    async with running(fs, persist=False):
        assert await read_all(fs.ns, kept) == before
        # The late frame did land, after the stall: its records name data synced before it.
        assert lookup_path(fs.ns, "pending") is not None
    fs.close()


def test_the_io_timeout_mount_option():
    from kvfs.cli.mount import parse_options

    assert parse_options("")[0].io_timeout == 60.0
    assert parse_options("io_retry=0,io_timeout=0.5")[0].io_timeout == 0.5
    assert parse_options("io_retry=100")[0].io_timeout == 200.0      # a long io_retry raises the default
    for text, message in [("io_timeout=5", "must be longer than 'io_retry' (10 s)"),
                          ("io_retry=3,io_timeout=3", "must be longer than 'io_retry' (3 s)"),
                          ("io_timeout=0", "must be from 0.1 to 3600 seconds"),
                          ("io_timeout=inf", "must be from 0.1 to 3600 seconds")]:
        with pytest.raises(KvfsError, match=r"io_timeout.*" + message.replace("(", r"\(").replace(")", r"\)")) \
                as info:
            parse_options(text)
        assert info.value.errno == errno.EINVAL
