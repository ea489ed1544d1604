"""Verified reads: the device reads blocks and checks each against its content key.

The block index describes what to read in plain values: where a run of
adjacent blocks starts, and per block a :class:`BlockCheck` (its length, the
key it must hash to, the salt that goes into the hash), plus the keyed hasher
of the store. The check runs in the device's worker thread right after the
read, so a read and its verification cost one hand-off from the event loop,
and no device thread ever calls back up into the index: what comes back is a
verified view per block, or None for a block that failed its check. The index
decides what a failure means (CorruptBlock, EIO) on the event loop.

This is the read core that the FUSE layer's native read plane and the bypass
client are to share: batched device reads and verification, and nothing else.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Sequence

from ..base.aligned import Buffer, WritableBuffer
from .port import DevicePort


class KeyedHash(Protocol):
    """The store's keyed hasher (a seeded xxh3-128): copied for each block, never updated itself."""
    def copy(self) -> KeyedHash: ...
    def update(self, data: Buffer) -> None: ...
    def digest(self) -> bytes: ...


class BlockCheck(NamedTuple):
    """What one block must be: ``length`` bytes that hash to ``key`` with ``salt`` first."""
    length: int
    key: bytes
    salt: bytes          # b"" for dedup domain 0; the domain's 8 bytes otherwise


def matches(keyed: KeyedHash, data: Buffer, check: BlockCheck) -> bool:
    """Does ``data`` hash to ``check.key`` under ``keyed`` (a seeded xxh3-128 the caller never changes)?"""
    h = keyed.copy()
    if check.salt:
        h.update(check.salt)
    h.update(data)
    return h.digest() == check.key


def read_block_verified_sync(device: DevicePort, off: int, check: BlockCheck, buf: Optional[WritableBuffer],
                             keyed: KeyedHash) -> Optional[memoryview]:
    """One block at ``off``: its verified read-only view, or None if it fails its check."""
    view = device.read_block_sync(off, check.length, buf)
    return view if matches(keyed, view, check) else None


def read_run_verified_sync(device: DevicePort, off: int, checks: Sequence[BlockCheck],
                           bufs: Sequence[Optional[WritableBuffer]],
                           keyed: KeyedHash) -> list[Optional[memoryview]]:
    """A run of adjacent blocks at ``off`` in one device call; per block its view or None.

    One bad block fails alone, never its neighbours.
    """
    views = device.read_blocks_sync(off, [c.length for c in checks], bufs)
    return [view if matches(keyed, view, check) else None for view, check in zip(views, checks)]
