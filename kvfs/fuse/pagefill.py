"""Fill the kernel's page cache of a file before its open is answered (FUSE_NOTIFY_STORE).

Part of the FUSE layer: kvfs/fuse/ops.py calls it from its open handler.

Why. A cold buffered read() of a chunk file goes through the kernel's
readahead: 1 MiB READ requests, each answered by pyfuse3 on its one event-loop
thread, which copies the reply into freshly allocated 4 KiB page-cache pages
while it holds the GIL. That copy was most of the loop's time and the limit of
a cold buffered read (docs/benchmarks.md). FUSE_NOTIFY_STORE makes the same
copy in whichever thread writes the notification: here worker threads, in
parallel, while the loop serves other requests. The reader's read() then finds
the pages cached and sends no READ at all.

When. A cold read-only open, not O_DIRECT, of a file nobody writes
(Namespace.page_fill_size): the open's prefetch is already reading its blocks;
each block, once read and verified, goes to the kernel from a worker thread,
and the open is answered once all are in. Blocks not read within FILL_WAIT_S,
or that fail (a corrupt block), are left out: the reader's READs fetch them
as before, and get EIO for a corrupt one. An open that the namespace answers
without keep_cache would make the kernel drop the pages again
(fuse_finish_open), so such an open first drops them itself, as the kernel
would have (KernelPageDropper.drop_file), and is then answered with keep_cache.

Never stale. A store writes its bytes over whatever page the kernel holds (and
extends the kernel's file size if it reaches past it). So no fill of a file
may be running when its content changes: the FUSE layer runs every request
that can change content without an open writer, an open for writing or with
O_TRUNC and a setattr of the size, inside :meth:`PageFiller.fenced`, which
refuses new fills of that inode and waits for the running ones to end. Writes
come only through descriptors opened so, and no fill starts while the file has
a writer. A store that was started always finishes (it is never abandoned), so
a fence that returned has no store of the old bytes behind it.

The message is the kernel's ABI (include/uapi/linux/fuse.h, since Linux 2.6.36),
written to /dev/fuse in one writev()::

    struct fuse_out_header       { u32 len; s32 error; u64 unique; }   unique 0, error = the code
    struct fuse_notify_store_out { u64 nodeid; u64 offset; u32 size; u32 padding; }
    the bytes
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import struct
from typing import Any, AsyncIterator, Awaitable, Callable, ContextManager, Optional

import trio

from ..base.aligned import Buffer
from ..errors import KvfsError
from .pagedrops import KernelPageDropper

log = logging.getLogger(__name__)

FUSE_NOTIFY_STORE = 4
_OUT_HEADER = struct.Struct("<IiQ")
_STORE = struct.Struct("<QQII")
assert _OUT_HEADER.size == 16 and _STORE.size == 24
FILL_THREADS = 8          # stores at once: the kernel's copy runs in these threads
# An open waits this long at most for its blocks: a healthy device reads 128 MiB
# well within it, and a failing one must not delay the reader's own EIO (its READs
# then wait for the same prefetch reads the fill waited for).
FILL_WAIT_S = 0.5
FILL_MOST = 128 << 20     # bytes filled per open at most; readahead serves the rest


@dataclasses.dataclass(frozen=True)
class PageFillStatistics:
    page_fills: int                 # opens whose file was placed in the kernel's page cache
    page_fill_bytes: int            # bytes stored into the kernel's page cache
    page_fill_blocks_skipped: int   # blocks left to readahead: not read in time, or failed
    page_fill_stores_refused: int   # stores the kernel refused (logged)
    page_fill_fence_waits: int      # content changes that waited for a running fill


class PageFiller:
    """Stores file pages into the kernel for the FUSE connection on ``fd`` (the daemon's /dev/fuse)."""

    def __init__(self, fd: int, dropper: KernelPageDropper, block_size: int) -> None:
        self.fd = fd
        self.dropper = dropper          # on the same connection
        self.block_size = block_size
        self._limiter = trio.CapacityLimiter(FILL_THREADS)
        self._running: collections.Counter[int] = collections.Counter()    # ino -> fills in progress
        self._fences: collections.Counter[int] = collections.Counter()     # ino -> fences held
        self._ended: dict[int, trio.Event] = {}    # ino -> trio.Event: its last running fill ended
        self._s: collections.Counter[str] = collections.Counter()

    async def fill(self, ino: int, size: int, read: Callable[[int, int], Awaitable[Buffer]],
                   views_held: Callable[[], ContextManager[Any]], keep_cache: bool) -> tuple[bool, bool]:
        """Store the first ``size`` bytes of ``ino`` in the kernel.

        ``read(off, n)`` returns the file's bytes (a view of the block cache's buffer,
        valid while ``views_held()`` is held); ``keep_cache`` is what the namespace
        would answer. Returns (the keep_cache to answer, whether every byte was stored).
        """
        if self._fences[ino]:
            return keep_cache, False       # its content is changing: no fill now
        self._running[ino] += 1
        try:
            if not keep_cache and not await self.dropper.drop_file(ino):
                return False, False        # the pages the open must drop are not dropped: leave it to the open
            deadline = trio.current_time() + FILL_WAIT_S
            stored = []
            with views_held():
                async with trio.open_nursery() as nursery:
                    for off in range(0, size, self.block_size):
                        nursery.start_soon(self._fill_block, ino, off, min(self.block_size, size - off),
                                           read, deadline, stored)
            self._s["fills"] += 1
            return True, sum(stored) == size
        finally:
            self._running[ino] -= 1
            if not self._running[ino]:
                del self._running[ino]
                ended = self._ended.pop(ino, None)
                if ended is not None:
                    ended.set()

    async def _fill_block(self, ino, off, length, read, deadline, stored):
        data = None
        with trio.move_on_at(deadline):
            try:
                data = await read(off, length)
            except KvfsError as exc:
                log.debug("page fill of inode %d at %d left to readahead: %s", ino, off, exc)
        if data is None or len(data) != length:
            self._s["skipped"] += 1
            return
        # Not abandoned on cancel: a fence must be able to count on every store
        # it waited for having reached the kernel already.
        refused = await trio.to_thread.run_sync(self._store, ino, off, data, limiter=self._limiter)
        if refused is None:
            self._s["bytes"] += length
            stored.append(length)
        else:
            self._s["refused"] += 1
            log.warning("the kernel refused pages of inode %d at %d: %s", ino, off, refused)

    def _store(self, ino: int, off: int, data: Buffer) -> Optional[OSError]:
        body = _STORE.pack(ino, off, len(data), 0)
        header = _OUT_HEADER.pack(_OUT_HEADER.size + len(body) + len(data), FUSE_NOTIFY_STORE, 0)
        try:
            os.writev(self.fd, [header + body, data])
        except OSError as exc:
            return exc
        return None

    @contextlib.asynccontextmanager
    async def fenced(self, ino: int) -> AsyncIterator[None]:
        """Inside, no fill of ``ino`` runs or starts: wrap a change of its content in this."""
        self._fences[ino] += 1
        try:
            if self._running.get(ino):
                self._s["fence_waits"] += 1
            while self._running.get(ino):
                ended = self._ended.setdefault(ino, trio.Event())
                await ended.wait()
            yield
        finally:
            self._fences[ino] -= 1
            if not self._fences[ino]:
                del self._fences[ino]

    def statistics(self) -> PageFillStatistics:
        s = self._s
        return PageFillStatistics(s["fills"], s["bytes"], s["skipped"], s["refused"], s["fence_waits"])
