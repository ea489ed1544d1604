"""Loading a store: superblock, newest checkpoint, committed journal prefix (synchronous).

Durable state can prove that a newer generation than the loaded one existed (a
newer checkpoint whose payload is corrupt, journal frames of a newer
generation) or that a committed frame was lost (a corrupt frame followed by its
successor). Loading would then silently roll back committed changes, so
:func:`load` raises FormatError. With ``salvage`` (fsck) it loads what it can
instead: ``damage`` lists the proofs, ``records`` holds every record that may
still apply, and ``highest_generation`` is the newest generation seen
anywhere, which a repair checkpoint must exceed.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Optional

import msgpack
import xxhash

from .. import schema
from ..base.aligned import Buffer
from ..device.port import DevicePort
from ..errors import FormatError
from ..schema.stream import decode_streaming
from ..schema.validate import check_block_count
from .childcheck import ChildCheck, start as start_child_check

log = logging.getLogger(__name__)

JOURNAL_READ_WINDOW = 4 << 20
FIRST_INO = 16                  # schema: 0..15 are reserved


def load(device: DevicePort, *, salvage: bool = False, decode_checkpoint: bool = True,
         stream_inodes: bool = False) -> Loaded:
    """A :class:`Loaded` store; FormatError with the reason if it must not be mounted.

    Without ``decode_checkpoint`` (mount.kvfs's check before it forks the daemon)
    the checkpoint slots are read and their checksums verified, but the payload
    is not decoded: ``state`` stays None. Decoding is most of a remount's store
    load, and the daemon does it once anyway. With ``stream_inodes`` (the
    daemon) ``state.inodes`` is decoded as it is iterated, once
    (kvfs/schema/stream.py); its rows are checked then."""
    loaded = Loaded(device, read_superblock(device), salvage)
    loaded.stream_inodes = stream_inodes and not salvage
    try:
        loaded._load_checkpoint(decode=decode_checkpoint)
        loaded._load_journal()
        if salvage:
            loaded._scan_journal_generations()
        if loaded.damage and not salvage:
            raise FormatError(f"{device.path}: {loaded.damage[0]}; mounting would silently lose "
                              f"committed changes: run fsck.kvfs --repair to recover what can be "
                              f"recovered")
    except Exception:
        loaded.confirm_checked()    # a refusal of the checkpoint's rows comes first, as in process
        raise
    return loaded


class Loaded:
    """What loading found: the checkpoint state, the records to replay, and where the journal ends."""

    def __init__(self, device: DevicePort, sb: schema.Superblock, salvage: bool) -> None:
        self.device = device
        self.sb = sb
        self.salvage = salvage
        self.generation = 0
        self._active_slot = 0
        self.state: Optional[schema.CheckpointState] = None
        self.records: list[Any] = []     # schema records of the committed journal prefix
        self.replay_report: dict[str, Any] = {}
        self.damage: list[str] = []      # proofs that loading lost committed changes
        self.highest_generation = 0      # newest generation seen in any slot header or frame
        self.skipped_records = 0         # salvage: records that do not decode
        self.stream_inodes = False       # state.inodes decoded as it is consumed (load's stream_inodes)
        self._child_check: Optional[ChildCheck] = None   # until confirm_checked
        self._journal_cursor = self._frame_seq = 0
        self._newer_frames_reported = False

    @property
    def active_slot(self) -> int:
        return self._active_slot

    @property
    def journal_cursor(self) -> int:
        return self._journal_cursor

    @property
    def frame_seq(self) -> int:
        return self._frame_seq

    def journal_grew(self) -> bool:
        """A valid next frame where the loaded journal ends: something was committed since the load."""
        header, _ = self._frame_at(self._journal_reader(), self._journal_cursor)
        return header is not None and header[:2] == (self.generation, self._frame_seq)

    def _decode_records(self, wires, generation, seq):
        out = []
        if not isinstance(wires, list):
            wires = [wires]                 # not a list of records: fails as one bad record
        for wire in wires:
            try:
                record = schema.decode_record(wire)
                if isinstance(record, schema.Content):
                    check_block_count(self.sb.block_size, record.size, len(record.blocks), record.ino)
                    for block in record.blocks:
                        if block is not None:
                            check_extent(self.sb, block.off, block.length, "a content record's block")
                out.append(record)
            except FormatError as exc:
                if not self.salvage:
                    raise FormatError(f"journal frame {seq} of generation {generation}: {exc}: "
                                      f"run fsck.kvfs --repair") from None
                self.skipped_records += 1
        return out

    def _slot_off(self, slot):
        return (self.sb.checkpoint_a_off, self.sb.checkpoint_b_off)[slot]

    def _read_header(self, slot):
        """(generation, payload length, digest) of a slot's header; None if it holds no valid one
        (zeroed, or a torn header write)."""
        return schema.decode_checkpoint_header(self.device.pread_sync(self._slot_off(slot), schema.SECTOR),
                                               self.sb.checkpoint_len, self.sb.hash_seed)

    def _read_payload(self, slot, header):
        """The slot's payload; None if it fails the header's checksum."""
        _, length, digest = header
        payload = self.device.pread_sync(self._slot_off(slot) + schema.SECTOR, length)
        return payload if xxhash.xxh64_intdigest(payload, self.sb.hash_seed) == digest else None

    def _load_checkpoint(self, decode=True):
        """Find the newest checkpoint whose payload passes its checksum, and decode it (with ``decode``).

        Slots are tried newest header first, and an older slot's payload is read
        only when the newer one fails: at a million files a payload is 130 MB,
        and reading and hashing the one a mount does not use cost it 0.3 s.
        So a damaged older slot is found by fsck (``salvage`` reads both), not
        by a mount; the next checkpoint overwrites that slot anyway. Without
        ``decode`` (mount.kvfs before it forks) the payload is still read and
        verified: a damaged checkpoint is refused before the daemon writes its
        multi-mount claim (a refused mount writes nothing).
        """
        headers = {slot: self._read_header(slot) for slot in (0, 1)}
        newest_first = sorted(((h[0], slot) for slot, h in headers.items() if h), reverse=True)
        if newest_first:
            self.highest_generation = newest_first[0][0]
        payload, failed = None, []
        for generation, slot in newest_first:
            payload = self._read_payload(slot, headers[slot])
            if payload is not None:
                self.generation, self._active_slot = generation, slot
                break
            failed.append((generation, slot))
        if payload is None:
            raise FormatError("no valid checkpoint in either slot: the metadata is corrupt "
                              "(fsck.kvfs cannot rebuild it; the data blocks are unreadable without it)")
        for generation, slot in failed:
            # The header is written only after the payload is durable, so a
            # valid header over a bad payload is damage, not a torn write.
            self.damage.append(f"checkpoint slot {'AB'[slot]} holds generation {generation}, newer than "
                               f"generation {self.generation} in slot {'AB'[self._active_slot]}, "
                               f"but its payload fails its checksum")
        if self.salvage:
            for generation, slot in newest_first:
                if generation < self.generation and self._read_payload(slot, headers[slot]) is None:
                    log.warning("checkpoint slot %s (generation %s, older than the one in use) is damaged; "
                                "the next checkpoint overwrites it", "AB"[slot], generation)
        if not decode:
            return
        if self.stream_inodes:
            # The rows' checks in a child process while this one builds (childcheck).
            sb, slot, kept = self.sb, self._active_slot, [payload]

            def check():
                # The child checks the payload as forked. Here (the child died) it
                # is read again: holding it for that case kept 130 MB alive through
                # the whole build at a million files.
                again = kept[0] if kept[0] is not None else self._read_payload(slot, headers[slot])
                if again is None:
                    raise FormatError(f"checkpoint slot {'AB'[slot]} no longer passes its checksum")
                check_payload(sb, again)
            self._child_check = start_child_check(check, len(payload))
            if self._child_check is not None:
                kept[0] = None
            self.state = decode_streaming(payload, FIRST_INO, sb.block_size, checked=self._child_check is None)
            if self.state is None and self._child_check is not None:
                self.confirm_checked()      # not a plain map: decoded whole below, and checked here
        if self.state is None:
            try:
                wire = msgpack.unpackb(payload, strict_map_key=False)
            except Exception as exc:
                raise FormatError(f"checkpoint payload does not decode: {exc}") from None
            self.state = schema.CheckpointState.from_wire(wire, FIRST_INO)
            del wire
            for row in self.state.inodes:
                self._check_row(row)
        if not self.salvage and self._child_check is None:     # fsck reports and repairs the space map itself
            check_extents(self.sb, self.state)

    def confirm_checked(self) -> None:
        """Wait for the checkpoint checks a child runs (if one does); FormatError if they refuse.

        A mount calls this before it uses anything built from the rows: they were
        decoded unchecked (kvfs/store/childcheck.py)."""
        check, self._child_check = self._child_check, None
        if check is None:
            return
        refusal = check.verdict()
        # In the mount's report (the daemon logs it): where the rows were checked.
        self.replay_report["checkpoint_check"] = "child process" if check.ran_in_child else "here (the child died)"
        if refusal:
            raise FormatError(refusal)

    def _check_row(self, row):
        if row.mode & 0o170000 == 0o100000:
            check_block_count(self.sb.block_size, row.size, len(row.keys), row.ino)

    def _journal_reader(self):
        """``read(cursor, size)``: journal bytes, through a window of JOURNAL_READ_WINDOW bytes."""
        base, limit = self.sb.journal_off, self.sb.journal_len
        window = [0, b""]

        def read(cursor, size):
            size = min(size, limit - cursor)
            if not (window[0] <= cursor and cursor + size <= window[0] + len(window[1])):
                window[0] = cursor
                window[1] = self.device.pread_sync(base + cursor, min(max(JOURNAL_READ_WINDOW, size),
                                                                      limit - cursor))
            return window[1][cursor - window[0]:cursor - window[0] + size]
        return read

    def _frame_at(self, read, cursor):
        """(header, payload-if-its-hash-matches) of the frame at ``cursor``; header None if there is none."""
        limit = self.sb.journal_len
        if cursor + schema.SECTOR > limit:
            return None, None
        header = schema.decode_journal_header(read(cursor, schema.SECTOR), self.sb.hash_seed)
        if header is None:
            return None, None
        generation, frame_seq, length, digest = header
        size = schema.frame_size(length)
        if cursor + size > limit:
            return header, None
        payload = read(cursor + schema.JOURNAL_FRAME.size, length)
        if xxhash.xxh64_intdigest(payload, self.sb.hash_seed) != digest:
            return header, None
        return header, payload

    def _load_journal(self):
        """Collect records of the committed journal prefix; stop at the first bad frame.

        A bad frame is the uncommitted tail only if nothing committed follows it:
        a corrupt frame followed by a valid frame of the same generation with the
        next sequence number was itself committed (frames are written one at a
        time, each after the previous one is durable), so it is damage. Frames of
        a generation newer than the checkpoint's prove a newer checkpoint existed.
        In salvage mode replay goes on after a corrupt committed frame, and a
        journal of a newer generation is replayed on top of the older checkpoint.
        """
        read = self._journal_reader()
        generation = self.generation
        cursor, seq, records, stop = 0, 0, [], "end of journal region"
        lost_frames = 0
        while True:
            header, payload = self._frame_at(read, cursor)
            if header is None:
                found = self._committed_after(read, cursor, generation, seq)
                if found is None:
                    stop = "no further frame" if cursor + schema.SECTOR <= self.sb.journal_len else stop
                    break
                next_cursor, next_seq = found
                self.damage.append(f"journal frame {seq} of generation {generation} is gone (no valid header "
                                   f"at journal offset {cursor}), but frame {next_seq} after it was committed")
                if not self.salvage:
                    stop = "missing committed frame"
                    break
                lost_frames += next_seq - seq
                cursor, seq = next_cursor, next_seq
                continue
            frame_generation, frame_seq, length, _ = header
            if frame_generation > self.generation and cursor == 0 and seq == 0:
                self._newer_frames_reported = True
                self.damage.append(f"the journal holds frames of generation {frame_generation}, newer than "
                                   f"the checkpoint in use (generation {self.generation})")
                self.highest_generation = max(self.highest_generation, frame_generation)
                if not self.salvage:
                    stop = "frame of a newer generation"
                    break
                generation = frame_generation
            if frame_generation != generation or frame_seq != seq:
                if frame_generation > self.generation:
                    self._newer_frames_reported = True
                    self.damage.append(f"journal frame at offset {cursor} belongs to generation "
                                       f"{frame_generation}, newer than the checkpoint in use "
                                       f"(generation {self.generation})")
                    self.highest_generation = max(self.highest_generation, frame_generation)
                stop = "frame of another generation"
                break
            size = schema.frame_size(length)
            decoded = None
            if payload is not None:
                try:
                    decoded = msgpack.unpackb(payload, strict_map_key=False)
                except Exception:
                    decoded = None
            if decoded is None:
                follower, follower_payload = self._frame_at(read, cursor + size)
                if follower is None or follower[:2] != (generation, seq + 1) or follower_payload is None:
                    stop = ("torn frame (payload checksum mismatch): uncommitted tail dropped" if payload is None
                            else "frame payload does not decode: uncommitted tail dropped")
                    if cursor + size > self.sb.journal_len:
                        stop = "frame overruns the journal region (torn)"
                    break
                self.damage.append(f"journal frame {seq} of generation {generation} is corrupt, but the "
                                   f"frame after it was committed")
                if not self.salvage:
                    stop = "corrupt committed frame"
                    break
                lost_frames += 1
            else:
                records.extend(self._decode_records(decoded, generation, seq))
            cursor += size
            seq += 1
        self._journal_cursor, self._frame_seq = cursor, seq
        self.records = records
        self.replay_report = {"frames": seq, "records": len(records), "bytes": cursor, "stopped": stop}
        if lost_frames:
            self.replay_report["lost_frames"] = lost_frames

    def _committed_after(self, read, cursor, generation, seq):
        """(cursor, seq) of a valid frame of ``generation`` with a sequence number above ``seq``
        within JOURNAL_READ_WINDOW after ``cursor``, or None.

        Where no header is found replay ends; if a later frame of the same generation
        follows, the missing one was committed (frames are written one at a time, each
        after the previous one is durable), so this is damage, not a torn tail. Frames
        of a generation are never rewritten, and the header hashes are keyed with the
        filesystem's secret seed, so nothing else passes for such a frame.
        """
        end = min(self.sb.journal_len, cursor + JOURNAL_READ_WINDOW)
        probe = cursor + schema.SECTOR
        while probe + schema.SECTOR <= end:
            header = schema.decode_journal_header(read(probe, schema.SECTOR), self.sb.hash_seed)
            if header is not None and header[0] == generation and header[1] > seq:
                return probe, header[1]
            probe += schema.SECTOR
        return None

    def _scan_journal_generations(self):
        """Salvage only: find frames of newer generations anywhere in the journal region.

        Every sector that starts a valid frame header is looked at (skipping the
        body of each frame found), so stale frames beyond the replayed prefix
        count too. Costs one read of the journal region.
        """
        read = self._journal_reader()
        cursor, newer = 0, []
        while cursor + schema.SECTOR <= self.sb.journal_len:
            header = schema.decode_journal_header(read(cursor, schema.SECTOR), self.sb.hash_seed)
            if header is None:
                cursor += schema.SECTOR
                continue
            self.highest_generation = max(self.highest_generation, header[0])
            if header[0] > self.generation:
                newer.append(header[0])
            cursor += schema.frame_size(header[2])
        if newer and not self._newer_frames_reported:
            self.damage.append(f"the journal holds {len(newer)} frame(s) of generation {max(newer)}, "
                               f"newer than the checkpoint in use (generation {self.generation})")


def read_superblock(device: DevicePort) -> schema.Superblock:
    """Decode the primary superblock, naming the backup if only that one is good."""
    if device.size < schema.MIN_DEVICE_SIZE:
        raise FormatError(f"{device.path}: {device.size} bytes is too small to hold kvfs")
    head = device.pread_sync(0, 2 * schema.SECTOR)
    try:
        sb = schema.Superblock.decode(head[:schema.SECTOR])
    except FormatError as primary_error:
        try:
            schema.Superblock.decode(head[schema.SECTOR:])
        except FormatError:
            raise primary_error from None
        raise FormatError(f"{primary_error}; the backup superblock is intact: "
                          f"run fsck.kvfs --repair to restore it") from None
    if device.size < sb.device_size:
        raise FormatError(f"{device.path} is {device.size} bytes but the filesystem was made for "
                          f"{sb.device_size}: the device is truncated")
    if sb.checkpoint_len <= schema.SECTOR or sb.journal_len < schema.SECTOR or sb.data_len < sb.block_size:
        raise FormatError(f"{device.path}: the superblock's regions are too small to use "
                          f"(checkpoint slots {sb.checkpoint_len}, journal {sb.journal_len}, data "
                          f"{sb.data_len} bytes): the superblock is corrupt")
    return sb


def check_extent(sb: schema.Superblock, off: int, length: int, what: str) -> None:
    """FormatError unless [off, off+length) is a sector-aligned piece of the data region holding a block."""
    if off % schema.SECTOR or off < sb.data_off or off + schema.align_up(length) > sb.data_off + sb.data_len:
        raise FormatError(f"{what} at {off} (+{length}) lies outside the data region")
    if length > sb.block_size:
        raise FormatError(f"{what} at {off} is {length} bytes, more than the block size {sb.block_size}")


def check_payload(sb: schema.Superblock, payload: Buffer) -> None:
    """Every check a mount's decode of ``payload`` makes, and nothing built: a child runs this."""
    state = decode_streaming(payload, FIRST_INO, sb.block_size)         # block rows checked here
    if state is not None:
        check_extents(sb, state)            # in _load_checkpoint's order: the same first refusal
        if not isinstance(state.inodes, list):      # a list: not an array on the wire, from_wire checked it
            for _ in state.inodes.batches():                            # inode rows checked here
                pass


def check_extents(sb: schema.Superblock, state: schema.CheckpointState) -> None:
    """The checkpoint's block extents and free extents lie in the data region and never overlap.

    Mount refuses such a checkpoint: an allocator built over overlapping extents
    would hand out space that a block still occupies. fsck --repair rebuilds the
    free map from the blocks.
    """
    # (off, length, row or None for a free extent): a block's description is
    # formatted only for the error. Formatting one per block up front cost a
    # 100-byte string per block at the mount's peak of memory.
    extents = []
    append, sector = extents.append, schema.SECTOR
    data_off, data_end, block_size = sb.data_off, sb.data_off + sb.data_len, sb.block_size
    for row in state.blocks:
        # check_extent's test, inline and with no message made: a million blocks at a remount
        off, length = row.off, row.length
        aligned = (length + sector - 1) // sector * sector
        if off % sector or off < data_off or off + aligned > data_end or length > block_size:
            check_extent(sb, off, length, f"block {row.key.hex()}")
        append((off, aligned, row))
    for off, length in state.free or ():
        if off % schema.SECTOR or length % schema.SECTOR or length == 0 or off < sb.data_off \
                or off + length > sb.data_off + sb.data_len:
            raise FormatError(f"free extent at {off} (+{length}) lies outside the data region or is "
                              f"not sector-aligned: the checkpoint's space map is corrupt: run fsck.kvfs")
        extents.append((off, length, None))
    # By offset alone (any two extents at one offset overlap, whatever their
    # lengths): an int key per extent, not a tuple, and the sort is stable.
    extents.sort(key=operator.itemgetter(0))
    for (off, length, what), (next_off, _, next_what) in zip(extents, extents[1:]):
        if off + length > next_off:
            raise FormatError(f"{_extent_name(what)} at {off} overlaps {_extent_name(next_what)} at "
                              f"{next_off}: the checkpoint's space map is corrupt: run fsck.kvfs --repair")


def _extent_name(row):
    return "a free extent" if row is None else f"block {row.key.hex()}"
