"""The read side of the block cache: the clean LRU, verified device reads, whole-file prefetch.

Reads are served from dirty buffers, then from the clean LRU, then from the
device. Opening a file for reading prefetches its blocks with up to
``read_depth`` concurrent device reads, so one large ``read()`` from the engine
turns into many parallel device reads.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
from typing import Iterator

import trio

from ..errors import KvfsError
from .filedata import Dirty, FileData

log = logging.getLogger(__name__)

PREFETCH_RUN_BLOCKS = 8          # adjacent blocks read with one device call


class ReadSide:
    """Mixed into :class:`~kvfs.blockcache.BlockCache`, which holds the state (see its __init__)."""

    async def get(self, key: bytes) -> memoryview:
        """A stored block's verified bytes, from the LRU or the device."""
        data = self._clean.get(key)
        if data is not None:
            self._clean.move_to_end(key)
            self._s["hits"] += 1
            return data
        reading = self._reading.get(key)
        if reading is not None:
            await reading.wait()
            data = self._clean.get(key)
            if data is not None:
                self._s["hits"] += 1
                return data
        self._s["misses"] += 1
        self._s["read_handoffs"] += 1
        self._s["blocks_fetched"] += 1
        self._reading[key] = done = trio.Event()
        self._s["inflight"] += 1
        self._s["inflight_max"] = max(self._s["inflight_max"], self._s["inflight"])
        try:
            data = await self.index.read_block(key, self._clean_buffer())
        finally:
            self._s["inflight"] -= 1
            # Only our own claim: when a read fails, every reader that waited for it
            # reads again, each claiming the block, so another may have replaced ours.
            if self._reading.get(key) is done:
                del self._reading[key]
            done.set()
        self._remember(key, data)
        return data

    def _remember(self, key, data):
        if key in self._clean:
            return
        self._clean[key] = data
        self._clean_bytes += len(data)
        budget = self.cache_size - self.dirty_bytes
        while self._clean_bytes > budget and self._clean:
            _, old = self._clean.popitem(last=False)
            self._clean_bytes -= len(old)
            self._recycle(old)

    def forget_clean(self, filedata: FileData) -> None:
        """``filedata``'s stored blocks leave the clean cache; their buffers are
        reused once no read() can still hold a view of them."""
        for key in filedata.blocks:
            view = self._clean.pop(key, None) if isinstance(key, bytes) else None
            if view is not None:
                self._clean_bytes -= len(view)
                self._recycle(view)

    def drop_clean(self) -> None:
        for view in self._clean.values():
            self._recycle(view)
        self._clean.clear()
        self._clean_bytes = 0

    # Clean block buffers are recycled: a fresh 1 MiB mmap per device read cost
    # 256 page faults and a page zeroing, more kernel time than the read itself.
    # Views of an evicted buffer may still be in the hands of a read() that is
    # awaiting another block, so a buffer is reused only once every read() that
    # was running when it was evicted has returned (pyfuse3 sends the reply
    # before it awaits anything else).

    def _recycle(self, view):
        buf = view.obj
        if isinstance(buf, mmap.mmap) and len(buf) == self.bs:
            self._quarantine.append((self._read_seq, buf))

    def _clean_buffer(self):
        oldest_active = min(self._active_reads, default=self._read_seq)
        while self._quarantine and self._quarantine[0][0] <= oldest_active:
            buf = self._quarantine.popleft()[1]
            if len(self._clean_spare) < self._clean_spare_max:
                self._clean_spare.append(buf)
        if self._clean_spare:
            return self._clean_spare.pop()
        # A retired dirty buffer is already faulted in, and the device read
        # overwrites all of it: a fresh one costs a page fault and a zeroing
        # per 4 KiB, more than the read (the first cold reads after writes).
        if self._spare:
            return self._spare.pop()[0]
        self._s["read_buffers_mapped"] += 1        # the device layer maps a fresh one
        return None

    async def read(self, filedata: FileData, off: int, size: int) -> bytes | memoryview:
        if filedata.failed:
            raise filedata.failed("file data was lost: its flush to the device failed")
        end = min(off + size, filedata.size)
        if off >= end:
            return b""
        bs = self.bs
        first, last = off // bs, (end - 1) // bs
        self.prefetch(filedata, first)
        with self.views_held():
            return await self._read_blocks(filedata, off, end, first, last)

    @contextlib.contextmanager
    def views_held(self) -> Iterator[None]:
        """Inside, no block buffer whose view :meth:`read` returned is reused.

        A read's reply goes out before its read() returns; someone who keeps
        the views longer (kvfs/fuse/pagefill.py sends them from threads) holds them
        in here, and evicted buffers wait in quarantine until it is left.
        """
        seq = self._read_seq
        self._read_seq += 1
        self._active_reads[seq] = None
        try:
            yield
        finally:
            del self._active_reads[seq]

    async def _read_blocks(self, filedata, off, end, first, last):
        # The whole range is taken from the file now, before the first await: an
        # O_TRUNC, truncate or write that lands while this read waits for the
        # device must not turn the rest of the range into zeros (bytes nobody
        # wrote) or into a mix within a block, nor free a block it is about to
        # read. So dirty bytes are copied now and stored blocks pinned until the
        # read is done: the reply is the file as it was when the read began.
        bs = self.bs
        parts, pinned = [], []
        for idx in range(first, last + 1):
            a = max(off, idx * bs) - idx * bs
            b = min(end, (idx + 1) * bs) - idx * bs
            entry = filedata.blocks[idx] if idx < len(filedata.blocks) else None
            if entry is None:
                parts.append(bytes(b - a))
            elif isinstance(entry, Dirty):
                parts.append(bytes(entry.buf[a:b]))
            else:
                self.index.pin(entry)
                pinned.append(entry)
                parts.append((entry, a, b))
        try:
            for i, part in enumerate(parts):
                if not isinstance(part, tuple):
                    continue
                key, a, b = part
                data = await self.get(key)           # a read-only view, replied from without a copy
                if b <= len(data):
                    parts[i] = data if a == 0 and b == len(data) else data[a:b]
                else:
                    # A stored block shorter than the range (the file grew by truncate) reads zeros beyond it.
                    parts[i] = bytes(data[a:b]).ljust(b - a, b"\0")
        finally:
            for key in pinned:
                self.index.unpin(key)
        self._s["bytes_read"] += end - off
        self._s["read_requests"] += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def prefetch_on_open(self, filedata: FileData) -> int:
        """A new reader: prefetch from the file's start again.

        What an earlier reader prefetched may have left the clean cache since
        (LRU eviction, drop-caches); without starting over, a cold re-read got no
        prefetch at all and went to the device one request, one block at a time.
        Blocks still cached or being read are skipped, so a warm reopen costs one
        scan of the window and no device read.

        Returns how many blocks of the window were not in the clean cache
        (being read, or now started): 0 means a warm reopen.
        """
        filedata.prefetched_upto = 0
        return self.prefetch(filedata)

    def prefetch(self, filedata: FileData, from_index: int = 0) -> int:
        """Start background reads of the stored blocks ahead of ``from_index``.

        The window is half the clean cache, so a prefetch never evicts the
        blocks it just fetched before the reader gets to them. Returns how
        many distinct blocks of the window were not in the clean cache.
        """
        if self._nursery is None:
            return 0
        window = max(1, (self.cache_size // 2) // self.bs)
        start = max(filedata.prefetched_upto, from_index)
        stop = min(len(filedata.blocks), from_index + window)
        if start >= stop:
            return 0
        filedata.prefetched_upto = stop
        missing = [k for k in dict.fromkeys(filedata.blocks[start:stop])
                   if isinstance(k, bytes) and k not in self._clean]
        wanted = [k for k in missing if k not in self._reading]
        # Claimed here, before anything awaits: the readers of these blocks (an
        # O_DIRECT read arrives as many concurrent requests at once) then wait for
        # the prefetch's run reads instead of each reading its own block.
        claims = []
        for run in self.index.adjacent_runs(wanted, PREFETCH_RUN_BLOCKS):
            done = trio.Event()
            for key in run:
                self._reading[key] = done
            claims.append((run, done))
        if claims:
            self._nursery.start_soon(self._prefetch, claims)
        return len(missing)

    async def _prefetch(self, claims):
        # Adjacent blocks are read as runs of up to PREFETCH_RUN_BLOCKS: one device
        # read and one worker-thread hand-off per run, instead of per block. The
        # kernel still splits each run into many device requests.
        async with trio.open_nursery() as nursery:
            for run, done in claims:
                # Take free slots without yielding, so a whole chunk's reads are
                # issued at once and the device sees the full queue depth.
                try:
                    self._read_slots.acquire_nowait()
                except trio.WouldBlock:
                    await self._read_slots.acquire()
                nursery.start_soon(self._prefetch_run, run, done)

    async def _prefetch_run(self, run, done):
        try:
            # While this task waited for a slot, blocks may have left the index
            # (their files were deleted): those are not read, and what remains
            # of the run is read in pieces that are still adjacent.
            live = [k for k in run if self._reading.get(k) is done and self.index.has_block(k)]
            for part in self.index.adjacent_runs(live, PREFETCH_RUN_BLOCKS):
                await self._fetch_run(part, done)
        except KvfsError as exc:
            log.debug("prefetch of %d block(s) failed: %s (the reader will see it)", len(run), exc)
        finally:
            self._release_claims(run, done)
            self._read_slots.release()

    def _release_claims(self, run, done):
        """Let go of ``run``'s claims made with ``done`` (not claims others made since), wake waiters."""
        for key in run:
            if self._reading.get(key) is done:
                del self._reading[key]
        done.set()

    async def _fetch_run(self, run, done=None):
        """Read ``run`` with one hand-off; its blocks are claimed with ``done`` (new if None)."""
        own = done is None
        if own:
            done = trio.Event()
            for key in run:
                self._reading[key] = done
        for key in run:
            # Pinned while the device reads it: nobody else holds a prefetched
            # block, and a block freed meanwhile (its file emptied) is free space
            # that a new block may overwrite before the read gets there; the read
            # then saw other bytes and reported a corrupt block that was not.
            self.index.pin(key)
        self._s["read_handoffs"] += 1
        self._s["blocks_fetched"] += len(run)
        self._s["misses"] += len(run)
        self._s["inflight"] += len(run)
        self._s["inflight_max"] = max(self._s["inflight_max"], self._s["inflight"])
        try:
            results = await self.index.read_run(run, [self._clean_buffer() for _ in run])
        finally:
            self._s["inflight"] -= len(run)
            for key in run:
                self.index.unpin(key)
            if own:
                self._release_claims(run, done)
        for key, data in zip(run, results):
            # A corrupt block: its reader gets EIO itself. A block freed meanwhile: nobody wants it.
            if not isinstance(data, Exception) and self.index.has_block(key):
                self._remember(key, data)
