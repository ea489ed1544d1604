"""Multi-mount protection in-process: the MMP record's codec, and the claim logic over a real store file.

A second "host" here is a second MmpGuard with another host id; the probe's
sleeps are handed a function that stands for the passing time (the other
owner heartbeats, or does not, while we watch), so the timing is exact and
nothing really waits.
"""
import logging
import os
import subprocess
import threading
import time

import pytest
import trio
import xxhash

from kvfs import schema
from kvfs.device import Device
from kvfs.device import testfaults as kvfs_faults
from kvfs.errors import Busy, Fenced, FormatError
from kvfs.store import BlockCheck, ExtentStore, MmpSettings, mmp
from kvfs.store.loader import read_superblock

from .helpers import World, mkfs, mmp_settings, on_disk, poke

SEED = 0x1234_5678_9ABC_DEF0


def record(**changes):
    fields = dict(state=schema.MMP_IN_USE, interval_ms=250, seq=41, claim_id=7, pid=1234,
                  mount_ns=1_700_000_000_000_000_000, heartbeat_ns=1_700_000_001_000_000_000,
                  host_id="3d1219c7c4c5404aaa1f6d2a48adfda4", hostname="gpu-node-07", program="mount.kvfs")
    return schema.MmpRecord(**{**fields, **changes})


# -- the codec -------------------------------------------------------------------------------

def test_record_round_trips_in_one_sector():
    rec = record()
    sector = rec.encode(SEED)
    assert len(sector) == schema.SECTOR and sector[:8] == b"KVFSMMPR"
    assert not any(sector[schema.MMP_RECORD_CHECKED.size:]), "padding must be zero"
    assert schema.MmpRecord.decode(sector, SEED) == rec
    assert schema.MmpRecord.decode(record(state=schema.MMP_CLEAN).encode(SEED), SEED).state == schema.MMP_CLEAN


def test_zero_sector_is_no_record_and_damage_is_a_format_error():
    assert schema.MmpRecord.decode(bytes(schema.SECTOR), SEED) is None       # fresh mkfs
    good = bytearray(record().encode(SEED))
    for off in (0, 9, 20, 60, 100, 160, 170):                               # magic, fields, text, checksum
        bad = bytearray(good)
        bad[off] ^= 0x01
        with pytest.raises(FormatError):
            schema.MmpRecord.decode(bytes(bad), SEED)
    with pytest.raises(FormatError, match="checksum"):
        schema.MmpRecord.decode(bytes(good), SEED + 1)          # left by an earlier filesystem
    with pytest.raises(FormatError, match="truncated"):
        schema.MmpRecord.decode(bytes(good[:100]), SEED)
    with pytest.raises(FormatError, match="bad magic"):
        schema.MmpRecord.decode(b"x" + bytes(good[1:]), SEED)


def test_invalid_state_or_interval_is_refused_both_ways():
    for bad in (record(state=3), record(interval_ms=0), record(interval_ms=schema.MMP_MAX_INTERVAL_MS + 1)):
        with pytest.raises(FormatError):
            bad.encode(SEED)
    # A record with a checksum that matches but a state no kvfs writes is still refused.
    body = bytearray(record().encode(SEED)[:schema.MMP_RECORD.size])
    body[8:12] = (9).to_bytes(4, "little")
    import xxhash
    sector = bytes(body) + xxhash.xxh64_intdigest(bytes(body), SEED).to_bytes(8, "little")
    with pytest.raises(FormatError, match="unknown state 9"):
        schema.MmpRecord.decode(sector.ljust(schema.SECTOR, b"\0"), SEED)


def test_long_text_is_cut_to_its_field():
    rec = record(hostname="h" * 100, host_id="i" * 40, program="p" * 20)
    back = schema.MmpRecord.decode(rec.encode(SEED), SEED)
    assert (back.hostname, back.host_id, back.program) == ("h" * 64, "i" * 32, "p" * 16)


# -- claiming --------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    path = mkfs(tmp_path)
    device = Device.open(str(path), lock=False)
    yield device, read_superblock(device)
    device.close()


def test_a_fresh_store_is_claimed_after_the_claim_wait_and_released_clean(store):
    device, sb = store
    world = World()
    guard = mmp.claim(device, sb, mmp_settings(world, "host-a"))
    assert sum(world.slept) == mmp.claim_wait(0.25)        # no watching: the sector was all zero
    mine = on_disk(device, sb)
    assert (mine.state, mine.host_id, mine.pid, mine.interval_ms) == (schema.MMP_IN_USE, "host-a", os.getpid(), 250)
    guard.heartbeat_sync()
    assert on_disk(device, sb).seq == mine.seq + 1
    guard.release_sync()
    released = on_disk(device, sb)
    assert released.state == schema.MMP_CLEAN and released.host_id == "host-a"
    world.slept.clear()
    mmp.claim(device, sb, mmp_settings(world, "host-b"))      # clean: claimed without watching
    assert sum(world.slept) == mmp.claim_wait(0.25)


def test_a_live_owner_is_refused_by_name(store):
    device, sb = store
    world = World()
    owner = mmp.claim(device, sb, mmp_settings(world, "host-a"))
    world.during_sleep = owner.heartbeat_sync              # host-a keeps heartbeating
    with pytest.raises(Busy) as refused:
        mmp.claim(device, sb, mmp_settings(world, "host-b"))
    text = str(refused.value)
    assert "host id host-a" in text and f"pid {os.getpid()}" in text and "--force" in text
    assert sum(world.slept) < mmp.grace_period(0.25) + mmp.claim_wait(0.25)   # refused at the first change
    assert on_disk(device, sb).host_id == "host-a"          # nothing written by the refused claim


def test_a_stopped_heartbeat_is_taken_over_after_the_grace_period(store, caplog):
    device, sb = store
    world = World()
    mmp.claim(device, sb, mmp_settings(world, "host-a", interval=0.5))   # and then host-a dies
    world.slept.clear()
    with caplog.at_level(logging.WARNING, "kvfs.store.mmp"):
        guard = mmp.claim(device, sb, mmp_settings(world, "host-b"))
    watched = sum(world.slept) - mmp.claim_wait(0.25)
    assert watched >= mmp.grace_period(0.5), "judged by the old owner's interval, not ours"
    assert sum(world.slept[-2:]) == mmp.claim_wait(0.25), "a dead owner need not see our claim"
    assert "host id host-a" in caplog.text
    assert "its heartbeat stopped" in caplog.text
    assert on_disk(device, sb).host_id == "host-b" and guard.record.host_id == "host-b"


def test_force_takes_over_without_watching_and_the_old_owner_notices(store, caplog):
    device, sb = store
    world = World()
    old = mmp.claim(device, sb, mmp_settings(world, "host-a", interval=1.0))
    world.slept.clear()
    with caplog.at_level(logging.WARNING, "kvfs.store.mmp"):
        mmp.claim(device, sb, mmp_settings(world, "host-b", force=True))
    assert sum(world.slept) == mmp.claim_wait(1.0), "force skips the watch, not the claim check"
    assert "force was given" in caplog.text
    with pytest.raises(Busy, match="another host took the store over.*host id host-b"):
        old.heartbeat_sync()
    assert on_disk(device, sb).host_id == "host-b"         # the old owner wrote nothing


def test_a_crash_on_this_host_is_taken_over_at_once(store):
    device, sb = store
    world = World()
    dead = subprocess.Popen(["true"])
    dead.wait()
    mmp.claim(device, sb, mmp_settings(world, "host-a"))
    poke_record(device, sb, on_disk(device, sb).replace(pid=dead.pid))
    world.slept.clear()
    verdict = mmp.probe(device, sb, mmp_settings(world, "host-a"))
    assert verdict.how == "crashed here" and world.slept == []
    zombie = subprocess.Popen(["true"])          # exited, not yet reaped: as dead as a reaped one
    try:
        deadline = time.monotonic() + 10
        while mmp._pid_running(zombie.pid):
            assert time.monotonic() < deadline, "a zombie counts as running"
            time.sleep(0.01)
    finally:
        zombie.wait()
    assert mmp._pid_running(os.getpid())
    # The same record seen from another host: its pid means nothing there, so it is watched.
    assert mmp.probe(device, sb, mmp_settings(world, "host-b")).how == "stale"
    assert sum(world.slept) >= mmp.grace_period(0.25)


def poke_record(device, sb, rec):
    device.pwrite_sync(sb.mmp_off, rec.encode(sb.hash_seed))


def test_a_simultaneous_claim_is_refused(store):
    device, sb = store
    world = World()
    rival = mmp_settings(World(), "host-a")
    world.during_sleep = lambda: poke_record(device, sb, mmp._new_record(rival))   # lands during our wait
    with pytest.raises(Busy, match="claimed the store at the same time.*host id host-a"):
        mmp.claim(device, sb, mmp_settings(world, "host-b"))


def test_an_owner_that_unmounts_while_we_watch_frees_the_store(store):
    device, sb = store
    world = World()
    owner = mmp.claim(device, sb, mmp_settings(world, "host-a"))
    world.during_sleep = owner.release_sync
    assert mmp.probe(device, sb, mmp_settings(world, "host-b")).how == "free"


def test_a_damaged_record_is_an_unknown_owner_watched_then_taken_over(store, caplog):
    device, sb = store
    world = World()
    device.pwrite_sync(sb.mmp_off, b"\x5a" * schema.SECTOR)
    with caplog.at_level(logging.WARNING, "kvfs.store.mmp"):
        mmp.claim(device, sb, mmp_settings(world, "host-b"))
    assert sum(world.slept) >= mmp.grace_period(mmp.DEFAULT_INTERVAL)
    assert "an unknown owner (MMP sector holds no MMP record (bad magic))" in caplog.text
    assert on_disk(device, sb).host_id == "host-b"


def test_a_probe_that_saw_the_record_go_stale_spares_the_claim_a_second_watch(store):
    device, sb = store
    world = World()
    mmp.claim(device, sb, mmp_settings(world, "host-a"))
    mine = mmp_settings(world, "host-b")
    assert mmp.probe(device, sb, mine).how == "stale"      # mount.kvfs, before it forks the daemon
    world.slept.clear()
    mmp.claim(device, sb, mine)                             # the daemon: the same bytes, no new watch
    assert sum(world.slept) == mmp.claim_wait(0.25)


# -- the store: claim on open, fence --------------------------------------------------------

@pytest.mark.expect_errors("stopped writing to the device")
async def test_a_fenced_store_refuses_every_write_but_still_reads(tmp_path, caplog):
    path = mkfs(tmp_path)
    device = Device.open(str(path))
    try:
        store = ExtentStore.open(device, mmp=MmpSettings(interval=0.05, host_id="host-a"))
        assert store.mmp_statistics()["mmp"] == "owner"
        store.finish_replay()
        off = store.allocate(schema.SECTOR)
        await store.write_extent(off, b"k" * schema.SECTOR)
        with caplog.at_level(logging.CRITICAL, "kvfs.store"):
            store.fence("a test says so")
            store.fence("twice")                            # logged once
        assert caplog.text.count("stopped writing to the device") == 1
        with pytest.raises(Fenced):
            store.append(schema.Remove(1, b"x", 0))
        for attempt in (store.commit(), store.write_extent(off, b"z" * schema.SECTOR),
                        store.checkpoint(schema.CheckpointState(next_ino=16, inodes=[], blocks=[], free=None,
                                                                provisional=[]))):
            with pytest.raises(Fenced):
                await attempt
        keyed = xxhash.xxh3_128(seed=store.hash_seed)
        keyed.update(store.key_secret)
        expected = keyed.copy()
        expected.update(b"k" * schema.SECTOR)
        check = BlockCheck(schema.SECTOR, expected.digest(), b"")
        assert bytes(await store.read_verified(off, check, None, keyed)) == b"k" * schema.SECTOR
        stats = store.mmp_statistics()
        assert stats["mmp_fenced"] == 1 and stats["mmp"].startswith("fenced: a test says so")
        before = mmp.read_record(device, store.sb)[0]
        await trio.sleep(0.2)                               # the background heartbeat stopped too
        store.release_mmp()                                 # fenced: the record is left alone
        assert mmp.read_record(device, store.sb)[0] == before
    finally:
        device.close()


def test_store_open_heartbeats_until_the_daemon_takes_over_and_releases_on_close(tmp_path):
    path = mkfs(tmp_path)
    device = Device.open(str(path))
    try:
        store = ExtentStore.open(device, mmp=MmpSettings(interval=0.05, host_id="host-a"))
        first = store.mmp.record.seq
        deadline = time.monotonic() + 60
        while store.mmp.record.seq == first:        # the claim's thread keeps heartbeating during load and replay
            assert time.monotonic() < deadline, "the claim's thread wrote no heartbeat"
            time.sleep(0.01)

        async def daemon():
            before = store.mmp.heartbeats
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.keep_heartbeat)
                with trio.fail_after(60):               # the daemon's task takes over and goes on
                    while store.mmp.heartbeats < before + 4:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        trio.run(daemon)
        assert not store.fenced
        store.release_mmp()
        assert mmp.read_record(device, store.sb)[1].state == schema.MMP_CLEAN
    finally:
        device.close()


@pytest.mark.expect_errors("another host took the store over")
async def test_a_heartbeat_that_finds_another_owner_fences_the_store(tmp_path):
    path = mkfs(tmp_path)
    device = Device.open(str(path))
    try:
        store = ExtentStore.open(device, mmp=MmpSettings(interval=0.05, host_id="host-a"))
        store.finish_replay()
        mmp.claim(device, store.sb, MmpSettings(interval=0.05, host_id="host-b", force=True))
        with trio.fail_after(60):
            await store.keep_heartbeat()                    # returns once fenced
        assert "another host took the store over" in store.fenced and "host-b" in store.fenced
        with pytest.raises(Fenced):
            await store.commit()
    finally:
        device.close()


def test_a_version_1_store_opens_without_mmp_and_says_so(tmp_path, caplog):
    path = mkfs(tmp_path)
    device = Device.open(str(path))
    try:
        sb = read_superblock(device)
        sb.version, sb.mmp_off, sb.key_secret = 1, 0, b""
        v1 = sb.encode()
        poke(path, 0, v1 + v1)
        with caplog.at_level(logging.WARNING, "kvfs.store"):
            store = ExtentStore.open(device, mmp=MmpSettings(interval=0.05))
        assert "multi-mount protection needs a format version 2 store" in caplog.text
        assert store.mmp is None and store.mmp_statistics() == {"mmp": "off (format version 1 store)",
                                                                "mmp_fenced": 0}
    finally:
        device.close()


@pytest.mark.expect_errors("heartbeat has not been written for")
async def test_an_overdue_heartbeat_fences_the_store_while_it_is_still_stuck(tmp_path):
    path = mkfs(tmp_path)
    device = Device.open(str(path))
    try:
        store = ExtentStore.open(device, mmp=MmpSettings(interval=0.05, host_id="host-a"))
        store.finish_replay()
        # The MMP sector's writes hang until the test lets them go: the fence must come
        # from the watchdog while the heartbeat is still stuck in the device.
        mmp_sector = range(8192, 12288)
        held, let_go = [], threading.Event()
        pwrite = device._sys_pwrite

        def stuck_mmp_write(view, off):
            if off in mmp_sector:
                held.append(off)
                let_go.wait(60)
            return pwrite(view, off)
        device._sys_pwrite = stuck_mmp_write
        seen = {}

        async def watch():
            while not store.fenced:
                await trio.sleep(0.01)
            seen.update(held=len(held), let_go=let_go.is_set())
            let_go.set()
        try:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    await store.keep_heartbeat()            # returns once the stuck write is over
        finally:
            let_go.set()
        assert "heartbeat has not been written for" in store.fenced
        assert f"(more than {mmp.overdue_limit(0.05):g} s)" in store.fenced
        # Fenced by the watchdog while a heartbeat write was held in the device (it is let go
        # only once the fence is seen), not by that write failing or coming back late.
        assert seen["held"] >= 1 and seen["let_go"] is False, seen
    finally:
        device.close()


def test_a_write_retrying_through_a_path_loss_stops_once_fenced(tmp_path):
    path = mkfs(tmp_path)
    device = Device.open(str(path), retry_window=30.0)
    try:
        kvfs_faults.FaultyDevice(device, [{"op": "write", "effect": "eio"}])
        failure = {}

        def write():
            try:
                device.pwrite_sync(1 << 20, b"x" * schema.SECTOR)
            except Exception as exc:  # noqa: BLE001 - looked at below
                failure["exc"] = exc
        worker = threading.Thread(target=write)
        worker.start()
        time.sleep(0.3)
        assert worker.is_alive(), "the write should be retrying"
        device.fence("taken over")
        worker.join(5)
        assert not worker.is_alive() and isinstance(failure.get("exc"), Fenced)
    finally:
        device.close()
