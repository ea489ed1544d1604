"""The write side of the block cache: dirty buffers, back-pressure, flush workers, truncation.

Writes land in per-block RAM buffers (:class:`Dirty`) and return at memory
speed. Flush workers hash each buffer, store it through the block index (which
skips the device write when the block already exists) and swap the buffer for
the block's key. ``dirty_limit`` bounds the dirty bytes: a writer that would
exceed it waits for the flushers (back-pressure), it never gets ENOMEM.
"""
from __future__ import annotations

import itertools
import logging

import trio

from ..base.aligned import Buffer, new_buffer
from ..base.crashpoints import crashpoint
from ..blockindex.runs import Placement, RunHint
from ..errors import DedupCollision, DeviceTimeout, KvfsError, NoSpace
from .filedata import Dirty, FileData, all_zero

log = logging.getLogger(__name__)

FLUSH_RETRIES = 3
# Small blocks (at most a quarter block: small files, the tails of large ones) are
# flushed in batches of up to BATCH_BLOCKS blocks and BATCH_BYTES bytes: one hashing
# hand-off and one device call for the batch (BlockIndex.store_blocks).
SMALL_FRACTION = 4
BATCH_BLOCKS = 32
BATCH_BYTES = 1 << 20
# How far a flushed block looks, either way, for blocks of its file to be placed by (_run_hint).
PLACE_SCAN_BLOCKS = 8


class WriteBack:
    """Mixed into :class:`~kvfs.blockcache.BlockCache`, which holds the state (see its __init__)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the flush workers (and prefetches) until cancelled."""
        send, recv = trio.open_memory_channel(0)     # workers pull; nothing queues unbounded
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self.flush_workers):
                nursery.start_soon(self._flush_worker, recv.clone())
            nursery.start_soon(self._dispatch, send)
            task_status.started()

    async def _dispatch(self, send):
        while True:
            while not self._ready:
                await self._ready_event.wait()
                self._ready_event = trio.Event()
            await send.send(self._ready.popleft())

    async def _flush_worker(self, recv):
        async for first in recv:
            await self._flush_batch(self._batch_from(first))

    def _batch_from(self, first):
        """``first`` alone, or, when it is a small block, with the small blocks queued after it.

        Taken when the worker starts, so batches grow while the workers are busy.
        Large blocks go one by one: each is a device request of its own, and
        several workers keep several in flight.
        """
        batch = [first]
        if first[1].used <= self.bs // SMALL_FRACTION:
            room = BATCH_BYTES - first[1].used
            while (self._ready and len(batch) < BATCH_BLOCKS
                   and self._ready[0][1].used <= min(room, self.bs // SMALL_FRACTION)):
                batch.append(self._ready.popleft())
                room -= batch[-1][1].used
        self._s["flush_batches"] += 1
        self._s["flush_batch_max"] = max(self._s["flush_batch_max"], len(batch))
        return batch

    async def write(self, filedata: FileData, off: int, data: Buffer) -> None:
        if filedata.failed:
            raise filedata.failed("file data was lost: its flush to the device failed")
        bs = self.bs
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            idx, inner = divmod(off + pos, bs)
            n = min(bs - inner, len(view) - pos)
            if self._is_hole(filedata, idx) and all_zero(view[pos:pos + n]):
                pos += n                         # zeros into a hole (posix_fallocate's fallback): store nothing
                continue
            whole = inner == 0 and (n == bs or off + pos + n >= filedata.size)
            d = await self._dirty_block(filedata, idx, need_base=not whole, covers_block=n == bs)
            d.buf[inner:inner + n] = view[pos:pos + n]
            d.used = max(d.used, inner + n)
            d.version += 1
            pos += n
            if off + pos > filedata.size:
                filedata.size = off + pos
            if inner + n == bs:
                self._enqueue(filedata, d)             # a full block: nothing more will land in it soon
        if off + len(view) > filedata.size:
            filedata.size = off + len(view)            # zeros written past the end into a hole
        self._s["bytes_written"] += len(view)
        self._s["write_requests"] += 1

    @staticmethod
    def _is_hole(filedata, idx):
        return idx >= len(filedata.blocks) or filedata.blocks[idx] is None

    async def _dirty_block(self, filedata, idx, need_base, covers_block=False):
        """The Dirty buffer for block ``idx``, created (with its old bytes) if needed."""
        while True:
            current = filedata.blocks[idx] if idx < len(filedata.blocks) else None
            if isinstance(current, Dirty):
                return current
            await self._admit()
            current = filedata.blocks[idx] if idx < len(filedata.blocks) else None
            if isinstance(current, Dirty):       # another writer made it while we waited
                self._unadmit()
                return current
            base = None
            if need_base and current is not None:
                try:
                    base = await self.get(current)
                except BaseException:
                    self._unadmit()
                    raise
                if (filedata.blocks[idx] if idx < len(filedata.blocks) else None) is not current:
                    self._unadmit()
                    continue
            # A block the write covers whole is overwritten at once: its buffer
            # need not be zeroed, and counts as used through its end.
            d = Dirty(self._new_buffer(zeroed=not covers_block), used=self.bs if covers_block else 0)
            if base is not None:
                d.buf[:len(base)] = base
                d.used = max(d.used, len(base))
            if idx >= len(filedata.blocks):
                filedata.blocks.extend([None] * (idx + 1 - len(filedata.blocks)))
            filedata.blocks[idx] = d
            if current is not None:
                self.index.unpin(current)
            self._dirty[id(d)] = (filedata, d)
            filedata.dirty_count += 1
            return d

    async def _admit(self):
        """Wait for room under dirty_limit and reserve device space for one block."""
        if self.dirty_bytes + self.bs > self.dirty_limit:
            self._s["throttled"] += 1
            while self.dirty_bytes + self.bs > self.dirty_limit:
                self._flush_oldest()
                await self._dirty_freed.wait()
                crashpoint("flush-backpressure")
        self.dirty_bytes += self.bs
        self._s["dirty_max"] = max(self._s["dirty_max"], self.dirty_bytes)
        while True:
            try:
                await self.index.reserve(self.bs)
                return
            except KvfsError:
                if len(self._dirty) == 0 or not self._flush_pending():
                    self._unadmit(reserved=False)
                    raise
                # Flushes in flight may dedup and hand back their reservations.
                await self._dirty_freed.wait()
                crashpoint("flush-backpressure")

    def _flush_pending(self):
        self._flush_oldest()
        return bool(self._ready) or any(d.queued for _, d in self._dirty.values())

    def _unadmit(self, reserved=True):
        self.dirty_bytes -= self.bs
        if reserved:
            self.index.unreserve(self.bs)
        self._wake_writers()

    def _wake_writers(self):
        self._dirty_freed.set()
        self._dirty_freed = trio.Event()

    def _flush_oldest(self):
        """Under pressure, queue the oldest dirty blocks even if they are not full."""
        budget = max(2 * self.flush_workers, 4)
        # islice, not list(...)[:budget]: a writer under pressure calls this on
        # every wake-up, and copying all ~1,500 dirty entries each time was 5%
        # of the event loop on a small-file create workload (py-spy).
        for filedata, d in list(itertools.islice(self._dirty.values(), budget)):
            self._enqueue(filedata, d)

    def _enqueue(self, filedata, d):
        if not d.queued:
            d.queued = True
            self._ready.append((filedata, d))
            self._ready_event.set()

    def _new_buffer(self, zeroed):
        """A block buffer; recycled ones are already faulted in.

        A write that covers the whole block overwrites every byte, so only
        partial writes need the recycled buffer zeroed.
        """
        if self._spare:
            # Only the front that its last block used can hold bytes: zeroing
            # the whole 1 MiB for every small file cost more than its write.
            buf, used = self._spare.pop()
            if zeroed and used:
                buf[:used] = self._zero_block[:used]
            return buf
        # Page aligned, so the device can write it with O_DIRECT without a copy.
        # A write of the whole block touches every page at once: populate them
        # in one call. A partial one (a small file, the head or tail of a
        # large write) gets its pages as it touches them: a 4 KiB file held a
        # whole resident 1 MiB buffer until its flush, so 1,500 small files in
        # flight (the default dirty_limit) were 1.5 GiB of RSS.
        return new_buffer(self.bs, populate=not zeroed)

    def _retire(self, filedata, d):
        """``d`` has left ``filedata.blocks``: give back its memory and reservation."""
        if len(self._spare) < self._spare_max:
            self._spare.append((d.buf, d.used))    # zeros from d.used on
        d.buf = None
        del self._dirty[id(d)]
        filedata.dirty_count -= 1
        if filedata.progress is not None:
            filedata.progress.set()
            filedata.progress = None
        self._unadmit()

    async def _flush_batch(self, batch):
        # ``d.queued`` stays set while we work, so a block is not flushed twice at once.
        jobs = []
        for filedata, d in batch:
            try:
                idx = filedata.blocks.index(d)
            except ValueError:
                d.queued = False
                continue                             # truncated away or already retired
            length = min(self.bs, filedata.size - idx * self.bs)
            # Hash and write straight from the buffer, without a snapshot copy. A
            # write that lands meanwhile bumps d.version, and the result is then
            # discarded in _flushed, so a torn buffer is never named by a key.
            jobs.append((filedata, d, idx, length, d.version, memoryview(d.buf)[:length]))
        stored = [job for job in jobs if not all_zero(job[5])]
        outcomes = await self.index.store_blocks([(view, d.buf, filedata.domain)
                                                  for filedata, d, _, _, _, view in stored],
                                                 [self._run_hint(filedata, idx, d)
                                                  for filedata, d, idx, _, _, _ in stored]) if stored else []
        key_of = {id(job): outcome for job, outcome in zip(stored, outcomes)}
        retry = []
        for job in jobs:
            outcome = key_of.get(id(job))
            if isinstance(outcome, KvfsError):
                if self._flush_failed(job[0], job[1], outcome):
                    retry.append(job)
            else:
                self._flushed(*job, outcome)
        if retry:
            await trio.sleep(0.2 * max(d.attempts for _, d, *_ in retry))
            for filedata, d, *_ in retry:
                self._enqueue(filedata, d)

    def _run_hint(self, filedata, idx, d):
        """Block ``idx``'s neighbours in its file, so that the index places it by them (RunHint):
        flush workers hash in parallel, so block 5 may get its extent before block 4."""
        blocks = filedata.blocks
        before = range(idx - 1, max(idx - PLACE_SCAN_BLOCKS, 0) - 1, -1)
        after = range(idx + 1, min(idx + PLACE_SCAN_BLOCKS, len(blocks)))
        return RunHint(d.placement, self._placements(blocks, before), self._placements(blocks, after))

    def _placements(self, blocks, indices):
        """The placements of ``blocks[indices]`` up to the first that is not being written:
        a stored block (known place: the last one that matters) or a hole (none)."""
        out = []
        for j in indices:
            entry = blocks[j]
            if isinstance(entry, Dirty):
                out.append(entry.placement)
                continue
            if isinstance(entry, bytes):
                at = self.index.extent_off(entry)
                if at is not None:
                    out.append(Placement(at))
            break
        return out

    def _flush_failed(self, filedata, d, exc):
        """Count a failed flush of ``d``; True if it is worth trying again."""
        d.attempts += 1
        d.queued = False
        log.error("flushing a block failed (attempt %d): %s", d.attempts, exc)
        # No space, or a dedup hit on other bytes: trying again cannot help. A device
        # that did not answer within io_timeout (its own retries included) would only
        # hold the writer's fsync for another io_timeout.
        if d.attempts >= FLUSH_RETRIES or isinstance(exc, (NoSpace, DedupCollision, DeviceTimeout)):
            self._fail_file(filedata, type(exc))
            return False
        return True

    def _flushed(self, filedata, d, idx, length, version, view, key):
        """``d`` (at ``idx``, ``length`` bytes at ``version``) is stored as ``key`` (None: zeros)."""
        d.queued = False
        still_current = (idx < len(filedata.blocks) and filedata.blocks[idx] is d and d.version == version
                         and min(self.bs, filedata.size - idx * self.bs) == length)
        if not still_current:
            if key is not None:
                self.index.unpin(key)                # superseded while we wrote it
            if d in filedata.blocks:
                self._enqueue(filedata, d)                 # someone asked for it: flush the new version
            return
        # Freshly written blocks are not copied into the clean cache: the copy
        # into new memory cost more than the rare read-back from the device.
        view.release()
        filedata.blocks[idx] = key
        self._retire(filedata, d)
        self._s["flushed"] += 1
        if key is None:
            self._s["zero_blocks"] += 1

    def _fail_file(self, filedata, err):
        """A block cannot be stored: the file's new content is lost, and reads say so."""
        filedata.failed = err
        for idx, entry in enumerate(filedata.blocks):
            if isinstance(entry, Dirty):
                filedata.blocks[idx] = None
                self._retire(filedata, entry)

    async def flush_file(self, filedata: FileData) -> None:
        """Return once every block of ``filedata`` written so far is stored."""
        while filedata.dirty_count:
            for entry in filedata.blocks:
                if isinstance(entry, Dirty):
                    self._enqueue(filedata, entry)
            if filedata.progress is None:
                filedata.progress = trio.Event()
            await filedata.progress.wait()
        if filedata.failed:
            raise filedata.failed("flushing the file to the device failed")

    async def flush_all(self) -> None:
        files = {id(filedata): filedata for filedata, _ in self._dirty.values()}
        async with trio.open_nursery() as nursery:
            for filedata in files.values():
                nursery.start_soon(self._flush_quietly, filedata)

    async def _flush_quietly(self, filedata):
        try:
            await self.flush_file(filedata)
        except KvfsError as exc:
            log.error("flush failed: %s", exc)

    # -- content changes ----------------------------------------------------
    async def truncate(self, filedata: FileData, size: int) -> None:
        bs = self.bs
        if size < filedata.size and size % bs:
            idx = size // bs
            if not self._is_hole(filedata, idx):
                d = await self._dirty_block(filedata, idx, need_base=True)
                d.buf[size % bs:] = bytes(bs - size % bs)
                d.version += 1
        keep = (size + bs - 1) // bs
        for entry in filedata.blocks[keep:]:
            self._drop_entry(filedata, entry)
        del filedata.blocks[keep:]
        filedata.size = size
        if size == 0:
            filedata.failed = None                 # nothing of the lost content remains
        filedata.prefetched_upto = min(filedata.prefetched_upto, keep)

    def _drop_entry(self, filedata, entry):
        if isinstance(entry, Dirty):
            self._retire(filedata, entry)
        elif entry is not None:
            self.index.unpin(entry)

    def release(self, filedata: FileData) -> None:
        """The file is gone or emptied: drop its dirty buffers and unpin its blocks.

        An emptied file (O_TRUNC) has lost nothing, so a failed flush of its
        earlier content no longer makes it unreadable.
        """
        for entry in filedata.blocks:
            self._drop_entry(filedata, entry)
        filedata.blocks = []
        filedata.size = 0
        filedata.failed = None

    def snapshot(self, filedata: FileData) -> FileData:
        """A read-only copy of ``filedata`` as it is now, for :meth:`read`: its stored
        blocks pinned again, its dirty bytes copied (the copies are never flushed).
        Give it back with :meth:`release_snapshot`."""
        snap = FileData(filedata.size, domain=filedata.domain)
        for entry in filedata.blocks:
            if isinstance(entry, Dirty):
                entry = Dirty(bytes(entry.buf))
            elif entry is not None:
                self.index.pin(entry)
            snap.blocks.append(entry)
        snap.failed = filedata.failed
        snap.prefetched_upto = len(snap.blocks)       # readers of it prefetch nothing
        return snap

    def release_snapshot(self, snap: FileData) -> None:
        for entry in snap.blocks:
            if isinstance(entry, bytes):
                self.index.unpin(entry)
        snap.blocks, snap.size = [], 0

    def attach(self, filedata: FileData) -> None:
        """Pin the stored blocks of a FileData built from durable state."""
        for entry in filedata.blocks:
            if entry is not None:
                self.index.pin(entry)

    def detach(self, filedata: FileData) -> None:
        """Unpin what :meth:`attach` pinned, leaving ``filedata`` as it is (its
        stored blocks must stay alive through their refs)."""
        for entry in filedata.blocks:
            if entry is not None:
                self.index.unpin(entry)
