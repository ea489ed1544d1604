"""kvfs.device.testfaults in-process: each injected effect, over the real Device on a real store file.

No FUSE here. The wrapper sits under Device's own code, so these tests also
show that Device's checks (short transfers, failed calls) and the block
index's checksum catch what they must. Every plan is seeded: the outcomes are
the same on every run.
"""
import errno
import threading

import pytest
import trio

import kvfs.device
from kvfs.device import testfaults as faults
from kvfs.server.daemon import Filesystem
from kvfs.device import Device
from kvfs.errors import CorruptBlock, DeviceError, KvfsError
from kvfs.device.testfaults import FaultyDevice, parse_plan
from kvfs.namespace import ROOT_INO

from .helpers import BS, DEV_SIZE, assert_fsck_clean, mkfs, open_fs, options, pattern, read_all, running, \
    write_file, write_plan

S = 4096
OFF = DEV_SIZE - 64 * S          # raw device tests write only here, at the end of the data region


class VirtualTime:
    """Stands in for the ``time`` module of the code under test (monkeypatched onto it):
    monotonic() reads a clock that only sleep() and the test move, and sleep() records
    how long it was asked to wait. So the tests check how long a fault made a call wait,
    not how long the call took on a shared, loaded machine."""

    def __init__(self):
        self.now = 1000.0
        self.slept = []
        self.during_sleep = None            # called inside each sleep, in the sleeping thread

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        if self.during_sleep is not None:
            self.during_sleep()
        self.now += seconds


@pytest.fixture
def store(tmp_path):
    path = mkfs(tmp_path)
    yield path
    assert_fsck_clean(path)


@pytest.fixture
def open_faulty(store):
    """Open the store's real Device and wrap it; each call is a fresh device."""
    opened = []

    def make(plan, **kw):
        dev = FaultyDevice(Device.open(str(store), lock=False), plan, **kw)
        opened.append(dev)
        return dev

    yield make
    for dev in opened:
        dev.close()


async def test_empty_plan_is_the_real_device(open_faulty, store):
    dev = open_faulty([])
    inner = dev.wrapped
    assert (dev.path, dev.size, dev.fd, dev.direct_io, dev.is_block, dev.limiter, dev.discard_supported) == \
           (inner.path, inner.size, inner.fd, inner.direct_io, inner.is_block, inner.limiter, True)
    data = pattern(1, 3 * S + 5)
    await dev.pwrite(OFF, data)
    await dev.sync()
    assert await dev.pread(OFF + 7, len(data) - 7) == data[7:]
    assert bytes(await dev.run(dev.read_block_sync, OFF, 2 * S)) == data[:2 * S]
    await dev.discard(OFF + 8 * S, S)
    st = dev.statistics()                          # the real device's counters
    assert (st.writes, st.syncs, st.reads) == (1, 1, 2)
    assert st.bytes_written == 4 * S
    assert dev.injected() == dict.fromkeys(faults.EFFECTS, 0)
    with open(store, "rb") as f:                   # and it really is on the store file
        f.seek(OFF)
        assert f.read(len(data)) == data


async def test_delay_slows_matching_calls_in_a_worker_thread(open_faulty, monkeypatch):
    clock = VirtualTime()
    monkeypatch.setattr(faults, "time", clock)
    dev = open_faulty([{"op": "write", "effect": "delay", "seconds": 0.3}])
    ticks, ticked = 0, threading.Event()

    async def ticker():
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1
            if ticks == 5:
                ticked.set()

    # The delay's sleep lasts until the trio loop has ticked five times: on the loop's
    # own thread it would wait in vain (and the ticks would stay at 0).
    clock.during_sleep = lambda: ticked.wait(30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await dev.pwrite(OFF, b"a" * S)
        nursery.cancel_scope.cancel()
    assert clock.slept == [pytest.approx(0.3)]     # the write waited for the delay
    assert ticks >= 5, "the delay blocked the trio loop"
    assert dev.pread_sync(OFF, 2) == b"aa"         # reads and syncs are not delayed
    dev.sync_sync()
    assert len(clock.slept) == 1
    assert dev.injected()["delay"] == 1


async def test_read_eio_in_range_is_the_device_error_and_counts(open_faulty):
    dev = open_faulty([{"op": "read", "range": [OFF, OFF + S], "effect": "eio", "count": 2}])
    dev.pwrite_sync(OFF, pattern(2, 2 * S))        # writes are not read rules
    for read in (lambda: dev.pread_sync(OFF + 10, 20), lambda: dev.read_block_sync(OFF, S)):
        with pytest.raises(DeviceError, match=f"device read at {OFF} failed") as info:
            read()
        assert info.value.errno == errno.EIO
    assert dev.pread_sync(OFF + S, S) == pattern(2, 2 * S)[S:]      # outside the range
    assert dev.pread_sync(OFF, S) == pattern(2, S)                  # count spent: served again
    assert dev.injected()["eio"] == 2
    assert dev.statistics().reads == 2             # failed calls are not counted as reads


@pytest.mark.parametrize("op, call, message", [
    ("write", lambda d: d.pwrite_sync(OFF, b"x"), "device write at"),
    ("sync", lambda d: d.sync_sync(), "device flush failed"),
    ("discard", lambda d: d.discard_sync(OFF, S), "discard at"),
])
def test_eio_on_write_sync_discard(open_faulty, op, call, message):
    dev = open_faulty([{"op": op, "effect": "eio"}])
    with pytest.raises(DeviceError, match=message) as info:
        call(dev)
    assert info.value.errno == errno.EIO
    assert dev.pread_sync(OFF, 1) is not None      # other operations are untouched
    assert dev.injected()["eio"] == 1


def test_probability_is_deterministic_for_a_seed(store):
    def outcomes(seed):
        dev = FaultyDevice(Device.open(str(store), lock=False),
                           {"seed": seed, "rules": [{"op": "read", "effect": "eio", "probability": 0.5}]})
        try:
            failed = []
            for _ in range(64):
                try:
                    dev.pread_sync(OFF, S)
                    failed.append(False)
                except DeviceError:
                    failed.append(True)
            assert dev.injected()["eio"] == sum(failed)
            return failed
        finally:
            dev.close()

    first = outcomes(7)
    assert outcomes(7) == first
    assert outcomes(8) != first
    assert 16 <= sum(first) <= 48


def test_short_read_once_is_retried_and_persistent_is_an_error(open_faulty):
    data = pattern(3, 16 * S)
    dev = open_faulty([{"op": "read", "effect": "short", "count": 1}])
    dev.pwrite_sync(OFF, data)
    assert dev.pread_sync(OFF, len(data)) == data  # Device's loop read the rest
    assert dev.injected()["short"] == 1

    dev = open_faulty([{"op": "read", "effect": "short"}])
    with pytest.raises(DeviceError, match="short device read") as info:
        dev.pread_sync(OFF, len(data))
    assert info.value.errno == errno.EIO
    with pytest.raises(DeviceError, match="short device read"):
        dev.read_block_sync(OFF, S)
    assert dev.injected()["short"] >= 5            # 16, 8, 4, 2 sectors, then nothing


def test_short_write_once_is_retried_and_persistent_is_an_error(open_faulty):
    data = pattern(4, 8 * S)
    dev = open_faulty([{"op": "write", "effect": "short", "count": 1}])
    dev.pwrite_sync(OFF, data)
    assert dev.pread_sync(OFF, len(data)) == data
    assert dev.injected()["short"] == 1

    dev = open_faulty([{"op": "write", "effect": "short"}])
    with pytest.raises(DeviceError, match="made no progress") as info:
        dev.pwrite_sync(OFF, pattern(5, 8 * S))
    assert info.value.errno == errno.EIO
    assert dev.statistics().writes == 0


def test_flip_changes_one_bit_inside_its_range(open_faulty):
    data = pattern(6, 4 * S)
    lo, hi = OFF + S + 100, OFF + S + 200
    dev = open_faulty([{"op": "read", "range": [lo, hi], "effect": "flip"}])
    dev.pwrite_sync(OFF, data)
    got = dev.pread_sync(OFF, len(data))           # the device cannot tell: no error
    diff = [(i, a ^ b) for i, (a, b) in enumerate(zip(got, data)) if a != b]
    assert len(diff) == 1 and bin(diff[0][1]).count("1") == 1, diff
    assert lo <= OFF + diff[0][0] < hi
    assert dev.pread_sync(OFF, S) == data[:S]      # a read missing the range is untouched
    assert dev.injected()["flip"] == 1


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
async def test_block_index_checksum_turns_a_flip_into_eio(store, tmp_path, monkeypatch):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text("[]")
    monkeypatch.setenv(faults.ENV, f"@{plan_file}")   # through the daemon's own hook
    fs = open_fs(store)
    assert isinstance(fs.device, FaultyDevice)
    data = pattern(7, 3 * BS + 11)
    async with running(fs):
        ino = await write_file(fs.ns, ROOT_INO, b"victim", data)
        await fs.ns.flush_all()
        fs.cache.drop_clean()
        flip = [{"op": "read", "range": [fs.store.sb.data_off, DEV_SIZE], "effect": "flip"}]
        await trio.to_thread.run_sync(write_plan, plan_file, flip)
        with pytest.raises(CorruptBlock) as info:
            await read_all(fs.ns, ino)
        assert info.value.errno == errno.EIO
        assert fs.index.statistics().corrupt_reads >= 1
        assert fs.device.injected()["flip"] >= 1
        await trio.to_thread.run_sync(write_plan, plan_file, [])
        assert await read_all(fs.ns, ino) == data   # nothing bad was kept
    fs.close()


def test_stall_window_holds_calls_until_it_ends(open_faulty, monkeypatch):
    clock = VirtualTime()
    monkeypatch.setattr(faults, "time", clock)
    t0 = clock.now
    dev = open_faulty([{"op": "read", "effect": "stall", "after": 0.5, "seconds": 1.0}])  # armed at t0
    dev.pwrite_sync(OFF, pattern(8, S))
    assert dev.pread_sync(OFF, S) == pattern(8, S)           # before the window: no wait
    assert clock.slept == []
    clock.now = t0 + 0.7
    assert dev.pread_sync(OFF, S) == pattern(8, S)           # in the window: waits, then completes
    assert clock.slept == [pytest.approx(0.8)]               # until the window's end ...
    assert clock.now == pytest.approx(t0 + 1.5)
    dev.pread_sync(OFF, S)                                   # ... and after it: no wait
    assert len(clock.slept) == 1
    assert dev.injected()["stall"] == 1


def test_a_plan_file_is_reloaded_and_rearmed(store, tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text("[]")
    dev = faults.from_environment(Device.open(str(store)), {faults.ENV: f"@{plan_file}"})
    try:
        dev.pread_sync(OFF, S)
        rule = [{"op": "read", "effect": "eio", "count": 1}]
        for _ in range(2):                          # each reload starts its counts afresh
            write_plan(plan_file, rule)
            with pytest.raises(DeviceError):
                dev.pread_sync(OFF, S)
            dev.pread_sync(OFF, S)
        assert dev.injected()["eio"] == 2
        write_plan(plan_file, {"seed": 1, "rules": [{"effect": "eio", "op": "sync"}]})
        dev.pread_sync(OFF, S)
        with pytest.raises(DeviceError, match="flush"):
            dev.sync_sync()
    finally:
        dev.close()


def test_from_environment_without_a_plan_is_the_device_itself(store):
    dev = Device.open(str(store))
    try:
        assert faults.from_environment(dev, {}) is dev
        assert faults.from_environment(dev, {faults.ENV: ""}) is dev
        wrapped = faults.from_environment(dev, {faults.ENV: '[{"effect": "eio", "op": "write"}]'})
        assert isinstance(wrapped, FaultyDevice) and wrapped.wrapped is dev
    finally:
        dev.close()


def test_a_bad_plan_in_the_environment_fails_the_open_and_releases_the_device(store, monkeypatch):
    monkeypatch.setenv(faults.ENV, '[{"effect": "explode"}]')
    with pytest.raises(KvfsError, match="bad fault plan") as info:
        Filesystem.open(str(store), options())
    assert info.value.errno == errno.EINVAL
    Device.open(str(store)).close()                # its lock went with the failed open


def test_plans_parse(tmp_path):
    plan = parse_plan('{"seed": 3, "rules": [{"op": "read", "range": [0, 4096], "effect": "eio", '
                      '"probability": 0.25, "count": 2}, {"effect": "stall", "seconds": 2}]}')
    assert plan.seed == 3 and len(plan.rules) == 2
    assert plan.rules[0].range == (0, 4096) and plan.rules[0].count == 2
    assert plan.rules[1].op == "any" and plan.rules[1].seconds == 2.0
    assert parse_plan([]).rules == () and parse_plan([]).seed == 0


@pytest.mark.parametrize("plan", [
    "not json", '{"rules": 3}', "[3]", [{"effect": "explode"}], [{"effect": "eio", "opp": "read"}],
    [{"effect": "eio", "op": "trim"}], [{"effect": "flip", "op": "write"}], [{"effect": "short", "op": "sync"}],
    [{"effect": "delay"}], [{"effect": "stall", "seconds": 0}], [{"effect": "eio", "range": [10, 5]}],
    [{"effect": "eio", "range": [1]}], [{"effect": "eio", "probability": 2}], [{"effect": "eio", "count": 0}],
    [{"effect": "delay", "seconds": 1, "after": -1}], {"seed": "x", "rules": []}, {"rule": []},
])
def test_bad_plans_are_refused(plan):
    with pytest.raises(KvfsError, match="bad fault plan") as info:
        parse_plan(plan)
    assert info.value.errno == errno.EINVAL


@pytest.mark.parametrize("transfer", ["read", "run_read", "write"])
def test_one_sector_short_moves_nothing_and_is_retried_within_the_window(store, transfer, monkeypatch):
    """A short transfer of a one-sector block moves zero bytes. With a retry window
    (io_retry) Device retries it like a lost path's error, and the transfer
    completes; without one it is an error at once; one that keeps failing is an
    error once the window is over, never a hang."""
    op = "write" if transfer == "write" else "read"
    data = pattern(9, 17)                      # a 17-byte block: one sector on the device

    def attempt(dev):
        if transfer == "write":
            dev.pwrite_sync(OFF, data)
            return dev.wrapped.pread_sync(OFF, len(data))
        dev.wrapped.pwrite_sync(OFF, data)
        if transfer == "run_read":
            return bytes(dev.read_blocks_sync(OFF, [len(data)], [None])[0])
        return bytes(dev.read_block_sync(OFF, len(data)))

    def faulty(plan, window):
        return FaultyDevice(Device.open(str(store), lock=False, retry_window=window), plan)

    dev = faulty([{"op": op, "effect": "short", "count": 2}], 5.0)
    try:
        assert attempt(dev) == data
        assert dev.injected()["short"] == 2
        assert dev.statistics().retries == 2
    finally:
        dev.close()

    # (A run read that comes back short reads its blocks again one by one: two shorts.)
    dev = faulty([{"op": op, "effect": "short", "count": 2 if transfer == "run_read" else 1}], 0.0)
    try:
        with pytest.raises(DeviceError, match="short device read|made no progress") as info:
            attempt(dev)
        assert info.value.errno == errno.EIO
        assert dev.statistics().retries == 0
    finally:
        dev.close()

    # The device's retry loop on a virtual clock: its pauses add up to the window, then it gives up.
    clock = VirtualTime()
    monkeypatch.setattr(kvfs.device, "time", clock)
    dev = faulty([{"op": op, "effect": "short"}], 0.3)
    try:
        with pytest.raises(DeviceError, match="short device read|made no progress"):
            attempt(dev)
        # Retried until the window was over, never longer (a run read: its own loop, then
        # the block's again one by one), each retry after a pause.
        loops = 2 if transfer == "run_read" else 1
        assert sum(clock.slept) == pytest.approx(loops * 0.3)
        assert dev.statistics().retries == len(clock.slept) >= 2 * loops
    finally:
        dev.close()
