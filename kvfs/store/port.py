"""The store layer's port: what the block index, the layer above, may use of the extent store.

:class:`kvfs.store.ExtentStore` implements it. tests/test_ports.py checks both
directions: the store has every member named here with the same parameters,
and the block index uses no member of the store that is not named here.

Extents are (device offset, bytes); offsets are sector-aligned. Records are
the journal records of :mod:`kvfs.schema`; a record is durable once a later
:meth:`commit` returns.
"""
import dataclasses
from typing import Awaitable, Optional, Protocol, Sequence, Union

from .. import schema
from ..base.aligned import Buffer, WritableBuffer
from ..device.verified import BlockCheck, KeyedHash
from ..errors import KvfsError
from .allocator import Extent, FreeMap

# A journal record: one of schema.RECORD_TYPES.
Record = Union[schema.Make, schema.Link, schema.Remove, schema.Move, schema.Attrs, schema.Content]


@dataclasses.dataclass(frozen=True)
class StoreCut:
    """What a checkpoint needs of the store at one instant (:meth:`StorePort.cut`)."""
    appended: int                   # records appended before the cut: the checkpoint covers them
    free_map: FreeMap               # Allocator.copy_state() at the cut
    pending_frees: list[Extent]     # extents freed by records before the cut, not yet reusable
    releasing: Sequence[Extent] = ()    # extents no record names, waiting for abandoned device calls


class StorePort(Protocol):
    @property
    def block_size(self) -> int: ...
    @property
    def hash_seed(self) -> int: ...
    @property
    def key_secret(self) -> bytes: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def pending_free_bytes(self) -> int: ...
    @property
    def journal_fill(self) -> float: ...              # 0..1 of the journal used since the last checkpoint

    # Space.
    def check_writable(self) -> None: ...               # raises Fenced/DeviceFailed once writes are stopped
    def free_slots(self) -> int: ...
    def allocate(self, nbytes: int, *, follow: Optional[int] = None, window: int = 0, lead: int = 0) -> int: ...
    def allocate_at(self, off: int, nbytes: int) -> None: ...
    def release_unused(self, off: int, nbytes: int) -> None: ...
    def free(self, off: int, nbytes: int) -> None: ...

    # Block bytes.
    def write_extent(self, off: int, data: Buffer, source: Optional[Buffer] = None) -> Awaitable[None]: ...
    def write_extents(self, writes: Sequence[tuple]) -> Awaitable[list[Optional[KvfsError]]]: ...
    def read_verified_sync(self, off: int, check: BlockCheck, buf: Optional[WritableBuffer],
                           keyed: KeyedHash) -> Optional[memoryview]: ...
    def read_verified(self, off: int, check: BlockCheck, buf: Optional[WritableBuffer],
                      keyed: KeyedHash) -> Awaitable[Optional[memoryview]]: ...
    def read_run_verified(self, off: int, checks: Sequence[BlockCheck], bufs: Sequence[Optional[WritableBuffer]],
                          keyed: KeyedHash) -> Awaitable[list[Optional[memoryview]]]: ...

    # Journal and checkpoints.
    def append(self, record: Record) -> None: ...
    def commit(self) -> Awaitable[None]: ...
    def checkpoint_capacity(self) -> int: ...
    def cut(self) -> StoreCut: ...
    def write_checkpoint(self, cut: StoreCut, writer: schema.CheckpointWriter,
                         transient: Sequence[Extent] = ()) -> Awaitable[None]: ...
