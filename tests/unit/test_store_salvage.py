"""The loader refuses state that proves a newer generation existed; salvage mode loads what it can."""
import pytest
import trio

from kvfs import schema
from kvfs.server import fsck
from kvfs.device import Device
from kvfs.errors import FormatError
from kvfs.store import ExtentStore
from kvfs.store.loader import load as load_store
from kvfs.namespace import ROOT_INO

from .helpers import DIR_MODE, assert_fsck_clean, flip_byte, lookup_path, mkfs, open_fs

S = schema.SECTOR


def open_store(path, **kw):
    device = Device.open(str(path), readonly=True)
    try:
        return ExtentStore.open(device, **kw)
    finally:
        device.close()


async def three_generations(path, *, frame):
    """gen 2 in slot B, gen 3 in slot A (holding 'in-gen3'), optionally a gen-3 frame ('in-frame')."""
    fs = open_fs(path)
    await fs.ns.checkpoint()
    fs.ns.make(ROOT_INO, b"in-gen3", DIR_MODE, 0, 0)
    await fs.ns.checkpoint()
    if frame:
        fs.ns.make(ROOT_INO, b"in-frame", DIR_MODE, 0, 0)
        await fs.ns.commit()
    sb = fs.store.sb
    fs.close()
    return sb


def test_valid_header_over_a_bad_payload_of_a_newer_slot_is_refused(tmp_path):
    path = mkfs(tmp_path)
    sb = trio.run(lambda: three_generations(path, frame=False))
    flip_byte(path, sb.checkpoint_a_off + S + 2)
    with pytest.raises(FormatError, match="slot A holds generation 3, newer than generation 2"):
        open_store(path)
    store = open_store(path, salvage=True)
    assert store.generation == 2 and store.loaded.highest_generation == 3 and len(store.loaded.damage) == 1
    report = fsck.check(str(path), repair=True)
    assert any("between checkpoint generation 2 and generation 3" in line for line in report.lost)
    assert "wrote checkpoint generation 4" in report.repairs
    assert_fsck_clean(path)
    assert open_store(path).generation == 4


def test_newer_journal_frames_are_refused_even_when_the_newer_header_is_gone(tmp_path):
    path = mkfs(tmp_path)
    sb = trio.run(lambda: three_generations(path, frame=True))
    flip_byte(path, sb.checkpoint_a_off + 9)           # slot A has no valid header at all
    with pytest.raises(FormatError, match="journal holds frames of generation 3"):
        open_store(path)
    fsck.check(str(path), repair=True)
    assert_fsck_clean(path)
    fs = open_fs(path)
    assert lookup_path(fs.ns, "in-frame") is not None           # the gen-3 frame applied on gen 2
    assert lookup_path(fs.ns, "in-gen3") is None                # only in the lost checkpoint
    fs.close()


def test_damaged_older_slot_is_only_a_warning(tmp_path, caplog):
    path = mkfs(tmp_path)
    sb = trio.run(lambda: three_generations(path, frame=False))
    flip_byte(path, sb.checkpoint_b_off + S + 2)        # generation 2: older than the one in use
    device = Device.open(str(path), readonly=True)
    read, offsets = device.pread_sync, []
    device.pread_sync = lambda off, length: offsets.append(off) or read(off, length)
    store = ExtentStore.open(device)
    device.close()
    assert store.generation == 3 and store.loaded.damage == []
    # A mount reads the payload it uses (slot A), never the older one: 0.3 s
    # at a million files. fsck reads both, and warns.
    assert sb.checkpoint_a_off + S in offsets and sb.checkpoint_b_off + S not in offsets
    assert "older than the one in use" not in caplog.text
    report = fsck.check(str(path))
    assert report.clean
    assert any(n.startswith("warning: checkpoint slot B") for n in report.notes)


def test_the_check_before_the_fork_reads_one_payload_and_refuses_a_damaged_one(tmp_path):
    """mount.kvfs's parent verifies the newest checkpoint (so a damaged one is refused
    before the daemon writes anything) and reads no older payload it need not."""
    path = mkfs(tmp_path)
    sb = trio.run(lambda: three_generations(path, frame=False))
    device = Device.open(str(path), readonly=True)
    read, offsets = device.pread_sync, []
    device.pread_sync = lambda off, length: offsets.append(off) or read(off, length)
    try:
        loaded = load_store(device, decode_checkpoint=False)
        assert loaded.generation == 3 and loaded.state is None
        assert sb.checkpoint_a_off + S in offsets and sb.checkpoint_b_off + S not in offsets
        flip_byte(path, sb.checkpoint_a_off + S + 2)        # generation 3's payload: damaged
        with pytest.raises(FormatError, match="slot A holds generation 3, newer than generation 2"):
            load_store(device, decode_checkpoint=False)
    finally:
        device.close()
