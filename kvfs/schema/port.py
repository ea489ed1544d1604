"""The journal port: what the namespace asks of the layers below the block cache.

The namespace drives durability: it appends a record for every change, applies
it (which adds and drops block references), commits, and cuts and writes
checkpoints. None of that is the block cache's business, so the namespace does
not ask the cache for it: the assembler (kvfs/server/stack.py) hands the
namespace an object that implements this port, the block index
(:class:`kvfs.blockindex.BlockIndex`), which keeps the references and passes
records and checkpoints to the store below it.

Why a side port, and why here. The layers call one layer down. Durability
cannot follow that rule without a layer that only forwards: the block cache
would pass some twenty calls on to the index untouched, fsck would need a copy
of the same forwarding, and a commit asked for by the index would go up to the
namespace and back down through the cache. The port is the one conscious
exception to the rule, and it is typed and checked rather than listed:

- it is a Protocol on the ground floor, so both sides may import it: the
  namespace holds the object by an attribute annotated with it (``journal``),
  and the block index implements it;
- tests/test_layering.py lets a layer object hold an object of a lower layer
  only by an attribute annotated with a ground-floor port, and lets a call skip
  layers only when it is a call of a member named here, on the implementing
  class;
- tests/test_ports.py checks both directions: the index has every member named
  here with the same parameters, and the namespace uses no member of
  ``journal`` that is not named here.

What crosses it: records (:mod:`kvfs.schema.records`), a record is durable
once a later :meth:`JournalPort.commit` returns; checkpoints, cut on the event
loop and written by a :class:`kvfs.schema.CheckpointWriter`; block references,
by 16-byte content key; and the space that blocks take.
"""
from typing import Any, Awaitable, Iterable, Optional, Protocol, runtime_checkable

from .records import BlockRef
from .writer import CheckpointWriter


@runtime_checkable
class JournalPort(Protocol):
    # Records. Records are appended in order, and each one applied right after it
    # is appended; a commit makes all appended records durable (JournalFull when the
    # journal has no room: then a checkpoint must fold it).
    def append_record(self, record: Any) -> None: ...
    def commit(self) -> Awaitable[None]: ...
    @property
    def journal_fill(self) -> float: ...              # 0..1 of the journal used since the last checkpoint

    # Checkpoints: cut (synchronous, with the tree's cut), list_cut (a later loop
    # step), write_checkpoint (ends the cut); end_cut ends a cut that is not written.
    def cut(self) -> Any: ...
    def list_cut(self, cuts: Any) -> None: ...
    def end_cut(self) -> None: ...
    def write_checkpoint(self, cuts: Any, writer: CheckpointWriter) -> Awaitable[None]: ...
    def checkpoint_capacity(self) -> int: ...

    # Block references, as content records make and drop them.
    def key_of(self, data: bytes, domain: int = 0) -> bytes: ...
    def domain_of(self, uid: int) -> int: ...
    def public_id(self, key: bytes) -> bytes: ...
    def add_ref(self, key: bytes, off: int, length: int, domain: int = 0) -> None: ...
    def drop_ref(self, key: bytes) -> None: ...
    def has_block(self, key: bytes) -> bool: ...
    def stored_keys(self, keys: Iterable[Optional[bytes]]) -> list: ...
    def block_ref(self, key: bytes) -> BlockRef: ...
    def block_count(self) -> int: ...

    # Space.
    def capacity_bytes(self) -> int: ...
    def available_bytes(self) -> int: ...
