"""A file's live content as the block cache sees it: blocks that are holes, stored keys or dirty buffers."""
from __future__ import annotations

from typing import Iterable

from ..base.aligned import Buffer, WritableBuffer
from ..blockindex.runs import Placement


class Dirty:
    """A block's bytes in RAM that the device does not have yet."""

    __slots__ = ("buf", "version", "queued", "attempts", "used", "placement")

    def __init__(self, buf: WritableBuffer, used: int = 0) -> None:
        self.buf = buf                     # zero-filled; bytes past the file's end stay zero
        self.used = used                   # bytes at the front of buf that may not be zero
        self.version = 0                   # bumped by every write; a flush of an old version is void
        self.queued = False
        self.attempts = 0
        # Where its last flush put it on the device: while that write is in flight the
        # file's other blocks are placed by it (BlockIndex.store_blocks, RunHint).
        self.placement = Placement()


class FileData:
    """Live content of one regular file.

    ``blocks[i]`` is None (a hole: zeros), a 16-byte key (a stored block,
    pinned in the index), or a :class:`Dirty` buffer.
    """

    __slots__ = ("size", "blocks", "dirty_count", "failed", "prefetched_upto", "progress", "domain",
                 "__weakref__")

    def __init__(self, size: int = 0, blocks: Iterable[bytes | Dirty | None] = (), domain: int = 0) -> None:
        self.size = size
        self.domain = domain               # dedup domain its new blocks are stored in (the owner's)
        self.blocks = list(blocks)
        self.dirty_count = 0
        self.failed = None              # the error class once a flush failed for good: reads raise it
        self.prefetched_upto = 0
        # A trio.Event, made by the first flush_file that waits, set and dropped
        # whenever one of its dirty blocks retires. Made lazily: an Event (and
        # the set inside it) per file was 270 bytes of every idle file's RAM.
        self.progress = None

    def keys(self) -> list[bytes | None]:
        return [b if isinstance(b, bytes) else None for b in self.blocks]


def all_zero(buf: Buffer) -> bool:
    # Sample one byte per 4 KiB first: real KV data fails this at once, without
    # copying the buffer. Only a buffer that looks zero gets the full check.
    view = memoryview(buf)
    if any(view[::4093]) or (len(view) and view[-1]):
        return False
    return bytes(view).count(0) == len(view)
