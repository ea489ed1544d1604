"""Sealing files and driving durability: content records, commits, checkpoints, upkeep.

The namespace drives every commit and checkpoint, under one lock, so a
checkpoint's snapshot is always taken with no commit in flight. It journals
through ``self.journal``, the journal port (kvfs/schema/port.py) the assembler
wires to the block index, not through the block cache. The layers below only
say when they need a commit: the block index raises SpaceAwaitsCommit when
frees waiting for a commit would make room (it reaches the namespace through
the cache's write or truncate, and the commit goes straight to the port), and
the store raises JournalFull when the journal must be folded into a checkpoint.
"""
import logging
import time

import trio

from .. import schema
from ..base.crashpoints import stallpoint
from ..base.gcpolicy import collections_paused, release_off_loop
from ..base.gilpolicy import loop_first
from ..errors import Fenced, JournalFull, KvfsError, NoSpace, SpaceAwaitsCommit
from ..schema.port import JournalPort
from .inodes import Inode

log = logging.getLogger(__name__)

SPACE_RETRIES = 3            # commits tried to make room for one write (frees are then reusable)


class Durability:
    """Mixed into :class:`~kvfs.namespace.Namespace`, which holds the state (see its __init__)."""

    journal: JournalPort        # handed in by the assembler (kvfs/server/stack.py): the block index

    # -- records ------------------------------------------------------------
    def _emit(self, record):
        # Append first: extents freed while applying are then tagged with this
        # record, so they are not reused before it is durable. Records are
        # validated before they are built; a failure to apply one is a bug.
        self.journal.append_record(record)
        try:
            self.tree.apply(record)
        except Exception:
            log.critical("record %s was journaled but does not apply", type(record).__name__)
            raise

    async def commit(self) -> None:
        """Make every record so far durable: a journal frame, or a checkpoint when the journal is full."""
        async with self._durability_lock:
            try:
                await self.journal.commit()
            except JournalFull:
                await self._checkpoint_locked()

    async def checkpoint(self) -> None:
        """Write the whole state as a checkpoint (which empties the journal)."""
        async with self._durability_lock:
            stallpoint("checkpoint")
            await self._checkpoint_locked()

    async def checkpoint_unless_folded(self) -> bool:
        """The unmount's checkpoint; skipped (False) when the journal holds no record since
        the last one, which then already says all that a new one would.

        Why: at a million files a checkpoint takes seconds, and an unmount after
        ``kvfs-admin checkpoint``, or after nothing but reads, used to write the
        same state again. What only a checkpoint records (pins) is checkpointed
        when it changes (Admin.pin), so an empty journal means nothing is owed.
        """
        async with self._durability_lock:
            try:
                await self.journal.commit()
            except JournalFull:
                pass
            if self.journal.journal_fill == 0:
                log.info("the journal is empty: the last checkpoint stands, none written")
                return False
            await self._checkpoint_locked()
            return True

    async def _checkpoint_locked(self):
        # Both ways in (checkpoint(), and a commit that found the journal full)
        # come here: its rows would make every full collection long, and the
        # threads that build them must give the loop the GIL back quickly.
        with collections_paused(), loop_first():
            await self._checkpoint_cuts()

    async def _checkpoint_cuts(self):
        # The cuts of the tree, the block index and the store are taken together,
        # with no await between them: the checkpoint holds exactly the records
        # appended so far. The rows are built from the cuts off the event loop
        # (kvfs/namespace/cut.py), while operations go on, and each is packed
        # into the payload as it is made (kvfs/schema/writer.py).
        started = time.perf_counter()
        tree_cut = self.tree.cut()
        try:
            cuts = self.journal.cut()
        except BaseException:
            self.tree.end_cut()
            raise
        held_ms = (time.perf_counter() - started) * 1000
        try:
            writer = schema.CheckpointWriter(self.journal.checkpoint_capacity())
            try:
                # The lists of inode and block objects are taken in later loop steps of
                # their own (the cuts cover what changes before them), so that requests
                # queued meanwhile run between them: each list alone is 13-20 ms at a
                # million objects on a small VM, 40-70 ms together with the cut.
                for list_step in (tree_cut.list_inodes, lambda: self.journal.list_cut(cuts)):
                    await trio.sleep(0)
                    step_started = time.perf_counter()
                    list_step()
                    held_ms = max(held_ms, (time.perf_counter() - step_started) * 1000)
                self._checkpoint_stats["cut_ms_max"] = max(self._checkpoint_stats["cut_ms_max"], held_ms)
                await trio.to_thread.run_sync(tree_cut.write, writer, limiter=self._cut_limiter)
            finally:
                self.tree.end_cut()
                cut_stats = tree_cut.statistics()
                self._checkpoint_stats["rows_built_off_loop"] += cut_stats.rows_built_off_loop
                self._checkpoint_stats["rows_saved_on_loop"] += cut_stats.rows_saved_on_loop
                await release_off_loop(tree_cut.inodes, limiter=self._cut_limiter)
            await self.journal.write_checkpoint(cuts, writer)
        finally:
            self.journal.end_cut()
        self._checkpoint_stats["last_ms"] = (time.perf_counter() - started) * 1000

    async def _with_space(self, operation):
        """Run ``operation()``; when the space it needs awaits a commit, commit and retry;
        when there is none, wait for eviction to make room (back-pressure) and retry.
        ENOSPC only when nothing more can be evicted."""
        for _ in range(SPACE_RETRIES):
            try:
                return await operation()
            except SpaceAwaitsCommit:
                await self.commit()
            except NoSpace:
                if not await self.evictor.make_room(self.cache.block_size):
                    raise
        return await operation()

    # -- sealing ------------------------------------------------------------
    # content_dirty is set only by _mark_unsealed, so the seal scans visit the
    # files it names instead of every inode: at a million files a scan of all
    # of them held the event loop about 0.1 s, every commit_interval.
    def _content_changed(self, inode, now):
        if self.content_watcher is not None:
            self.content_watcher(inode.ino)    # before the change is answered: see pagecache.py
        self.tree.preserve(inode)              # a checkpoint being built keeps the old times
        self._mark_unsealed(inode)
        inode.content_version += 1
        inode.mtime = inode.ctime = now

    def _mark_unsealed(self, inode):
        inode.content_dirty = True
        self._unsealed[inode.ino] = inode

    def _unsealed_files(self):
        """The live files whose content differs from its durable record (others leave the table)."""
        live = []
        for ino, inode in list(self._unsealed.items()):
            if inode.content_dirty and self.tree.inodes.get(ino) is inode:
                live.append(inode)
            else:
                del self._unsealed[ino]
        return live

    def _schedule_seal(self, inode):
        if inode.content_dirty and self._nursery is not None:
            self._nursery.start_soon(self._seal_quietly, inode)

    async def _seal_quietly(self, inode):
        if inode.sealing:
            return
        inode.sealing = True
        try:
            await self.seal(inode)
        except KvfsError as exc:
            log.error("inode %d: writing back its content failed: %s", inode.ino, exc)
        finally:
            inode.sealing = False

    async def seal(self, inode: Inode, force: bool = False) -> None:
        """Flush a file's blocks and record its content (once no writer has it open).

        With ``force`` (fsync, flush) the content is recorded even while writers
        keep the file open.
        """
        with self.idle.holding(inode):      # a concurrent seal must not drop the live content (idle.py)
            while inode.content_dirty and inode.ino in self.tree.inodes:
                if inode.writers and not force:
                    return
                await self.cache.flush_file(inode.data)
                if inode.writers and not force:
                    # Reopened for writing while we flushed: the content now holds
                    # writes that no close or fsync has finished. Its last close seals it.
                    return
                if inode.data.dirty_count == 0 and inode.ino in self.tree.inodes and inode.content_dirty:
                    self._record_content(inode)

    def _record_content(self, inode):
        filedata = inode.data
        keys = filedata.keys()
        while keys and keys[-1] is None:
            keys.pop()                     # trailing holes are implied by the size
        inode.content_dirty = False
        self._unsealed.pop(inode.ino, None)
        if filedata.size == inode.size_committed and tuple(keys) == inode.committed and not inode.provisional:
            # Rewritten with identical bytes (LMCache after a restart): nothing
            # changed on the device, so nothing is written, not even a record.
            return
        blocks = tuple(None if k is None else self.journal.block_ref(k) for k in keys)
        self._emit(schema.Content(inode.ino, filedata.size, inode.mtime, inode.ctime, blocks))
        self.evictor.sealed(inode)
        if self.evictor.over_high_watermark():
            self._space_wanted.set()

    # -- whole-filesystem operations -----------------------------------------
    async def flush_all(self) -> None:
        """Make everything durable: blocks, contents (open files too) and the journal."""
        await self.cache.flush_all()
        for inode in self._unsealed_files():
            try:
                await self.seal(inode, force=True)
            except KvfsError as exc:
                log.error("inode %d: flush failed: %s", inode.ino, exc)
        await self.commit()

    async def run(self, commit_interval: float, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background upkeep: seal idle files, commit the journal, checkpoint when it fills."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._evict_when_full, commit_interval)
            task_status.started()
            while True:
                await trio.sleep(commit_interval)
                for inode in self._unsealed_files():
                    if not inode.writers and not inode.sealing and not inode.data.failed:
                        self._schedule_seal(inode)
                try:
                    await self.commit()
                    if self.journal.journal_fill > 0.5:
                        await self.checkpoint()
                except Fenced:
                    pass            # logged once, CRITICAL, by the store; nothing can be written now
                except KvfsError as exc:
                    # The device refused (EIO, or ENOSPC from the host below a
                    # sparse store). The records stay queued and the next round
                    # retries; fsync and flush report the error to their callers.
                    # The mount stays up, and the durable state is untouched.
                    log.error("committing metadata failed, will retry: %s", exc)

    async def _evict_when_full(self, interval):
        """Keep used space under the high watermark: woken by a seal that crossed it, or every interval."""
        while True:
            with trio.move_on_after(interval):
                await self._space_wanted.wait()
            self._space_wanted = trio.Event()
            if self.evictor.over_high_watermark():
                try:
                    await self.evictor.make_room()
                except KvfsError as exc:
                    log.error("eviction failed, will retry: %s", exc)
