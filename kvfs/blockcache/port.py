"""The block cache's port: what the namespace, the layer above, may use of the block cache.

:class:`kvfs.blockcache.BlockCache` implements it. tests/test_ports.py checks
both directions: the cache has every member named here with the same
parameters, and the namespace uses no member of the cache that is not named
here.

A file's live content is a :class:`~kvfs.blockcache.FileData`, which the
namespace owns and passes in on every call; the cache knows no inodes or
names. Errors are :mod:`kvfs.errors` types (a FileData whose flush failed
raises its ``failed`` error on read and write).
"""
from typing import Awaitable, ContextManager, Iterable, Optional, Protocol, Sequence, Union

from ..base.aligned import Buffer
from .filedata import FileData


class CachePort(Protocol):
    @property
    def block_size(self) -> int: ...

    # A FileData's stored blocks are pinned while the namespace holds it live.
    def attach(self, filedata: FileData) -> None: ...         # pin the blocks of one built from durable state
    def detach(self, filedata: FileData) -> None: ...         # unpin them, leaving ``filedata`` as it is
    def release(self, filedata: FileData) -> None: ...        # gone or emptied: drop dirty buffers, unpin
    def snapshot(self, filedata: FileData) -> FileData: ...   # a read-only copy; give back with release_snapshot
    def release_snapshot(self, snap: FileData) -> None: ...

    # Contents.
    def read(self, filedata: FileData, off: int, size: int) -> Awaitable[Union[bytes, memoryview]]: ...
    def views_held(self) -> ContextManager[None]: ...          # read()'s views stay valid inside
    def write(self, filedata: FileData, off: int, data: Buffer) -> Awaitable[None]: ...
    def truncate(self, filedata: FileData, size: int) -> Awaitable[None]: ...
    def flush_file(self, filedata: FileData) -> Awaitable[None]: ...     # every block written so far stored
    def flush_all(self) -> Awaitable[None]: ...
    # Per block (device offset, length, key, salt) or None for a hole; None if a block is not on the device.
    def stored_extents(self, filedata: FileData) -> Optional[list[Optional[tuple[int, int, bytes, bytes]]]]: ...

    # Blocks a reader outside the daemon holds (a bypass lease): pinned, so not freed nor
    # reused while held; and how many bytes of them no durable content names any more.
    def hold_blocks(self, keys: Sequence[bytes]) -> None: ...
    def let_go_blocks(self, keys: Sequence[bytes]) -> None: ...
    def unreferenced_bytes(self, keys: Iterable[bytes]) -> int: ...

    # The clean cache and prefetch: how many blocks of the window were not cached.
    def prefetch_on_open(self, filedata: FileData) -> int: ...
    def prefetch(self, filedata: FileData, from_index: int = 0) -> int: ...
    def forget_clean(self, filedata: FileData) -> None: ...
    def drop_clean(self) -> None: ...
