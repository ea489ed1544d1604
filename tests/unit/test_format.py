"""The on-disk format (kvfs.schema.layout): struct layouts, superblock encode/decode and its errors."""
import os
import struct

import pytest
import xxhash

from kvfs import schema
from kvfs.server import fsck
from kvfs.device import Device
from kvfs.errors import FormatError, KvfsError
from kvfs.store import ExtentStore, read_superblock
from kvfs.store.loader import FIRST_INO
from kvfs.store.mkfs import make_filesystem

from .helpers import BS, DEV_SIZE, assert_fsck_clean, flip_byte, mkfs, peek, poke


def test_struct_sizes():
    assert schema.SUPERBLOCK.size == 160
    assert schema.SUPERBLOCK_CHECKED.size == 168
    assert schema.SUPERBLOCK_V1.size == 120 and schema.SUPERBLOCK_V1_CHECKED.size == 128
    assert schema.CHECKPOINT_HEADER.size == 40
    assert schema.JOURNAL_FRAME.size == 48
    assert len(schema.Superblock.FIELDS) == len(schema.SUPERBLOCK.unpack(bytes(schema.SUPERBLOCK.size)))
    assert schema.SECTOR == 4096


def test_superblock_roundtrip_and_layout():
    sb = schema.Superblock.create(DEV_SIZE, BS, now_ns=123)
    sector = sb.encode()
    assert len(sector) == schema.SECTOR
    assert sector[:8] == schema.MAGIC_SUPERBLOCK
    assert not any(sector[schema.SUPERBLOCK_CHECKED.size:])          # rest of the sector is zero
    back = schema.Superblock.decode(sector)
    for name in schema.Superblock.FIELDS:
        assert getattr(back, name) == getattr(sb, name), name
    # Regions are in order, aligned, non-overlapping and inside the device.
    assert sb.mmp_off == 2 * schema.SECTOR
    assert sb.checkpoint_a_off == 3 * schema.SECTOR
    assert sb.checkpoint_b_off == sb.checkpoint_a_off + sb.checkpoint_len
    assert sb.journal_off == sb.checkpoint_b_off + sb.checkpoint_len
    assert sb.data_off >= sb.journal_off + sb.journal_len
    assert sb.data_off % (1 << 20) == 0
    assert sb.data_off + sb.data_len <= DEV_SIZE
    assert sb.checkpoint_len > 0 and sb.journal_len > 0 and sb.data_len > 0
    # Two filesystems get different identities and hash keys.
    other = schema.Superblock.create(DEV_SIZE, BS)
    assert other.uuid != sb.uuid and other.hash_seed != sb.hash_seed
    assert len(sb.key_secret) == schema.KEY_SECRET_LEN >= 16 and other.key_secret != sb.key_secret


def test_superblock_create_rejects_bad_parameters():
    with pytest.raises(FormatError, match="power of two"):
        schema.Superblock.create(DEV_SIZE, 3 * BS)
    with pytest.raises(FormatError, match="power of two"):
        schema.Superblock.create(DEV_SIZE, schema.MIN_BLOCK_SIZE // 2)
    with pytest.raises(FormatError, match="power of two"):
        schema.Superblock.create(DEV_SIZE, schema.MAX_BLOCK_SIZE * 2)
    with pytest.raises(FormatError, match="device too small"):
        schema.Superblock.create(DEV_SIZE - schema.SECTOR, BS)


def test_decode_errors():
    sb = schema.Superblock.create(DEV_SIZE, BS)
    good = sb.encode()
    with pytest.raises(FormatError, match="truncated"):
        schema.Superblock.decode(good[:100])
    with pytest.raises(FormatError, match="zero-filled"):
        schema.Superblock.decode(bytes(schema.SECTOR))
    with pytest.raises(FormatError, match="bad magic"):
        schema.Superblock.decode(b"EXT4SUPR" + good[8:])
    # One flipped bit anywhere in the checked body is caught by the checksum.
    for pos in (8, 40, 100, 119, 120, 128, 159, 160):
        bad = bytearray(good)
        bad[pos] ^= 0x01
        with pytest.raises(FormatError, match="checksum mismatch"):
            schema.Superblock.decode(bytes(bad))
    # A correctly checksummed superblock of another version is refused by name.
    sb.version = schema.FORMAT_VERSION + 1
    with pytest.raises(FormatError, match=f"unsupported kvfs format version {schema.FORMAT_VERSION + 1}"):
        schema.Superblock.decode(sb.encode())
    sb.version = schema.FORMAT_VERSION
    # Checksummed but inconsistent layouts are refused.
    sb.data_len = DEV_SIZE
    with pytest.raises(FormatError, match="exceeds the device size"):
        schema.Superblock.decode(sb.encode())
    sb = schema.Superblock.create(DEV_SIZE, BS)
    sb.journal_off = sb.checkpoint_b_off          # journal overlaps slot B
    with pytest.raises(FormatError, match="inconsistent"):
        schema.Superblock.decode(sb.encode())
    sb = schema.Superblock.create(DEV_SIZE, BS)
    sb.block_size = BS + 1
    with pytest.raises(FormatError, match="block size is invalid"):
        schema.Superblock.decode(sb.encode())
    assert FormatError("x").errno == 117           # EUCLEAN


def test_checkpoint_header_and_journal_frame_codecs():
    seed = 0x1234_5678_9ABC_DEF0
    payload = b"state" * 100
    sector = schema.encode_checkpoint_header(7, payload, seed)
    assert len(sector) == schema.SECTOR
    assert schema.decode_checkpoint_header(sector, 1 << 20, seed) == \
        (7, len(payload), xxhash.xxh64_intdigest(payload, seed))
    assert schema.decode_checkpoint_header(sector, schema.SECTOR + len(payload) - 1, seed) is None  # overruns the slot
    assert schema.decode_checkpoint_header(bytes(schema.SECTOR), 1 << 20, seed) is None
    assert schema.decode_checkpoint_header(sector, 1 << 20, seed + 1) is None     # another filesystem's
    bad = bytearray(sector)
    bad[9] ^= 1                                       # generation bit: header hash no longer matches
    assert schema.decode_checkpoint_header(bytes(bad), 1 << 20, seed) is None

    frame = schema.encode_journal_frame(3, 5, payload, seed)
    assert len(frame) % schema.SECTOR == 0
    assert len(frame) == schema.frame_size(len(payload))
    assert schema.decode_journal_header(frame, seed) == (3, 5, len(payload), xxhash.xxh64_intdigest(payload, seed))
    assert frame[schema.JOURNAL_FRAME.size:schema.JOURNAL_FRAME.size + len(payload)] == payload
    assert schema.decode_journal_header(frame[:47], seed) is None
    assert schema.decode_journal_header(bytes(schema.SECTOR), seed) is None
    assert schema.decode_journal_header(frame, seed ^ 1) is None                 # left by an earlier mkfs
    bad = bytearray(frame)
    bad[20] ^= 1                                      # seq bit
    assert schema.decode_journal_header(bytes(bad), seed) is None
    assert schema.frame_size(0) == schema.SECTOR
    assert schema.frame_size(schema.SECTOR - schema.JOURNAL_FRAME.size + 1) == 2 * schema.SECTOR


def test_mkfs_writes_both_superblocks_and_an_empty_checkpoint(tmp_path):
    path = mkfs(tmp_path)
    head = peek(path, 0, 2 * schema.SECTOR)
    assert head[:schema.SECTOR] == head[schema.SECTOR:]
    sb = schema.Superblock.decode(head[:schema.SECTOR])
    assert sb.block_size == BS and sb.device_size == DEV_SIZE
    device = Device.open(str(path))
    try:
        store = ExtentStore.open(device)
        assert store.generation == 1
        # mkfs writes an empty map: every field takes its default, "free" is absent.
        state = store.loaded.state
        assert state == schema.CheckpointState(next_ino=FIRST_INO, inodes=[], blocks=[], free=None,
                                               provisional=[])
        assert store.loaded.records == []
        assert store.free_extents() == [(sb.data_off, sb.data_len)]      # everything is free
        assert store.statistics().free_bytes == sb.data_len
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
    head = peek(path, 0, 2 * schema.SECTOR)
    assert head[:schema.SECTOR] == head[schema.SECTOR:]
    assert_fsck_clean(path)


def test_both_superblocks_corrupt_reports_the_primary_error_only(tmp_path):
    path = mkfs(tmp_path)
    flip_byte(path, 50)
    flip_byte(path, schema.SECTOR + 50)
    msg = _open_error(path)
    assert "checksum mismatch" in msg and "backup" not in msg
    with pytest.raises(FormatError, match="checksum mismatch"):
        fsck.check(str(path), repair=True)              # nothing to restore from
    flip_byte(path, schema.SECTOR + 50)                    # the backup comes back ...
    fsck.check(str(path), repair=True)                  # ... and repair restores the primary from it
    assert_fsck_clean(path)


def test_differing_backup_superblock_is_a_problem_and_repairable(tmp_path):
    path = mkfs(tmp_path)
    flip_byte(path, schema.SECTOR + 50)                   # the backup only: mount still works
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
    os.truncate(path, DEV_SIZE + 8 * schema.SECTOR)       # still big enough to be a kvfs
    msg = _open_error(path)
    assert "the device is truncated" in msg and str(DEV_SIZE * 2) in msg
    os.truncate(path, DEV_SIZE - schema.SECTOR)           # below the minimum size
    assert "too small to hold kvfs" in _open_error(path)
    os.truncate(path, DEV_SIZE * 2)                    # growing it back restores the filesystem
    assert_fsck_clean(path)


def test_superblock_fields_are_little_endian_at_documented_offsets(tmp_path):
    path = mkfs(tmp_path)
    raw = peek(path, 0, schema.SUPERBLOCK_CHECKED.size)
    sb = schema.Superblock.decode(raw.ljust(schema.SECTOR, b"\0"))
    assert struct.unpack_from("<I", raw, 8)[0] == schema.FORMAT_VERSION
    assert struct.unpack_from("<I", raw, 12)[0] == schema.SECTOR
    assert raw[16:32] == sb.uuid
    assert struct.unpack_from("<I", raw, 32)[0] == BS
    assert struct.unpack_from("<Q", raw, 48)[0] == DEV_SIZE
    assert struct.unpack_from("<Q", raw, 120)[0] == sb.mmp_off == 8192
    assert raw[128:160] == sb.key_secret
    assert struct.unpack_from("<Q", raw, 160)[0] == xxhash.xxh64_intdigest(raw[:160])


def test_version_1_superblock_still_decodes():
    """A version 1 sector (120-byte struct, checksum at 120) decodes: no MMP sector, no secret."""
    sb = schema.Superblock.create(DEV_SIZE, BS)
    v1 = {name: getattr(sb, name) for name in schema.Superblock.FIELDS_V1}
    v1.update(version=1, checkpoint_a_off=2 * schema.SECTOR)
    body = schema.SUPERBLOCK_V1.pack(*(v1[name] for name in schema.Superblock.FIELDS_V1))
    sector = (body + struct.pack("<Q", xxhash.xxh64_intdigest(body))).ljust(schema.SECTOR, b"\0")
    back = schema.Superblock.decode(sector)
    assert back.version == 1 and back.mmp_off == 0 and not back.has_mmp and back.key_secret == b""
    assert back.encode() == sector                       # and re-encodes as version 1, byte for byte
