"""The block index's port: what the block cache, the layer above, may use of the block index.

:class:`kvfs.blockindex.BlockIndex` implements it. tests/test_ports.py checks
both directions: the index has every member named here with the same
parameters, and the block cache uses no member of the index that is not named
here.

Blocks are named by their 16-byte content key. A stored block stays alive while
it is pinned (live users in RAM) or referenced (durable content records, which
the namespace makes through its journal port, kvfs/schema/port.py). Errors are
:mod:`kvfs.errors` types: CorruptBlock for a block that fails its key, NoSpace
and SpaceAwaitsCommit for space.
"""
from typing import Awaitable, Iterable, Optional, Protocol, Sequence, Union

from ..base.aligned import Buffer, WritableBuffer
from ..errors import CorruptBlock, KvfsError
from .runs import RunHint


class IndexPort(Protocol):
    block_size: int                  # fixed by mkfs

    # Pins: a pinned block is not freed (its extent not reused) while a cache user holds it.
    def has_block(self, key: bytes) -> bool: ...      # may change after an await: ask again
    def pin(self, key: bytes) -> None: ...
    def unpin(self, key: bytes) -> None: ...           # the last pin of an unreferenced block frees it
    def unreferenced_bytes(self, keys: Iterable[bytes]) -> int: ...   # device bytes of those only pins keep

    # Space promised to dirty blocks, so a writer gets ENOSPC at write(), not a lost flush.
    def reserve(self, nbytes: int) -> Awaitable[None]: ...
    def unreserve(self, nbytes: int) -> None: ...

    # Storing: per (data, source, domain), the block's key (pinned) or the KvfsError it failed with.
    def store_blocks(self, blocks: Sequence[tuple[Buffer, Optional[WritableBuffer], int]],
                     hints: Optional[Sequence[Optional[RunHint]]] = None
                     ) -> Awaitable[list[Union[bytes, KvfsError]]]: ...
    def extent_off(self, key: bytes) -> Optional[int]: ...        # None: not stored
    # Per key (device offset, length, key, salt), None for None (a hole); None if a key is not stored.
    def placements(self, keys: Sequence[Optional[bytes]]) -> Optional[list[Optional[tuple[int, int, bytes, bytes]]]]: ...

    # Verified reads: read-only views, filled into the buffers given (None: a fresh one).
    def read_block(self, key: bytes, buf: Optional[WritableBuffer] = None) -> Awaitable[memoryview]: ...
    def adjacent_runs(self, keys: Iterable[bytes], most: int) -> list[list[bytes]]: ...
    def read_run(self, run: Sequence[bytes], bufs: Sequence[Optional[WritableBuffer]]
                 ) -> Awaitable[list[Union[memoryview, CorruptBlock]]]: ...
