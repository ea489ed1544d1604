"""The extent store: free-space map, journal and checkpoints on the device.

The store knows nothing about files or blocks. It hands out extents (runs of
4 KiB sectors in the data region), and it makes *records* durable: upper layers
append small msgpack-able records describing each state change, and
:meth:`ExtentStore.commit` writes them as one journal frame. When the journal
fills, the store asks the registered snapshot source for the whole state and
writes it as a checkpoint instead, which empties the journal.

Freed extents are not reused until the record that freed them is durable:
otherwise a crash could leave a durable record pointing at an extent that
already holds someone else's data.
"""
import bisect
import dataclasses
import errno
import logging

import msgpack
import trio
import xxhash

from . import format as fmt
from .errors import FormatError, KvfsError, NoSpace

log = logging.getLogger(__name__)

JOURNAL_READ_WINDOW = 4 << 20


class Allocator:
    """Free extents of the data region as a sorted list of starts plus a length map.

    Offsets and lengths are bytes, always multiples of SECTOR. Allocation is
    next-fit from a rotating cursor, which keeps equal-sized KV blocks packed in
    write order and makes the common case O(log n).

    A block must lie in one contiguous extent, so free bytes alone do not say
    whether a block fits: a region fragmented into 512 KiB holes has space but
    no room for a 1 MiB block. ``slots`` counts the whole ``slot``-sized pieces
    the free extents hold (sum of ``len // slot``). Invariant, relied on by the
    block index's reservations: an allocation of at most ``slot`` bytes lowers
    ``slots`` by at most one, so ``k <= slots`` reserved blocks can always be
    allocated. Allocations smaller than a slot are placed, where possible, in
    the spare tail of an extent, so they cost no slot.
    """

    SMALL_FIT_SCAN = 64          # extents examined for a slot-free home of a small allocation

    def __init__(self, start, length, free_extents=None, *, slot=fmt.SECTOR):
        self.start = start
        self.end = start + length
        self.slot = slot
        self._starts = []
        self._len = {}
        self._cursor = start
        self.free_bytes = 0
        self.slots = 0
        for off, n in (free_extents if free_extents is not None else [(start, length)]):
            self.free(off, n)

    def extents(self):
        return [(s, self._len[s]) for s in self._starts]

    def allocate(self, nbytes):
        nbytes = fmt.align_up(nbytes)
        count = len(self._starts)
        first = bisect.bisect_left(self._starts, self._cursor)
        if nbytes < self.slot:
            for i in range(min(count, self.SMALL_FIT_SCAN)):
                start = self._starts[(first + i) % count]
                if self._len[start] % self.slot >= nbytes:
                    # From the extent's end: its whole slots stay whole.
                    off = start + self._len[start] - nbytes
                    self._take(start, off, nbytes)
                    return off
        for i in range(count):
            start = self._starts[(first + i) % count]
            if self._len[start] >= nbytes:
                self._take(start, start, nbytes)
                self._cursor = start + nbytes
                return start
        raise NoSpace(f"no free extent of {nbytes} bytes ({self.free_bytes} bytes free in total)")

    def allocate_at(self, off, nbytes):
        """Mark [off, off+nbytes) allocated; it must be free (used by replay)."""
        nbytes = fmt.align_up(nbytes)
        i = bisect.bisect_right(self._starts, off) - 1
        if i < 0 or self._starts[i] + self._len[self._starts[i]] < off + nbytes:
            raise FormatError(f"extent [{off}, +{nbytes}) is referenced twice or lies outside free space")
        self._take(self._starts[i], off, nbytes)

    def _take(self, ext_start, off, nbytes):
        ext_len = self._remove(ext_start)
        head = off - ext_start
        tail = ext_start + ext_len - (off + nbytes)
        if head:
            self._insert(ext_start, head)
        if tail:
            self._insert(off + nbytes, tail)
        self.free_bytes -= nbytes

    def _insert(self, off, nbytes):
        bisect.insort(self._starts, off)
        self._len[off] = nbytes
        self.slots += nbytes // self.slot

    def _remove(self, off):
        """Take the free extent starting at ``off`` out of the map; return its length."""
        nbytes = self._len.pop(off)
        del self._starts[bisect.bisect_left(self._starts, off)]
        self.slots -= nbytes // self.slot
        return nbytes

    def free(self, off, nbytes):
        nbytes = fmt.align_up(nbytes)
        if off < self.start or off + nbytes > self.end or off % fmt.SECTOR:
            raise FormatError(f"freeing extent [{off}, +{nbytes}) outside the data region")
        i = bisect.bisect_left(self._starts, off)
        if i < len(self._starts) and self._starts[i] < off + nbytes:
            raise FormatError(f"double free of extent [{off}, +{nbytes})")
        if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] > off:
            raise FormatError(f"double free of extent [{off}, +{nbytes})")
        self.free_bytes += nbytes
        # Coalesce with the following and the preceding free extent.
        if i < len(self._starts) and self._starts[i] == off + nbytes:
            nbytes += self._remove(self._starts[i])
        if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] == off:
            prev = self._starts[i - 1]
            off, nbytes = prev, self._remove(prev) + nbytes
        self._insert(off, nbytes)


@dataclasses.dataclass(frozen=True)
class StoreStatistics:
    generation: int
    journal_bytes: int
    journal_capacity: int
    journal_frames: int
    commits: int
    checkpoints: int
    records_pending: int
    capacity_bytes: int
    free_bytes: int
    pending_free_bytes: int


class ExtentStore:
    """Allocator + journal + checkpoints over one open :class:`~kvfs.device.Device`."""

    def __init__(self, device, superblock):
        self.device = device
        self.sb = superblock
        self.allocator = None
        self.generation = 0
        self._active_slot = 0           # slot index holding the newest checkpoint
        self._journal_cursor = 0        # bytes of journal used in this generation
        self._frame_seq = 0
        self._pending = []              # records appended, not yet durable
        self._appended = 0              # records appended since mount (monotonic)
        self._durable = 0               # of those, how many are durable
        self._pending_frees = []        # (appended-count, off, nbytes) awaiting durability
        self.replaying = True           # frees take effect at once during replay
        self._snapshot_source = None
        self._commit_lock = trio.Lock()
        self._commits = self._checkpoints = 0
        self.checkpoint_state = {}
        self.replay_records = []
        self.replay_report = {}
        self.salvage = False
        self.damage = []                # proofs that loading lost committed changes
        self.highest_generation = 0     # newest generation seen in any slot header or frame
        self._newer_frames_reported = False

    # -- opening ----------------------------------------------------------
    @classmethod
    def open(cls, device, *, salvage=False):
        """Read superblock, newest checkpoint and the committed journal (synchronously).

        Durable state can prove that a newer generation than the loaded one
        existed (a newer checkpoint whose payload is corrupt, journal frames of a
        newer generation) or that a committed frame was lost (a corrupt frame
        followed by its successor). Loading would then silently roll back
        committed changes, so ``open`` raises FormatError. With ``salvage``
        (fsck) it loads what it can instead: ``damage`` lists the proofs,
        ``replay_records`` holds every record that may still apply, and
        ``highest_generation`` is the newest generation seen anywhere, which a
        repair checkpoint must exceed.
        """
        sb = read_superblock(device)
        store = cls(device, sb)
        store.salvage = salvage
        store._load_checkpoint()
        store._load_journal()
        if salvage:
            store._scan_journal_generations()
        if store.damage and not salvage:
            raise FormatError(f"{device.path}: {store.damage[0]}; mounting would silently lose "
                              f"committed changes: run fsck.kvfs --repair to recover what can be "
                              f"recovered")
        return store

    def _read_slot(self, slot):
        """(generation, payload) of a slot; payload None if its header is valid but the payload is not.

        None when the slot holds no valid header at all (zeroed, or a torn header write).
        """
        off = (self.sb.checkpoint_a_off, self.sb.checkpoint_b_off)[slot]
        header = fmt.decode_checkpoint_header(self.device.pread_sync(off, fmt.SECTOR), self.sb.checkpoint_len,
                                               self.sb.hash_seed)
        if header is None:
            return None
        generation, length, digest = header
        payload = self.device.pread_sync(off + fmt.SECTOR, length)
        if xxhash.xxh64_intdigest(payload, self.sb.hash_seed) != digest:
            return generation, None
        return generation, payload

    def _load_checkpoint(self):
        found = {slot: self._read_slot(slot) for slot in (0, 1)}
        valid = [(got[0], slot, got[1]) for slot, got in found.items() if got and got[1] is not None]
        if not valid:
            raise FormatError("no valid checkpoint in either slot: the metadata is corrupt "
                              "(fsck.kvfs cannot rebuild it; the data blocks are unreadable without it)")
        self.generation, self._active_slot, payload = max(valid)
        self.highest_generation = max(got[0] for got in found.values() if got)
        for slot, got in found.items():
            if got and got[1] is None:
                # The header is written only after the payload is durable, so a
                # valid header over a bad payload is damage, not a torn write.
                if got[0] > self.generation:
                    self.damage.append(f"checkpoint slot {'AB'[slot]} holds generation {got[0]}, newer than "
                                       f"generation {self.generation} in slot {'AB'[self._active_slot]}, "
                                       f"but its payload fails its checksum")
                else:
                    log.warning("checkpoint slot %s (generation %s, older than the one in use) is damaged; "
                                "the next checkpoint overwrites it", "AB"[slot], got[0])
        try:
            self.checkpoint_state = msgpack.unpackb(payload, strict_map_key=False)
        except Exception as exc:
            raise FormatError(f"checkpoint payload does not decode: {exc}") from None
        free = self.checkpoint_state.get("free")
        self.allocator = Allocator(self.sb.data_off, self.sb.data_len,
                                   [tuple(e) for e in free] if free is not None else None,
                                   slot=self.sb.block_size)

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
        if cursor + fmt.SECTOR > limit:
            return None, None
        header = fmt.decode_journal_header(read(cursor, fmt.SECTOR), self.sb.hash_seed)
        if header is None:
            return None, None
        generation, frame_seq, length, digest = header
        size = fmt.frame_size(length)
        if cursor + size > limit:
            return header, None
        payload = read(cursor + fmt.JOURNAL_FRAME.size, length)
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
                stop = "no further frame" if cursor + fmt.SECTOR <= self.sb.journal_len else stop
                break
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
            size = fmt.frame_size(length)
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
                records.extend(decoded)
            cursor += size
            seq += 1
        self._journal_cursor, self._frame_seq = cursor, seq
        self.replay_records = records
        self.replay_report = {"frames": seq, "records": len(records), "bytes": cursor, "stopped": stop}
        if lost_frames:
            self.replay_report["lost_frames"] = lost_frames

    def _scan_journal_generations(self):
        """Salvage only: find frames of newer generations anywhere in the journal region.

        Every sector that starts a valid frame header is looked at (skipping the
        body of each frame found), so stale frames beyond the replayed prefix
        count too. Costs one read of the journal region.
        """
        read = self._journal_reader()
        cursor, newer = 0, []
        while cursor + fmt.SECTOR <= self.sb.journal_len:
            header = fmt.decode_journal_header(read(cursor, fmt.SECTOR), self.sb.hash_seed)
            if header is None:
                cursor += fmt.SECTOR
                continue
            self.highest_generation = max(self.highest_generation, header[0])
            if header[0] > self.generation:
                newer.append(header[0])
            cursor += fmt.frame_size(header[2])
        if newer and not self._newer_frames_reported:
            self.damage.append(f"the journal holds {len(newer)} frame(s) of generation {max(newer)}, "
                               f"newer than the checkpoint in use (generation {self.generation})")

    def finish_replay(self):
        """Called once upper layers have applied the replayed records."""
        self.replaying = False
        self.replay_records = []
        self.checkpoint_state = {}

    # -- space --------------------------------------------------------------
    def allocate(self, nbytes):
        return self.allocator.allocate(nbytes)

    def allocate_at(self, off, nbytes):
        self.allocator.allocate_at(off, nbytes)

    def free(self, off, nbytes):
        """Free an extent; live frees wait until the freeing record is durable."""
        if self.replaying:
            self.allocator.free(off, nbytes)
        else:
            self._pending_frees.append((self._appended, off, fmt.align_up(nbytes)))

    @property
    def pending_free_bytes(self):
        return sum(n for _, _, n in self._pending_frees)

    # -- journal ------------------------------------------------------------
    def set_snapshot_source(self, fn):
        """``fn()`` returns the whole filesystem state (a msgpack-able dict) for checkpoints."""
        self._snapshot_source = fn

    def append(self, record):
        """Queue a record; it is durable once a later :meth:`commit` returns."""
        self._pending.append(record)
        self._appended += 1

    def reserve_metadata_space(self):
        """Best effort at mount, for stores made before mkfs did this itself."""
        try:
            reserve_metadata_space(self.device, self.sb)
        except KvfsError as exc:
            log.warning("%s; a full host filesystem may then stall metadata commits", exc)

    def checkpoint_capacity(self):
        """Bytes of state one checkpoint slot holds."""
        return self.sb.checkpoint_len - fmt.SECTOR

    @property
    def journal_fill(self):
        return self._journal_cursor / self.sb.journal_len

    async def commit(self):
        """Make every record appended so far durable (group commit)."""
        target = self._appended
        async with self._commit_lock:
            if self._durable >= target:
                await self._made_durable(self._durable)     # frees that need no further record
                return
            records, upto = self._pending, self._appended
            payload = msgpack.packb(records)
            if self._journal_cursor + fmt.frame_size(len(payload)) > self.sb.journal_len:
                await self._checkpoint_locked()
                return
            self._pending = []
            frame = fmt.encode_journal_frame(self.generation, self._frame_seq, payload, self.sb.hash_seed)
            try:
                await self.device.sync()             # block data before the records naming it
                await self.device.pwrite(self.sb.journal_off + self._journal_cursor, frame)
                await self.device.sync()
            except BaseException:
                self._pending = records + self._pending
                raise
            self._journal_cursor += len(frame)
            self._frame_seq += 1
            self._commits += 1
            await self._made_durable(upto)

    async def checkpoint(self):
        """Write the whole state to the inactive slot and start a new journal generation."""
        async with self._commit_lock:
            await self._checkpoint_locked()

    async def _checkpoint_locked(self):
        # The snapshot is taken synchronously, so it reflects exactly the records
        # appended up to now; later records go into the new generation's journal.
        state = self._snapshot_source()
        upto = self._appended
        payload = msgpack.packb(state)
        if fmt.SECTOR + len(payload) > self.sb.checkpoint_len:
            raise KvfsError(f"metadata ({len(payload)} bytes) exceeds the checkpoint slot "
                            f"({self.sb.checkpoint_len} bytes)", errno.ENOSPC)
        # Records in the snapshot leave the queue only once the checkpoint is
        # durable; if the write fails they still go to the current journal.
        records, self._pending = self._pending, []
        slot = 1 - self._active_slot
        off = (self.sb.checkpoint_a_off, self.sb.checkpoint_b_off)[slot]
        generation = self.generation + 1
        try:
            await self.device.sync()
            await self._write_slot(off, generation, payload)
        except BaseException:
            self._pending = records + self._pending
            raise
        self.generation, self._active_slot = generation, slot
        self._journal_cursor = self._frame_seq = 0
        self._checkpoints += 1
        await self._made_durable(upto)

    async def _write_slot(self, off, generation, payload):
        """Write a checkpoint into the slot at ``off``: the payload, and only once it is durable, the header.

        A crash during the payload write leaves the slot's old header (an older
        generation) over a half-written payload; a crash during the one-sector
        header write leaves no valid header. Either way the slot does not claim
        the new generation, so a valid header over a bad payload always means
        damage after the fact, which the loader may treat as proof that this
        generation existed.
        """
        await self.device.pwrite(off + fmt.SECTOR, payload)
        await self.device.sync()
        await self.device.pwrite(off, fmt.encode_checkpoint_header(generation, payload, self.sb.hash_seed))
        await self.device.sync()

    async def _made_durable(self, upto):
        """Records up to ``upto`` are durable: discard and then reuse what they freed.

        The discard (TRIM / hole punch) must finish before the extent returns to
        the allocator, or it could punch a hole into the next block written there.
        """
        self._durable = max(self._durable, upto)
        ready = [(off, n) for at, off, n in self._pending_frees if at <= upto]
        if not ready:
            return
        self._pending_frees = [f for f in self._pending_frees if f[0] > upto]
        try:
            await self.device.run(self._discard_all, ready)
        finally:
            for off, nbytes in ready:
                self.allocator.free(off, nbytes)

    def _discard_all(self, extents):
        for off, nbytes in _coalesce(extents):
            try:
                self.device.discard_sync(off, nbytes)
            except KvfsError as exc:
                log.warning("discard failed: %s", exc)

    def statistics(self):
        return StoreStatistics(self.generation, self._journal_cursor, self.sb.journal_len,
                               self._frame_seq, self._commits, self._checkpoints,
                               len(self._pending), self.sb.data_len, self.allocator.free_bytes,
                               self.pending_free_bytes)


def _coalesce(extents):
    merged = []
    for off, n in sorted(extents):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1][1] += n
        else:
            merged.append([off, n])
    return merged


def read_superblock(device):
    """Decode the primary superblock, naming the backup if only that one is good."""
    if device.size < fmt.MIN_DEVICE_SIZE:
        raise FormatError(f"{device.path}: {device.size} bytes is too small to hold kvfs")
    head = device.pread_sync(0, 2 * fmt.SECTOR)
    try:
        sb = fmt.Superblock.decode(head[:fmt.SECTOR])
    except FormatError as primary_error:
        try:
            fmt.Superblock.decode(head[fmt.SECTOR:])
        except FormatError:
            raise primary_error from None
        raise FormatError(f"{primary_error}; the backup superblock is intact: "
                          f"run fsck.kvfs --repair to restore it") from None
    if device.size < sb.device_size:
        raise FormatError(f"{device.path} is {device.size} bytes but the filesystem was made for "
                          f"{sb.device_size}: the device is truncated")
    return sb


def format_device(device, block_size, now_ns):
    """Write a fresh, empty filesystem (mkfs). Returns the superblock."""
    sb = fmt.Superblock.create(device.size, block_size, now_ns)
    empty = msgpack.packb({})
    zero = b"\0" * fmt.SECTOR
    for off in (sb.checkpoint_b_off, sb.journal_off):
        device.pwrite_sync(off, zero)
    device.pwrite_sync(sb.checkpoint_a_off, fmt.encode_checkpoint_header(1, empty, sb.hash_seed) + empty)
    device.sync_sync()
    # Superblocks last: until they are written the device is not a kvfs.
    device.pwrite_sync(0, sb.encode() + sb.encode())
    device.sync_sync()
    device.discard_sync(sb.data_off, sb.data_len)
    reserve_metadata_space(device, sb)
    return sb


def reserve_metadata_space(device, sb):
    """Back the checkpoint slots and the journal with real host space (file-backed stores)."""
    device.preallocate_sync(sb.checkpoint_a_off, sb.data_off - sb.checkpoint_a_off)
