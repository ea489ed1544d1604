"""The device layout: superblock, checkpoint header, journal frame header and MMP record.

Device layout (all offsets in bytes, every region 4 KiB aligned)::

    0        primary superblock           (one 4 KiB sector, SUPERBLOCK below)
    4096     backup superblock            (identical copy, written by mkfs)
    8192     multi-mount protection       (one sector, MMP_RECORD; format version 2 on)
    12288    checkpoint slot A            (CHECKPOINT_HEADER + msgpack state;
                                           at 8192 in format version 1)
    ...      checkpoint slot B            (same size as A)
    ...      journal                      (a sequence of frames, JOURNAL_FRAME + msgpack)
    data_off data region                  (block extents, 4 KiB allocation units)

Integers are little-endian. Every header carries an xxh64 of its own bytes and
of its payload; readers check magic, version, bounds and both hashes before
trusting a byte.

Crash invariants (see docs/format.md for the argument):

* A checkpoint slot is only written while the other slot holds the newest valid
  checkpoint, so one valid checkpoint always exists. The payload is written and
  made durable before the header, so a valid header over a bad payload is
  damage, never a torn write: with a generation above the slot in use it proves
  that committed changes would be lost, and mount refuses.
* Journal frames carry the generation of the checkpoint they follow and a
  sequence number starting at 0. Replay stops at the first frame that is torn,
  has the wrong generation or breaks the sequence: that is the uncommitted tail.
  Not a tail, and refused by mount: a frame of a generation above the loaded
  checkpoint's, or a bad frame followed by a valid one with the next sequence
  number (frames are written one at a time, so only the last can be torn).
* A journal frame is written only after the data of every block it references
  is durable (the journal writer issues fdatasync before and after the frame).
* The MMP sector is the only sector written by more than one host. It holds no
  filesystem state: a crashed owner leaves its record IN_USE with a sequence
  that no longer advances, which a later mount takes over after the grace
  period (kvfs/store/mmp.py); a torn MMP write is a damaged record, treated
  as an unknown owner whose heartbeat has stopped.
"""
import os
import struct
import uuid as uuidlib

import xxhash

from ..base.aligned import SECTOR, align_down, align_up
from ..errors import FormatError

MAGIC_SUPERBLOCK = b"KVFSSUPR"
MAGIC_CHECKPOINT = b"KVFSCKPT"
MAGIC_JOURNAL = b"KVFSJRNL"
MAGIC_MMP = b"KVFSMMPR"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)      # version 1: no MMP sector, no key secret (see SUPERBLOCK_V1)
KEY_SECRET_LEN = 32             # 256 bits; content keys mix it in (blockindex.py)

DEFAULT_BLOCK_SIZE = 1 << 20   # = one FUSE request; 32 blocks per Llama-3-8B chunk
MIN_BLOCK_SIZE = 64 << 10
MAX_BLOCK_SIZE = 16 << 20
MIN_DEVICE_SIZE = 64 << 20

SUPERBLOCK_V1 = struct.Struct(
    "<"
    "8s"   # magic             MAGIC_SUPERBLOCK
    "I"    # version           FORMAT_VERSION
    "I"    # sector            SECTOR; allocation unit and metadata alignment
    "16s"  # uuid              random per filesystem
    "I"    # block_size        file contents are cut into blocks of this size
    "I"    # reserved0         zero
    "Q"    # hash_seed         random per filesystem: seeds every metadata hash and content key
    "Q"    # device_size       bytes the filesystem was made for; the device must be at least this
    "Q"    # checkpoint_a_off  offset of checkpoint slot A
    "Q"    # checkpoint_b_off  offset of checkpoint slot B
    "Q"    # checkpoint_len    size of each checkpoint slot
    "Q"    # journal_off       offset of the journal region
    "Q"    # journal_len       size of the journal region
    "Q"    # data_off          first byte of the data region
    "Q"    # data_len          size of the data region
    "Q"    # created_ns        mkfs time, ns since the epoch
)
assert SUPERBLOCK_V1.size == 120, SUPERBLOCK_V1.size

# Version 2 appends two fields to version 1's; everything before them is unchanged.
SUPERBLOCK = struct.Struct(
    SUPERBLOCK_V1.format +
    "Q"    # mmp_off           offset of the multi-mount protection sector (MMP_RECORD)
    "32s"  # key_secret        random per filesystem, secret: prefixed to every content key's input
)
assert SUPERBLOCK.size == 160, SUPERBLOCK.size
SUPERBLOCK_CHECKED = struct.Struct("<" + SUPERBLOCK.format[1:] + "Q")  # + xxh64 of the above
assert SUPERBLOCK_CHECKED.size == 168
SUPERBLOCK_V1_CHECKED = struct.Struct("<" + SUPERBLOCK_V1.format[1:] + "Q")
assert SUPERBLOCK_V1_CHECKED.size == 128

CHECKPOINT_HEADER = struct.Struct(
    "<"
    "8s"   # magic             MAGIC_CHECKPOINT
    "Q"    # generation        increases by one per checkpoint; the newest valid slot wins
    "Q"    # payload_len       bytes of msgpack state that follow the 4 KiB header sector
    "Q"    # payload_hash      xxh64 of the payload, seeded with hash_seed
    "Q"    # header_hash       xxh64 of the 32 bytes above, seeded with hash_seed
)
assert CHECKPOINT_HEADER.size == 40
CHECKPOINT_HEADER_FIELDS = ("magic", "generation", "payload_len", "payload_hash", "header_hash")

JOURNAL_FRAME = struct.Struct(
    "<"
    "8s"   # magic             MAGIC_JOURNAL
    "Q"    # generation        generation of the checkpoint this frame follows
    "Q"    # seq               0, 1, 2, ... within a generation; a gap ends replay
    "I"    # payload_len       bytes of msgpack (a list of records) after the header
    "I"    # reserved0         zero
    "Q"    # payload_hash      xxh64 of the payload, seeded with hash_seed
    "Q"    # header_hash       xxh64 of the 40 bytes above, seeded with hash_seed
)
assert JOURNAL_FRAME.size == 48
JOURNAL_FRAME_FIELDS = ("magic", "generation", "seq", "payload_len", "reserved0", "payload_hash", "header_hash")


# The multi-mount protection record (format version 2 on), at sb.mmp_off. mkfs
# zeroes the sector: an all-zero sector is "never claimed". Its checksum is
# seeded with hash_seed, so a record left by an earlier filesystem on the same
# device never passes for one of ours.
MMP_CLEAN = 1                   # no owner: the last one unmounted (or released) it
MMP_IN_USE = 2                  # an owner claimed it; alive while ``seq`` advances
MMP_STATES = {MMP_CLEAN: "clean", MMP_IN_USE: "in use"}
MMP_MAX_INTERVAL_MS = 600_000   # 10 minutes: anything longer is damage, not a setting
MMP_RECORD = struct.Struct(
    "<"
    "8s"   # magic             MAGIC_MMP
    "I"    # state             MMP_CLEAN or MMP_IN_USE
    "I"    # interval_ms       the owner's heartbeat interval, milliseconds (1 .. MMP_MAX_INTERVAL_MS)
    "Q"    # seq               heartbeat counter: a random start per claim, + 1 per heartbeat
    "Q"    # claim_id          random per claim: tells two claims apart, whatever their host and pid
    "Q"    # pid               the owner's process id, on its host
    "Q"    # mount_ns          when the owner claimed the store, ns since the epoch (the owner's clock)
    "Q"    # heartbeat_ns      the owner's clock at its last heartbeat (shown, never trusted across hosts)
    "32s"  # host_id           the owner's /etc/machine-id (or hostname), ASCII, zero-padded
    "64s"  # hostname          the owner's hostname, UTF-8, zero-padded (for messages)
    "16s"  # program           the owner's tool: "mount.kvfs" or "fsck.kvfs", zero-padded
)
assert MMP_RECORD.size == 168, MMP_RECORD.size
MMP_RECORD_CHECKED = struct.Struct("<" + MMP_RECORD.format[1:] + "Q")   # + xxh64 of the above, seeded
assert MMP_RECORD_CHECKED.size == 176
MMP_RECORD_FIELDS = ("magic", "state", "interval_ms", "seq", "claim_id", "pid", "mount_ns",
                     "heartbeat_ns", "host_id", "hostname", "program")


class MmpRecord:
    """Decoded MMP record. Field meanings are documented on ``MMP_RECORD``; text fields are str."""

    TEXT = {"host_id": 32, "hostname": 64, "program": 16}

    def __init__(self, **fields):
        fields.setdefault("magic", MAGIC_MMP)
        for name in MMP_RECORD_FIELDS:
            setattr(self, name, fields[name])

    def replace(self, **changes):
        return MmpRecord(**{**{f: getattr(self, f) for f in MMP_RECORD_FIELDS}, **changes})

    def __eq__(self, other):
        return isinstance(other, MmpRecord) and all(getattr(self, f) == getattr(other, f)
                                                    for f in MMP_RECORD_FIELDS)

    def __repr__(self):
        return f"MmpRecord({', '.join(f'{f}={getattr(self, f)!r}' for f in MMP_RECORD_FIELDS[1:])})"

    @property
    def interval_s(self):
        return self.interval_ms / 1000

    def encode(self, seed):
        if self.state not in MMP_STATES or not 1 <= self.interval_ms <= MMP_MAX_INTERVAL_MS:
            raise FormatError(f"invalid MMP record: state {self.state}, interval {self.interval_ms} ms")
        values = []
        for name in MMP_RECORD_FIELDS:
            value = getattr(self, name)
            if name in self.TEXT:
                value = value.encode("utf-8", "replace")[:self.TEXT[name]]
            values.append(value)
        body = MMP_RECORD.pack(*values)
        return (body + struct.pack("<Q", xxhash.xxh64_intdigest(body, seed))).ljust(SECTOR, b"\0")

    @classmethod
    def decode(cls, sector, seed):
        """The record in an MMP sector; None for an all-zero (never claimed) sector.

        Raises FormatError for anything else that is not a valid record: a torn
        write, foreign data, or a record of an earlier filesystem (other seed).
        """
        if len(sector) < MMP_RECORD_CHECKED.size:
            raise FormatError("MMP sector is truncated")
        if not any(sector):
            return None
        *values, stored = MMP_RECORD_CHECKED.unpack_from(sector)
        if values[0] != MAGIC_MMP:
            raise FormatError("MMP sector holds no MMP record (bad magic)")
        if xxhash.xxh64_intdigest(bytes(sector[:MMP_RECORD.size]), seed) != stored:
            raise FormatError("MMP record checksum mismatch (a torn write, or damage)")
        fields = dict(zip(MMP_RECORD_FIELDS, values))
        for name in cls.TEXT:
            fields[name] = fields[name].rstrip(b"\0").decode("utf-8", "replace")
        if fields["state"] not in MMP_STATES:
            raise FormatError(f"MMP record has unknown state {fields['state']}")
        if not 1 <= fields["interval_ms"] <= MMP_MAX_INTERVAL_MS:
            raise FormatError(f"MMP record has an invalid interval ({fields['interval_ms']} ms)")
        return cls(**fields)


def field_layout(layout, names):
    """[(offset, size, name), ...] of a struct whose fields are ``names`` (docs/format.md's tables)."""
    codes = [c for c in layout.format if c.isalpha() or c.isdigit()]
    out, offset, count = [], 0, ""
    for c in codes:
        if c.isdigit():
            count += c
            continue
        size = struct.calcsize("<" + (count or "1") + c) if c == "s" else struct.calcsize("<" + c)
        out.append((offset, size))
        offset += size
        count = ""
    assert len(out) == len(names) and offset == layout.size, (len(out), len(names), offset)
    return [(off, size, name) for (off, size), name in zip(out, names)]


def check_block_size(block_size):
    """Raise FormatError unless ``block_size`` is one mkfs may use."""
    if block_size <= 0 or block_size & (block_size - 1) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise FormatError(f"block size must be a power of two between "
                          f"{MIN_BLOCK_SIZE >> 10} KiB and {MAX_BLOCK_SIZE >> 20} MiB, not {block_size}")


def check_device_size(device_size):
    """Raise FormatError if a device of ``device_size`` bytes cannot hold a kvfs."""
    if device_size < MIN_DEVICE_SIZE:
        raise FormatError(f"device too small: {device_size} bytes, need at least "
                          f"{MIN_DEVICE_SIZE >> 20} MiB")


class Superblock:
    """Decoded superblock. Field meanings are documented on ``SUPERBLOCK``."""

    FIELDS_V1 = ("magic", "version", "sector", "uuid", "block_size", "reserved0", "hash_seed",
                 "device_size", "checkpoint_a_off", "checkpoint_b_off", "checkpoint_len",
                 "journal_off", "journal_len", "data_off", "data_len", "created_ns")
    FIELDS = FIELDS_V1 + ("mmp_off", "key_secret")

    def __init__(self, **fields):
        # A version 1 superblock has neither field: no MMP sector (0) and no secret (b"").
        fields.setdefault("mmp_off", 0)
        fields.setdefault("key_secret", b"")
        for name in self.FIELDS:
            setattr(self, name, fields[name])

    @property
    def has_mmp(self):
        return self.mmp_off != 0

    @classmethod
    def create(cls, device_size, block_size=DEFAULT_BLOCK_SIZE, now_ns=0):
        """Compute the layout for a new filesystem of ``device_size`` bytes."""
        check_block_size(block_size)
        check_device_size(device_size)
        # Metadata gets 1/16 of the device (24 MiB .. 16 GiB): enough for ~10^6
        # files per checkpoint slot, and a journal that holds minutes of churn.
        meta = min(max(device_size // 16, 24 << 20), 16 << 30)
        checkpoint_len = align_down(meta * 3 // 8, 1 << 20)
        journal_len = align_down(meta - 2 * checkpoint_len, 1 << 20)
        mmp_off = 2 * SECTOR
        checkpoint_a = 3 * SECTOR
        checkpoint_b = checkpoint_a + checkpoint_len
        journal_off = checkpoint_b + checkpoint_len
        data_off = align_up(journal_off + journal_len, 1 << 20)
        data_len = align_down(device_size - data_off, SECTOR)
        return cls(magic=MAGIC_SUPERBLOCK, version=FORMAT_VERSION, sector=SECTOR,
                   uuid=uuidlib.uuid4().bytes, block_size=block_size, reserved0=0,
                   hash_seed=int.from_bytes(os.urandom(8), "little"),
                   mmp_off=mmp_off, key_secret=os.urandom(KEY_SECRET_LEN),
                   device_size=device_size, checkpoint_a_off=checkpoint_a,
                   checkpoint_b_off=checkpoint_b, checkpoint_len=checkpoint_len,
                   journal_off=journal_off, journal_len=journal_len,
                   data_off=data_off, data_len=data_len, created_ns=now_ns)

    def encode(self):
        layout, names = (SUPERBLOCK_V1, self.FIELDS_V1) if self.version == 1 else (SUPERBLOCK, self.FIELDS)
        body = layout.pack(*(getattr(self, f) for f in names))
        sector = body + struct.pack("<Q", xxhash.xxh64_intdigest(body))
        return sector.ljust(SECTOR, b"\0")

    @classmethod
    def decode(cls, sector):
        """Parse and validate one superblock sector; raise FormatError with the reason."""
        if len(sector) < SUPERBLOCK_V1_CHECKED.size:
            raise FormatError("superblock is truncated")
        if sector[:8] != MAGIC_SUPERBLOCK:
            if not any(sector[:SUPERBLOCK_V1_CHECKED.size]):
                raise FormatError("no kvfs superblock (the device is zero-filled)")
            raise FormatError("no kvfs superblock (bad magic): not a kvfs device")
        (version,) = struct.unpack_from("<I", sector, 8)
        if version not in READABLE_VERSIONS:
            readable = ", ".join(map(str, READABLE_VERSIONS))
            # A newer kvfs that kept this version's checked length is recognised as such;
            # otherwise the sector is damaged or of a layout this kvfs cannot check.
            if len(sector) >= SUPERBLOCK_CHECKED.size and xxhash.xxh64_intdigest(
                    sector[:SUPERBLOCK.size]) == SUPERBLOCK_CHECKED.unpack_from(sector)[-1]:
                raise FormatError(f"unsupported kvfs format version {version} (this kvfs reads "
                                  f"versions {readable}): it was made by a newer kvfs")
            raise FormatError(f"superblock checksum mismatch or unsupported format version {version} "
                              f"(this kvfs reads versions {readable}): the superblock is corrupt, "
                              f"or was made by a newer kvfs")
        checked, layout, names = ((SUPERBLOCK_V1_CHECKED, SUPERBLOCK_V1, cls.FIELDS_V1) if version == 1
                                  else (SUPERBLOCK_CHECKED, SUPERBLOCK, cls.FIELDS))
        if len(sector) < checked.size:
            raise FormatError("superblock is truncated")
        *values, stored_hash = checked.unpack_from(sector)
        if xxhash.xxh64_intdigest(sector[:layout.size]) != stored_hash:
            raise FormatError("superblock checksum mismatch: the superblock is corrupt")
        sb = cls(**dict(zip(names, values)))
        sb.check_layout()
        return sb

    def check_layout(self):
        regions = [(2 * SECTOR, 0)]
        if self.version >= 2:
            if self.mmp_off != 2 * SECTOR or len(self.key_secret) != KEY_SECRET_LEN:
                raise FormatError("superblock MMP offset or key secret is invalid: the superblock is corrupt")
            regions.append((self.mmp_off, SECTOR))
        regions += [(self.checkpoint_a_off, self.checkpoint_len),
                   (self.checkpoint_b_off, self.checkpoint_len),
                   (self.journal_off, self.journal_len), (self.data_off, self.data_len)]
        end = 0
        for off, length in regions:
            if off < end or off % SECTOR or length % SECTOR:
                raise FormatError("superblock layout is inconsistent: the superblock is corrupt")
            end = off + length
        if end > self.device_size or self.sector != SECTOR:
            raise FormatError("superblock layout exceeds the device size: the superblock is corrupt")
        if self.block_size & (self.block_size - 1) or not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise FormatError("superblock block size is invalid: the superblock is corrupt")


# Checkpoint and journal hashes are seeded with the filesystem's hash_seed: a
# frame or checkpoint left on the device by an earlier filesystem (before a
# mkfs --force) can never pass for one of ours.

def encode_checkpoint_header(generation, payload, seed):
    head = CHECKPOINT_HEADER.pack(MAGIC_CHECKPOINT, generation, len(payload),
                                  xxhash.xxh64_intdigest(payload, seed), 0)[:32]
    return (head + struct.pack("<Q", xxhash.xxh64_intdigest(head, seed))).ljust(SECTOR, b"\0")


def decode_checkpoint_header(sector, slot_len, seed):
    """Return (generation, payload_len, payload_hash) or None if the slot holds no valid header."""
    magic, generation, payload_len, payload_hash, header_hash = CHECKPOINT_HEADER.unpack_from(sector)
    if magic != MAGIC_CHECKPOINT or xxhash.xxh64_intdigest(sector[:32], seed) != header_hash:
        return None
    if payload_len > slot_len - SECTOR:
        return None
    return generation, payload_len, payload_hash


def encode_journal_frame(generation, seq, payload, seed):
    """One frame: header + payload, padded to whole sectors for O_DIRECT."""
    head = JOURNAL_FRAME.pack(MAGIC_JOURNAL, generation, seq, len(payload), 0,
                              xxhash.xxh64_intdigest(payload, seed), 0)[:40]
    head += struct.pack("<Q", xxhash.xxh64_intdigest(head, seed))
    frame = head + payload
    return frame.ljust(align_up(len(frame)), b"\0")


def decode_journal_header(buf, seed):
    """Return (generation, seq, payload_len, payload_hash) or None for a torn/absent header."""
    if len(buf) < JOURNAL_FRAME.size:
        return None
    magic, generation, seq, payload_len, _, payload_hash, header_hash = JOURNAL_FRAME.unpack_from(buf)
    if magic != MAGIC_JOURNAL or xxhash.xxh64_intdigest(bytes(buf[:40]), seed) != header_hash:
        return None
    return generation, seq, payload_len, payload_hash


def frame_size(payload_len):
    return align_up(JOURNAL_FRAME.size + payload_len)


# Signatures of other data that mkfs refuses to overwrite without --force.
FOREIGN_SIGNATURES = (
    (0, b"KVFSSUPR", "a kvfs filesystem"),
    (1080, b"\x53\xef", "an ext2/3/4 filesystem"),
    (0, b"XFSB", "an XFS filesystem"),
    (65600, b"_BHRfS_M", "a btrfs filesystem"),
    (4086, b"SWAPSPACE2", "a swap area"),
    (0, b"LUKS\xba\xbe", "a LUKS volume"),
    (512, b"EFI PART", "a GPT partition table"),
    (510, b"\x55\xaa", "an MBR partition table"),
)


def identify_existing_data(head):
    """Describe what the first 64 KiB+ of a device hold, or None if they are all zero."""
    for off, sig, what in FOREIGN_SIGNATURES:
        if head[off:off + len(sig)] == sig:
            return what
    if any(head):
        return "non-zero data of unknown type"
    return None
