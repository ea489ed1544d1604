"""The extent store: free-space map, journal and checkpoints on the device.

The store knows nothing about files or blocks. It hands out extents (runs of
4 KiB sectors in the data region), moves block bytes to and from them, and
makes *records* (``kvfs.schema`` records) durable: upper layers append one
record per state change, and :meth:`ExtentStore.commit` writes the pending ones
as one journal frame. When the journal has no room, ``commit`` raises
:class:`~kvfs.errors.JournalFull`; the namespace, which drives durability, then
hands down the whole state for :meth:`ExtentStore.checkpoint`, which empties the
journal. Nothing here calls back up.

Freed extents are not reused until the record that freed them is durable:
otherwise a crash could leave a durable record pointing at an extent that
already holds someone else's data.

Multi-mount protection (``kvfs.store.mmp``): opened with ``mmp`` settings, the
store claims the device's MMP record before it loads anything, and the daemon
runs :meth:`ExtentStore.keep_heartbeat`. When the heartbeat finds another owner,
or cannot be written, the store fences its device: from then on every write,
commit and checkpoint fails with :class:`~kvfs.errors.Fenced` (EROFS).

Device calls the device never answered (io_timeout, kvfs/device/calls.py) may still
land later. So an extent is given back to the allocator only once no abandoned call
can still write to it, and a journal or checkpoint call that was abandoned stops
all writes (:class:`~kvfs.errors.DeviceFailed`, EIO): a later frame or slot written
now could be overwritten by the late one.
"""
import dataclasses
import logging
from typing import Any, Callable, Sequence

import msgpack
import trio

from .. import schema
from ..base.aligned import Buffer, WritableBuffer
from ..base.crashpoints import crashpoint, die, reached
from ..device.port import DevicePort
from ..device.verified import BlockCheck, KeyedHash, read_block_verified_sync, read_run_verified_sync  # noqa: F401 (BlockCheck: for the index)
from ..errors import Busy, DeviceFailed, Fenced, FormatError, InternalError, JournalFull, KvfsError, NoSpace
from . import mmp as mmp_protocol
from .allocator import Allocator, Extent
from .loader import Loaded, load, read_superblock
from .mkfs import reserve_metadata_space
from .mmp import MmpSettings
from .opening import claim_and_load, probe_mountable, release_quietly as _release_quietly
from .port import Record, StoreCut

__all__ = ["Allocator", "ExtentStore", "MmpSettings", "StoreStatistics", "probe_mountable", "read_superblock"]

log = logging.getLogger(__name__)


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

    def __init__(self, device: DevicePort, loaded: Loaded) -> None:
        self.device = device
        self.sb = loaded.sb
        state = loaded.state
        try:
            self.allocator = Allocator(self.sb.data_off, self.sb.data_len, state.free, slot=self.sb.block_size)
        except FormatError as exc:
            raise FormatError(f"the checkpoint's free-space map is corrupt ({exc})") from None
        self.generation = loaded.generation
        self._active_slot = loaded.active_slot    # slot index holding the newest checkpoint
        self._journal_cursor = loaded.journal_cursor   # bytes of journal used in this generation
        self._frame_seq = loaded.frame_seq
        self._pending: list[Record] = []    # records appended, not yet durable (the newest last)
        self._appended = 0              # records appended since mount (monotonic)
        self._durable = 0               # of those, how many are durable
        self._pending_frees: list[tuple[int, int, int]] = []    # (appended-count, off, nbytes) awaiting durability
        self._releasing: set[Extent] = set()    # (off, nbytes) free once abandoned device calls finish
        self._encode_limiter = trio.CapacityLimiter(1)   # checkpoint encoding, off the event loop
        self.replaying = True           # frees take effect at once during replay
        self._commit_lock = trio.Lock()
        self._commits = self._checkpoints = 0
        self.loaded: Loaded | None = loaded     # what mount replays; dropped by finish_replay
        self.mmp: mmp_protocol.MmpGuard | None = None       # the claimed MMP record, if any
        self.mmp_note = "not used"      # what multi-mount protection does here, for stats

    @classmethod
    def open(cls, device: DevicePort, *, salvage: bool = False, mmp: MmpSettings | None = None,
             claim: bool = True) -> "ExtentStore":
        """Load the store on ``device`` (synchronously); see :func:`kvfs.store.loader.load`.

        ``mmp`` (MmpSettings): first claim the MMP record (``claim``), or only
        check that no live owner holds it (``claim=False``: a read-only look, as
        mount.kvfs takes before it starts the daemon). Either raises Busy naming
        a live owner. A format version 1 store has no MMP sector: a warning."""
        return cls.open_and_build(device, salvage=salvage, mmp=mmp, claim=claim)[0]

    @classmethod
    def open_and_build(cls, device: DevicePort, *, salvage: bool = False, mmp: MmpSettings | None = None,
                       claim: bool = True, then: Callable[["ExtentStore"], Any] | None = None,
                       stream_inodes: bool = False) -> tuple["ExtentStore", Any]:
        """(store, then(store)): :meth:`open`, and ``then`` (what the caller builds on the loaded store,
        writing nothing) runs while the claim waits. ``stream_inodes``: see loader.load."""
        def build(loaded, then=then or (lambda store: None)):
            return (store := cls(device, loaded)), then(store)
        guard, note = None, "not used"
        if mmp is not None:
            sb = read_superblock(device)
            if not sb.has_mmp:
                note = "off (format version 1 store)"
                if claim:               # the mount itself says so, once, in its log
                    log.warning("%s: multi-mount protection needs a format version 2 store; this one "
                                "is version %d, mounted without it: never attach it to two hosts at once",
                                device.path, sb.version)
            elif claim:         # the load runs while the claim waits (kvfs/store/opening.py)
                (store, built), guard = claim_and_load(device, sb, mmp, salvage=salvage, prepare=build,
                                                       stream_inodes=stream_inodes)
                note = "owner"
            else:
                mmp_protocol.probe(device, sb, mmp)
        if guard is None:
            store, built = build(load(device, salvage=salvage, stream_inodes=stream_inodes))
        store.mmp, store.mmp_note = guard, note
        return store, built

    # -- multi-mount protection ---------------------------------------------
    @property
    def fenced(self) -> str | None:
        """Why writes are stopped (another host owns the store), or None."""
        return self.device.fenced

    def check_writable(self) -> None:
        if self.device.fenced:
            raise self.device.fence_error(f"the store accepts no writes: {self.device.fenced}")

    def fence(self, reason: str, error: type[Exception] = Fenced) -> None:
        """Stop every write to the device, at once and for good (another host may own it, or
        ``error`` DeviceFailed: a metadata write went unanswered)."""
        if self.device.fenced:
            return
        self.device.fence(reason, error)
        log.critical("%s: %s; stopped writing to the device: every write, fsync and metadata change "
                     "now fails with %s, reads of stored data go on. Unmount this mount; what it had "
                     "not yet written is lost", self.device.path, reason,
                     "EIO" if error is DeviceFailed else "EROFS")

    async def _metadata_io(self, fn, *args):
        """A journal or checkpoint device call; left running past io_timeout, it stops all writes."""
        def abandoned():
            self.fence(f"a journal or checkpoint write ({fn.__name__}) did not complete within "
                       f"{self.device.timeout:g} s (io_timeout) and may still land", DeviceFailed)
        await self.device.run(fn, *args, on_abandon=abandoned)

    async def keep_heartbeat(self) -> None:
        """The daemon's heartbeat task: one MMP heartbeat per interval until cancelled or fenced.

        From the claim until this task starts, a thread kept the heartbeat going
        (loading and replaying a large store takes longer than a grace period).
        A watchdog fences the store when the heartbeat is overdue, even while a
        heartbeat is stuck in the device (a path loss being retried).
        """
        if self.mmp is None:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._fence_when_overdue)
            try:
                await self.device.run(self.mmp.stop_background)
            except KvfsError as exc:
                self.fence(_heartbeat_failure(exc))
            while not self.fenced:
                await trio.sleep(self.mmp.interval)
                try:
                    await self.device.run(self.mmp.heartbeat_sync)
                except KvfsError as exc:
                    self.fence(_heartbeat_failure(exc))
            nursery.cancel_scope.cancel()

    async def _fence_when_overdue(self):
        limit = mmp_protocol.overdue_limit(self.mmp.interval)
        while not self.fenced:
            await trio.sleep(self.mmp.interval / 4)
            age = self.mmp.heartbeat_age()
            if age > limit:
                self.fence(f"the multi-mount protection heartbeat has not been written for {age:.2f} s "
                           f"(more than {limit:g} s), so another host may take the store over")

    def release_mmp(self) -> None:
        """Closing: give the MMP record back (CLEAN), unless fenced. Synchronous: call it once
        no task uses the store any more (after the daemon's event loop has ended)."""
        guard, self.mmp = self.mmp, None
        if guard is not None:
            if self.fenced:
                guard.stop_background(quiet=True)
            else:
                _release_quietly(guard)

    def mmp_statistics(self) -> dict[str, Any]:
        fenced = self.fenced
        failed = self.device.fence_error is DeviceFailed
        out = {"mmp": f"fenced: {fenced}" if fenced and not failed else self.mmp_note,
               "mmp_fenced": int(bool(fenced) and not failed)}
        if self.mmp is not None:
            out.update(self.mmp.statistics())
        return out

    def finish_replay(self) -> None:
        """Called once upper layers have applied the replayed records."""
        self.replaying = False
        self.loaded = None

    # -- space --------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.sb.block_size

    @property
    def hash_seed(self) -> int:
        return self.sb.hash_seed

    @property
    def key_secret(self) -> bytes:
        """The content keys' secret (b"" on a format version 1 store)."""
        return self.sb.key_secret

    @property
    def capacity_bytes(self) -> int:
        return self.sb.data_len

    def free_extents(self) -> list[Extent]:
        return self.allocator.extents()

    def free_slots(self) -> int:
        """Whole block-sized pieces of free space (see Allocator.slots)."""
        return self.allocator.slots

    def allocate(self, nbytes: int, *, follow: int | None = None, window: int = 0, lead: int = 0) -> int:
        """A free extent; ``follow``, ``window`` and ``lead`` place a file's blocks in runs (Allocator)."""
        return self.allocator.allocate(nbytes, follow=follow, window=window, lead=lead)

    def allocate_at(self, off: int, nbytes: int) -> None:
        self.allocator.allocate_at(off, nbytes)

    def release_unused(self, off: int, nbytes: int) -> None:
        """Give back an extent that no record ever named (a failed block write)."""
        self._give_back([(off, schema.align_up(nbytes))])

    def _give_back(self, extents):
        """Free ``extents`` in the allocator once no abandoned device call can still write to them
        (at once when none is left running); until then checkpoints count them free."""
        self._releasing.update(extents)

        def release():
            for off, nbytes in extents:
                self._releasing.discard((off, nbytes))
                self.allocator.free(off, nbytes)
        self.device.after_abandoned(release)

    def free(self, off: int, nbytes: int) -> None:
        """Free an extent; live frees wait until the freeing record is durable."""
        if self.replaying:
            self.allocator.free(off, nbytes)
        else:
            self._pending_frees.append((self._appended, off, schema.align_up(nbytes)))

    @property
    def pending_free_bytes(self) -> int:
        return sum(n for _, _, n in self._pending_frees)

    # -- block bytes --------------------------------------------------------
    async def write_extent(self, off: int, data: Buffer, source: Buffer | None = None) -> None:
        """Write block bytes into an allocated extent (``source``: see Device.pwrite_sync)."""
        await self.device.pwrite(off, data, source)

    async def write_extents(self, writes: Sequence[tuple]) -> list[KvfsError | None]:
        """Write several allocated extents in one device call: per write None or its KvfsError."""
        return await self.device.pwrite_each(writes)

    def read_verified_sync(self, off: int, check: BlockCheck, buf: WritableBuffer | None,
                           keyed: KeyedHash) -> memoryview | None:
        """Read one extent and check it (kvfs/device/verified.py): its view, or None. Worker thread."""
        return read_block_verified_sync(self.device, off, check, buf, keyed)

    async def read_verified(self, off: int, check: BlockCheck, buf: WritableBuffer | None,
                            keyed: KeyedHash) -> memoryview | None:
        """:meth:`read_verified_sync` in a device worker thread."""
        return await self.device.run(read_block_verified_sync, self.device, off, check, buf, keyed, writes=False)

    async def read_run_verified(self, off: int, checks: Sequence[BlockCheck], bufs: Sequence[WritableBuffer | None],
                                keyed: KeyedHash) -> list[memoryview | None]:
        """Adjacent extents from ``off``, one device call, each checked: per extent its view or None."""
        return await self.device.run(read_run_verified_sync, self.device, off, checks, bufs, keyed, writes=False)

    # -- journal ------------------------------------------------------------
    def append(self, record: Record) -> None:
        """Queue a record; it is durable once a later :meth:`commit` returns."""
        self.check_writable()
        self._pending.append(record)
        self._appended += 1

    def reserve_metadata_space(self) -> None:
        """Best effort at mount, for stores made before mkfs did this itself."""
        try:
            reserve_metadata_space(self.device, self.sb)
        except KvfsError as exc:
            log.warning("%s; a full host filesystem may then stall metadata commits", exc)

    def checkpoint_capacity(self) -> int:
        """Bytes of state one checkpoint slot holds."""
        return self.sb.checkpoint_len - schema.SECTOR

    @property
    def journal_fill(self) -> float:
        return self._journal_cursor / self.sb.journal_len

    async def commit(self) -> None:
        """Make every record appended so far durable (group commit).

        Raises JournalFull when the frame does not fit in the rest of the
        journal: the caller must write a checkpoint instead.
        """
        self.check_writable()
        target = self._appended
        async with self._commit_lock:
            if self._durable >= target:
                await self._made_durable(self._durable)     # frees that need no further record
                return
            records, upto = self._pending, self._appended
            payload = msgpack.packb([r.to_wire() for r in records])
            if self._journal_cursor + schema.frame_size(len(payload)) > self.sb.journal_len:
                raise JournalFull(f"the journal has no room for {len(records)} records")
            self._pending = []
            frame = schema.encode_journal_frame(self.generation, self._frame_seq, payload, self.sb.hash_seed)
            try:
                await self._metadata_io(self.device.sync_sync)     # block data before the records naming it
                crashpoint("commit-data-synced")
                if reached("torn-frame"):
                    await self.device.run(self._write_torn_sync, self.sb.journal_off + self._journal_cursor, frame)
                    die("torn-frame")
                await self._metadata_io(self.device.pwrite_sync, self.sb.journal_off + self._journal_cursor, frame)
                await self._metadata_io(self.device.sync_sync)
            except BaseException:
                self._pending = records + self._pending
                raise
            self._journal_cursor += len(frame)
            self._frame_seq += 1
            self._commits += 1
            await self._made_durable(upto)

    async def checkpoint(self, state: schema.CheckpointState, transient: Sequence[Extent] = ()) -> None:
        """Write ``state`` to the inactive slot and start a new journal generation.

        ``state`` (a CheckpointState without ``free``) must reflect exactly the
        records appended before this call: take it and call this without an
        await in between. ``transient`` lists extents only RAM knows about
        (pinned or in-flight blocks): free as far as the checkpoint is concerned.
        """
        cut = self.cut()
        writer = schema.CheckpointWriter(self.checkpoint_capacity())
        await trio.to_thread.run_sync(schema.write_state, writer, state, limiter=self._encode_limiter)
        await self.write_checkpoint(cut, writer, transient)

    def cut(self) -> StoreCut:
        """What a checkpoint needs of the store at this instant: cheap copies, no await."""
        return StoreCut(self._appended, self.allocator.copy_state(),
                        [(off, n) for _, off, n in self._pending_frees], list(self._releasing))

    async def write_checkpoint(self, cut: StoreCut, writer: schema.CheckpointWriter,
                               transient: Sequence[Extent] = ()) -> None:
        """Finish ``writer`` (a schema.CheckpointWriter holding the namespace and the blocks
        at ``cut``) with the free map at the cut, and write it.

        The free map is built and encoded in a worker thread: for a large
        store it takes a while, and the event loop keeps serving.
        """
        self.check_writable()
        upto = cut.appended

        def finish():
            free = Allocator(self.sb.data_off, self.sb.data_len, Allocator.extents_of(cut.free_map))
            for off, n in [*transient, *cut.pending_frees, *cut.releasing]:
                free.free(off, n)
            writer.put("free", [list(e) for e in free.extents()])
            return None if writer.overflowed else writer.finish()
        payload = await trio.to_thread.run_sync(finish, limiter=self._encode_limiter)
        if payload is None:
            raise NoSpace(f"metadata ({writer.size} bytes) exceeds the checkpoint slot "
                          f"({self.sb.checkpoint_len} bytes)")
        async with self._commit_lock:
            if self._durable > upto:
                raise InternalError("a commit overtook a checkpoint snapshot")
            # Records in the snapshot leave the queue only once the checkpoint is
            # durable; if the write fails they still go to the current journal.
            covered = len(self._pending) - (self._appended - upto)
            slot = 1 - self._active_slot
            off = (self.sb.checkpoint_a_off, self.sb.checkpoint_b_off)[slot]
            generation = self.generation + 1
            await self._metadata_io(self.device.sync_sync)
            await self._write_slot(off, generation, payload)
            self._pending = self._pending[covered:]
            self.generation, self._active_slot = generation, slot
            self._journal_cursor = self._frame_seq = 0
            self._checkpoints += 1
            await self._made_durable(upto)

    async def write_repaired(self, state: schema.CheckpointState, free: Sequence[Extent], min_generation: int) -> int:
        """fsck: write ``state`` with exactly the free map ``free``, at a generation above
        ``min_generation`` (so no leftover frame of a newer generation can replay on it).
        Returns the generation written."""
        self.allocator = Allocator(self.sb.data_off, self.sb.data_len, free, slot=self.sb.block_size)
        self._pending_frees = []
        self.generation = max(self.generation, min_generation)
        await self.checkpoint(state)
        return self.generation

    async def _write_slot(self, off, generation, payload):
        """Write a checkpoint into the slot at ``off``: the payload, and only once it is durable, the header.

        A crash during the payload write leaves the slot's old header (an older
        generation) over a half-written payload; a crash during the one-sector
        header write leaves no valid header. Either way the slot does not claim
        the new generation, so a valid header over a bad payload always means
        damage after the fact, which the loader may treat as proof that this
        generation existed.
        """
        # The writer built the payload in a page-aligned buffer: written as is.
        await self._metadata_io(self.device.pwrite_sync, off + schema.SECTOR, payload, payload.obj)
        await self._metadata_io(self.device.sync_sync)
        crashpoint("checkpoint-payload-written")
        # Its digest reads the whole payload: in a worker thread, like the encoding.
        header = await trio.to_thread.run_sync(schema.encode_checkpoint_header, generation, payload,
                                               self.sb.hash_seed, limiter=self._encode_limiter)
        await self._metadata_io(self.device.pwrite_sync, off, header)
        await self._metadata_io(self.device.sync_sync)
        crashpoint("checkpoint-header-written")

    def _write_torn_sync(self, off, frame):
        """Crash test only: the frame's first half over what the device held, made durable."""
        half = len(frame) // 2
        old = self.device.pread_sync(off, len(frame))
        self.device.pwrite_sync(off, bytes(frame[:half]) + bytes(old[half:]))
        self.device.sync_sync()

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
            crashpoint("frees-discarded")
        except KvfsError as exc:        # best effort: a discard the device never answered
            log.warning("discard failed: %s", exc)
        finally:
            self._give_back(ready)      # not before an abandoned discard has finished

    def _discard_all(self, extents):
        for off, nbytes in _coalesce(extents):
            try:
                self.device.discard_sync(off, nbytes)
            except KvfsError as exc:
                log.warning("discard failed: %s", exc)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(self.generation, self._journal_cursor, self.sb.journal_len,
                               self._frame_seq, self._commits, self._checkpoints,
                               len(self._pending), self.sb.data_len, self.allocator.free_bytes,
                               self.pending_free_bytes)


def _heartbeat_failure(exc):
    if isinstance(exc, Busy):           # the record names someone else
        return str(exc)
    return (f"the multi-mount protection heartbeat could not be written ({exc}), so another host may "
            f"take the store over")


def _coalesce(extents):
    merged = []
    for off, n in sorted(extents):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1][1] += n
        else:
            merged.append([off, n])
    return merged

