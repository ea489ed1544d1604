"""The on-disk format: struct layouts, superblock encode/decode and its errors."""
import os
import struct

import pytest
import xxhash

from kvfs import format as fmt
from kvfs import fsck
from kvfs.cli.mkfs import make_filesystem
from kvfs.device import Device
from kvfs.errors import FormatError, KvfsError
from kvfs.extents import ExtentStore, read_superblock

from .helpers import BS, DEV_SIZE, assert_fsck_clean, flip_byte, mkfs, peek, poke


def test_struct_sizes():
    assert fmt.SUPERBLOCK.size == 120
    assert fmt.SUPERBLOCK_CHECKED.size == 128
    assert fmt.CHECKPOINT_HEADER.size == 40
    assert fmt.JOURNAL_FRAME.size == 48
    assert len(fmt.Superblock.FIELDS) == len(fmt.SUPERBLOCK.unpack(bytes(fmt.SUPERBLOCK.size)))
    assert fmt.SECTOR == 4096


def test_superblock_roundtrip_and_layout():
    sb = fmt.Superblock.create(DEV_SIZE, BS, now_ns=123)
    sector = sb.encode()
    assert len(sector) == fmt.SECTOR
    assert sector[:8] == fmt.MAGIC_SUPERBLOCK
    assert not any(sector[fmt.SUPERBLOCK_CHECKED.size:])          # rest of the sector is zero
    back = fmt.Superblock.decode(sector)
    for name in fmt.Superblock.FIELDS:
        assert getattr(back, name) == getattr(sb, name), name
    # Regions are in order, aligned, non-overlapping and inside the device.
    assert sb.checkpoint_a_off == 2 * fmt.SECTOR
    assert sb.checkpoint_b_off == sb.checkpoint_a_off + sb.checkpoint_len
    assert sb.journal_off == sb.checkpoint_b_off + sb.checkpoint_len
    assert sb.data_off >= sb.journal_off + sb.journal_len
    assert sb.data_off % (1 << 20) == 0
    assert sb.data_off + sb.data_len <= DEV_SIZE
    assert sb.checkpoint_len > 0 and sb.journal_len > 0 and sb.data_len > 0
    # Two filesystems get different identities and hash keys.
    other = fmt.Superblock.create(DEV_SIZE, BS)
    assert other.uuid != sb.uuid and other.hash_seed != sb.hash_seed


def test_superblock_create_rejects_bad_parameters():
    with pytest.raises(FormatError, match="power of two"):
        fmt.Superblock.create(DEV_SIZE, 3 * BS)
    with pytest.raises(FormatError, match="power of two"):
        fmt.Superblock.create(DEV_SIZE, fmt.MIN_BLOCK_SIZE // 2)
    with pytest.raises(FormatError, match="power of two"):
        fmt.Superblock.create(DEV_SIZE, fmt.MAX_BLOCK_SIZE * 2)
    with pytest.raises(FormatError, match="device too small"):
        fmt.Superblock.create(DEV_SIZE - fmt.SECTOR, BS)


def test_decode_errors():
    sb = fmt.Superblock.create(DEV_SIZE, BS)
    good = sb.encode()
    with pytest.raises(FormatError, match="truncated"):
        fmt.Superblock.decode(good[:100])
    with pytest.raises(FormatError, match="zero-filled"):
        fmt.Superblock.decode(bytes(fmt.SECTOR))
    with pytest.raises(FormatError, match="bad magic"):
        fmt.Superblock.decode(b"EXT4SUPR" + good[8:])
    # One flipped bit anywhere in the checked body is caught by the checksum.
    for pos in (8, 40, 100, 119, 120):
        bad = bytearray(good)
        bad[pos] ^= 0x01
        with pytest.raises(FormatError, match="checksum mismatch"):
            fmt.Superblock.decode(bytes(bad))
    # A correctly checksummed superblock of another version is refused by name.
    sb.version = fmt.FORMAT_VERSION + 1
    with pytest.raises(FormatError, match=f"unsupported kvfs format version {fmt.FORMAT_VERSION + 1}"):
        fmt.Superblock.decode(sb.encode())
    sb.version = fmt.FORMAT_VERSION
    # Checksummed but inconsistent layouts are refused.
    sb.data_len = DEV_SIZE
    with pytest.raises(FormatError, match="exceeds the device size"):
        fmt.Superblock.decode(sb.encode())
    sb = fmt.Superblock.create(DEV_SIZE, BS)
    sb.journal_off = sb.checkpoint_b_off          # journal overlaps slot B
    with pytest.raises(FormatError, match="inconsistent"):
        fmt.Superblock.decode(sb.encode())
    sb = fmt.Superblock.create(DEV_SIZE, BS)
    sb.block_size = BS + 1
    with pytest.raises(FormatError, match="block size is invalid"):
        fmt.Superblock.decode(sb.encode())
    assert FormatError("x").errno == 117           # EUCLEAN


def test_checkpoint_header_and_journal_frame_codecs():
    seed = 0x1234_5678_9ABC_DEF0
    payload = b"state" * 100
    sector = fmt.encode_checkpoint_header(7, payload, seed)
    assert len(sector) == fmt.SECTOR
    assert fmt.decode_checkpoint_header(sector, 1 << 20, seed) == \
        (7, len(payload), xxhash.xxh64_intdigest(payload, seed))
    assert fmt.decode_checkpoint_header(sector, fmt.SECTOR + len(payload) - 1, seed) is None  # overruns the slot
    assert fmt.decode_checkpoint_header(bytes(fmt.SECTOR), 1 << 20, seed) is None
    assert fmt.decode_checkpoint_header(sector, 1 << 20, seed + 1) is None     # another filesystem's
    bad = bytearray(sector)
    bad[9] ^= 1                                       # generation bit: header hash no longer matches
    assert fmt.decode_checkpoint_header(bytes(bad), 1 << 20, seed) is None

    frame = fmt.encode_journal_frame(3, 5, payload, seed)
    assert len(frame) % fmt.SECTOR == 0
    assert len(frame) == fmt.frame_size(len(payload))
    assert fmt.decode_journal_header(frame, seed) == (3, 5, len(payload), xxhash.xxh64_intdigest(payload, seed))
    assert frame[fmt.JOURNAL_FRAME.size:fmt.JOURNAL_FRAME.size + len(payload)] == payload
    assert fmt.decode_journal_header(frame[:47], seed) is None
    assert fmt.decode_journal_header(bytes(fmt.SECTOR), seed) is None
    assert fmt.decode_journal_header(frame, seed ^ 1) is None                 # left by an earlier mkfs
    bad = bytearray(frame)
    bad[20] ^= 1                                      # seq bit
    assert fmt.decode_journal_header(bytes(bad), seed) is None
    assert fmt.frame_size(0) == fmt.SECTOR
    assert fmt.frame_size(fmt.SECTOR - fmt.JOURNAL_FRAME.size + 1) == 2 * fmt.SECTOR


def test_mkfs_writes_both_superblocks_and_an_empty_checkpoint(tmp_path):
    path = mkfs(tmp_path)
    head = peek(path, 0, 2 * fmt.SECTOR)
    assert head[:fmt.SECTOR] == head[fmt.SECTOR:]
    sb = fmt.Superblock.decode(head[:fmt.SECTOR])
    assert sb.block_size == BS and sb.device_size == DEV_SIZE
    device = Device.open(str(path))
    try:
        store = ExtentStore.open(device)
        assert store.generation == 1
        assert store.checkpoint_state == {}
        assert store.replay_records == []
        assert store.allocator.free_bytes == sb.data_len      # everything is free
    finally:
        device.close()
    assert_fsck_clean(path)


def test_mkfs_refuses_to_overwrite_without_force(tmp_path):
    path = mkfs(tmp_path)
    with pytest.raises(KvfsError, match="already holds a kvfs filesystem"):
        make_filesystem(str(path), DEV_SIZE, BS)
    other = tmp_path / "ext4.img"
    with open(other, "wb") as f:
        f.truncate(DEV_SIZE)
    poke(other, 1080, b"\x53\xef")
    with pytest.raises(KvfsError, match="ext2/3/4"):
        make_filesystem(str(other), DEV_SIZE, BS)
    make_filesystem(str(path), DEV_SIZE, BS, force=True)
    assert_fsck_clean(path)


def _open_error(path):
    device = Device.open(str(path))
    try:
        with pytest.raises(FormatError) as info:
            ExtentStore.open(device)
    finally:
        device.close()
    return str(info.value)


def test_zero_filled_device(tmp_path):
    path = tmp_path / "zero.img"
    with open(path, "wb") as f:
        f.truncate(DEV_SIZE)
    assert "zero-filled" in _open_error(path)


def test_bad_magic_device(tmp_path):
    path = tmp_path / "junk.img"
    with open(path, "wb") as f:
        f.truncate(DEV_SIZE)
    poke(path, 0, b"not a kvfs device at all" * 10)
    msg = _open_error(path)
    assert "bad magic" in msg and "not a kvfs device" in msg


def test_corrupt_primary_superblock_names_the_intact_backup(tmp_path):
    path = mkfs(tmp_path)
    flip_byte(path, 50)                                # inside the checked body
    msg = _open_error(path)
    assert "checksum mismatch" in msg
    assert "backup superblock is intact" in msg and "fsck.kvfs --repair" in msg
    # Plain fsck refuses; repair restores the primary from the backup.
    with pytest.raises(FormatError, match="checksum mismatch"):
        fsck.check(str(path))
    report = fsck.check(str(path), repair=True)
    assert any("restored it from the backup" in r for r in report.repairs)
    head = peek(path, 0, 2 * fmt.SECTOR)
    assert head[:fmt.SECTOR] == head[fmt.SECTOR:]
    assert_fsck_clean(path)


def test_both_superblocks_corrupt_reports_the_primary_error_only(tmp_path):
    path = mkfs(tmp_path)
    flip_byte(path, 50)
    flip_byte(path, fmt.SECTOR + 50)
    msg = _open_error(path)
    assert "checksum mismatch" in msg and "backup" not in msg
    with pytest.raises(FormatError, match="checksum mismatch"):
        fsck.check(str(path), repair=True)              # nothing to restore from
    flip_byte(path, fmt.SECTOR + 50)                    # the backup comes back ...
    fsck.check(str(path), repair=True)                  # ... and repair restores the primary from it
    assert_fsck_clean(path)


def test_differing_backup_superblock_is_a_problem_and_repairable(tmp_path):
    path = mkfs(tmp_path)
    flip_byte(path, fmt.SECTOR + 50)                   # the backup only: mount still works
    device = Device.open(str(path))
    try:
        read_superblock(device)
    finally:
        device.close()
    report = fsck.check(str(path))
    assert any("backup superblock differs" in p for p in report.problems)
    fsck.check(str(path), repair=True)
    assert_fsck_clean(path)


def test_truncated_device(tmp_path):
    path = mkfs(tmp_path, size=DEV_SIZE * 2)
    os.truncate(path, DEV_SIZE + 8 * fmt.SECTOR)       # still big enough to be a kvfs
    msg = _open_error(path)
    assert "the device is truncated" in msg and str(DEV_SIZE * 2) in msg
    os.truncate(path, DEV_SIZE - fmt.SECTOR)           # below the minimum size
    assert "too small to hold kvfs" in _open_error(path)
    os.truncate(path, DEV_SIZE * 2)                    # growing it back restores the filesystem
    assert_fsck_clean(path)


def test_superblock_fields_are_little_endian_at_documented_offsets(tmp_path):
    path = mkfs(tmp_path)
    raw = peek(path, 0, fmt.SUPERBLOCK_CHECKED.size)
    sb = fmt.Superblock.decode(raw.ljust(fmt.SECTOR, b"\0"))
    assert struct.unpack_from("<I", raw, 8)[0] == fmt.FORMAT_VERSION
    assert struct.unpack_from("<I", raw, 12)[0] == fmt.SECTOR
    assert raw[16:32] == sb.uuid
    assert struct.unpack_from("<I", raw, 32)[0] == BS
    assert struct.unpack_from("<Q", raw, 48)[0] == DEV_SIZE
    assert struct.unpack_from("<Q", raw, 120)[0] == xxhash.xxh64_intdigest(raw[:120])
