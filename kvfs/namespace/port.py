"""The namespace layer's port: what the FUSE layer, the layer above, may use of the namespace.

:class:`kvfs.namespace.Namespace` implements it. tests/test_ports.py checks both
directions: the namespace has every member named here with the same
parameters, and the FUSE layer uses no member of the namespace that is not
named here.

Inodes are numbers, names are bytes, open files are handles (``fh``). Errors
are :mod:`kvfs.errors` types; the FUSE layer turns them into errno in one place.
"""
import dataclasses
from typing import Any, Awaitable, ContextManager, Iterator, Optional, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class SpaceFigures:
    """What :meth:`NamespacePort.statfs` answers: data bytes, and inodes as metadata space allows."""
    capacity_bytes: int
    available_bytes: int
    inodes: int
    free_inodes: int
    block_size: int


@dataclasses.dataclass(frozen=True)
class NativeExtents:
    """What :meth:`NamespacePort.native_extents` answers: a sealed file as it lies on the device.

    ``blocks``: per block in file order (device offset, length, key, salt), or
    None for a hole; blocks past the list up to ``size`` are holes too.
    ``generation`` is the inode's content version: any change makes a new one.
    """
    ino: int
    generation: int
    size: int
    block_size: int
    blocks: list


@dataclasses.dataclass(frozen=True)
class LeaseGrant:
    """What :meth:`NamespacePort.lease_blocks` answers: a sealed file's blocks, held for a bypass reader.

    ``blocks`` as in :class:`NativeExtents`; they stay allocated and unreused
    until :meth:`NamespacePort.end_leases` ends the lease, or ``seconds`` pass.
    """
    lease_id: int
    seconds: float
    generation: int
    size: int
    block_size: int
    blocks: list


class TierPort(Protocol):
    """What the namespace may use of the shared tier (kvfs/tier/shared.py implements it;
    kvfs/server/stack.py wires it in as ``Namespace.tier``)."""
    def offer(self, read: Any) -> bool: ...        # never awaits; False: dropped (queue full)
    def fetch(self, path: bytes) -> Awaitable[Optional[tuple]]: ...   # ([block bytes, ...], mode) verified, or None
    miss_ttl: float                                 # seconds a miss may be cached (kernel too)


class NamespacePort(Protocol):
    block_size: int                  # fixed by mkfs

    # Names and inodes.
    def lookup(self, parent: int, name: bytes) -> int: ...          # counts one kernel lookup
    def lookup_remote(self, parent: int, name: bytes) -> Awaitable[int]: ...   # after NotFound: the shared tier
    tier: Optional[TierPort]
    def count_lookup(self, ino: int) -> None: ...
    def forget(self, ino: int, count: int) -> None: ...
    def inode(self, ino: int) -> Any: ...
    def attr(self, ino: int) -> tuple: ...
    def parent_of(self, ino: int) -> int: ...
    def list_dir(self, ino: int, after: int) -> Iterator[tuple]: ...   # (name, ino, cookie)
    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
             target: Optional[bytes] = None) -> int: ...
    def link(self, ino: int, parent: int, name: bytes) -> int: ...            # counts one kernel lookup
    def unlink(self, parent: int, name: bytes, *, directory: bool) -> None: ...
    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, *,
               noreplace: bool = False) -> Awaitable[None]: ...
    def readlink(self, ino: int) -> bytes: ...
    def setattr(self, ino: int, *, size: Optional[int] = None, mode: Optional[int] = None,
                uid: Optional[int] = None, gid: Optional[int] = None, atime: Optional[int] = None,
                mtime: Optional[int] = None) -> Awaitable[Any]: ...
    def statfs(self) -> SpaceFigures: ...

    # File contents, through open handles.
    def open(self, ino: int, flags: int, *, privileged: bool = True) -> tuple: ...   # (fh, direct_io, keep_cache)
    def read(self, fh: int, off: int, size: int) -> Awaitable[Any]: ...
    def write(self, fh: int, off: int, data: Any) -> Awaitable[int]: ...
    def fsync(self, fh: int) -> Awaitable[None]: ...
    def release(self, fh: int) -> Awaitable[None]: ...
    def commit(self) -> Awaitable[None]: ...
    def views_held(self) -> ContextManager: ...                  # read()'s views stay valid inside
    def content_key(self, ino: int) -> Awaitable[Optional[bytes]]: ...

    # The kernel's page cache, which the FUSE layer fills and drops.
    def page_fill_size(self, fh: int, most: int) -> int: ...
    def page_fill_done(self, fh: int, size: int) -> None: ...
    def stale_kernel_pages(self, fh: int, off: int, size: int) -> Awaitable[Any]: ...

    # Readers outside Python (the native read plane): a sealed file's blocks on the
    # device, and the callback told an inode number when they stop being what a
    # read sees (any content change, the last close), before that change is answered.
    def native_extents(self, fh: int) -> Optional[NativeExtents]: ...
    content_watcher: Optional[Any]

    # Readers that read the device themselves (kvfs.client): a sealed file's blocks under a
    # lease, and the lease's end, which says per lease whether the file is unchanged since.
    def lease_blocks(self, ino: int) -> Awaitable[Optional[LeaseGrant]]: ...   # seals a closed file first
    def end_leases(self, ids: Sequence[int]) -> list[bool]: ...
    # The native read plane pins the blocks of every version it may read (stored blocks only).
    def hold_blocks(self, keys: Sequence[bytes]) -> None: ...
    def let_go_blocks(self, keys: Sequence[bytes]) -> None: ...

    # The by-hash view.
    def lookup_view(self, name: bytes, caller: Any) -> Awaitable[int]: ...   # counts one lookup; NotFound
    def view_listing(self, caller: Any) -> Awaitable[Any]: ...
    def release_view_listing(self, listing: Any) -> None: ...
