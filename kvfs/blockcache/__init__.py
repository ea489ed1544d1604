"""The block cache: RAM write-back for dirty blocks, LRU for clean ones, prefetch.

The cache knows nothing about inodes or names: a file's live content is a
:class:`FileData`, owned by the namespace and passed in on every call. The
cache talks only to the block index below it. What the namespace needs of the
layers further down (records, checkpoints, references, space) does not pass
through here: the namespace holds the block index as its journal port
(kvfs/schema/port.py).

``reads``     the clean LRU, verified device reads, prefetch
``writeback`` dirty buffers, back-pressure, flush workers, truncation
``filedata``  FileData and Dirty
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Sequence

import trio

from ..blockindex.port import IndexPort
from .filedata import Dirty, FileData, all_zero
from .reads import ReadSide
from .writeback import WriteBack

__all__ = ["BlockCache", "CacheStatistics", "Dirty", "FileData", "all_zero"]


@dataclasses.dataclass(frozen=True)
class CacheStatistics:
    cache_size: int
    dirty_limit: int
    cache_bytes: int
    dirty_bytes: int
    dirty_bytes_max: int
    flush_backlog_bytes: int
    cache_hits: int
    cache_misses: int
    prefetch_inflight: int
    prefetch_inflight_max: int
    blocks_flushed: int
    zero_blocks: int
    writers_throttled: int
    bytes_read: int
    bytes_written: int
    read_requests: int
    write_requests: int
    buffer_bytes: int            # RAM in block buffers: clean, dirty, and spare ones kept for reuse
    read_handoffs: int           # worker-thread calls that read blocks (one per run of adjacent blocks)
    blocks_fetched: int          # blocks those calls read from the device
    flush_batches: int           # flush worker calls: one block, or a batch of small ones
    flush_batch_max: int         # the most blocks one such call stored
    read_buffers_mapped: int     # device reads that had no recycled buffer and mapped a fresh one


class BlockCache(ReadSide, WriteBack):
    def __init__(self, index: IndexPort, *, cache_size: int, dirty_limit: int, read_depth: int = 32,
                 flush_workers: int = 8) -> None:
        self.index = index
        self.bs = index.block_size
        self.cache_size = max(cache_size, 4 * self.bs)
        self.dirty_limit = max(min(dirty_limit, self.cache_size), 2 * self.bs)
        self.read_depth = read_depth
        self.flush_workers = flush_workers
        self._clean = collections.OrderedDict()     # key -> read-only memoryview, LRU order
        self._clean_bytes = 0
        self._reading = {}                          # key -> Event, device reads in flight
        self._read_slots = trio.Semaphore(read_depth)
        self.dirty_bytes = 0
        self._dirty = {}                            # id(Dirty) -> (FileData, Dirty), oldest first
        self._dirty_freed = trio.Event()
        self._ready = collections.deque()           # (FileData, Dirty) waiting for a worker
        self._ready_event = trio.Event()
        self._nursery = None
        self._read_seq = 0                          # numbers read() calls, for buffer reuse
        self._active_reads = {}                     # read() calls in progress (insertion ordered)
        self._quarantine = collections.deque()      # (read seq at eviction, buffer)
        self._clean_spare = []
        self._clean_spare_max = self.cache_size // self.bs
        self._spare = []                            # recycled dirty block buffers
        self._spare_max = min(self.dirty_limit // self.bs, 256)
        self._zero_block = memoryview(bytes(self.bs))     # sliced without a copy
        self._s = collections.Counter()

    @property
    def block_size(self) -> int:
        return self.bs

    def stored_extents(self, filedata: FileData) -> list[tuple[int, int, bytes, bytes] | None] | None:
        """Where a file's blocks lie, for a reader outside Python (the native read plane):
        None unless every block is a hole or a stored key (none dirty, none failed)."""
        if filedata.dirty_count or filedata.failed:
            return None
        if any(not (b is None or isinstance(b, bytes)) for b in filedata.blocks):
            return None
        return self.index.placements(filedata.blocks)

    def hold_blocks(self, keys: Sequence[bytes]) -> None:
        """Pin stored blocks for a reader outside the daemon (kvfs/namespace/leases.py)."""
        for key in keys:
            self.index.pin(key)

    def let_go_blocks(self, keys: Sequence[bytes]) -> None:
        """Unpin what :meth:`hold_blocks` pinned; an unreferenced block is freed with its last pin."""
        for key in keys:
            self.index.unpin(key)

    def unreferenced_bytes(self, keys: Iterable[bytes]) -> int:
        return self.index.unreferenced_bytes(keys)

    def statistics(self) -> CacheStatistics:
        s = self._s
        backlog = len(self._dirty) * self.bs       # dirty buffers not yet on the device
        return CacheStatistics(self.cache_size, self.dirty_limit, self._clean_bytes, self.dirty_bytes,
                               s["dirty_max"], backlog, s["hits"], s["misses"], s["inflight"],
                               s["inflight_max"], s["flushed"],
                               s["zero_blocks"], s["throttled"], s["bytes_read"], s["bytes_written"],
                               s["read_requests"], s["write_requests"], self._buffer_bytes(),
                               s["read_handoffs"], s["blocks_fetched"], s["flush_batches"],
                               s["flush_batch_max"], s["read_buffers_mapped"])

    def _buffer_bytes(self):
        spare = len(self._spare) + len(self._clean_spare) + len(self._quarantine)
        return self._clean_bytes + (len(self._dirty) + spare) * self.bs
