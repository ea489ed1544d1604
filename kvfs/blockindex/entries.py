"""The block index's data types: one entry per stored block, and its statistics record."""
from __future__ import annotations

import dataclasses


class BlockEntry:
    # ``key`` is the entry's own key object, so that files loaded from a
    # checkpoint can share it (stored_keys) instead of each keeping the copy
    # msgpack decoded for them: 64 bytes a block. The slot is free: the
    # object stays in the same 80-byte allocator size class.
    __slots__ = ("off", "length", "refs", "pins", "domain", "key")

    def __init__(self, off: int, length: int, refs: int = 0, pins: int = 0, domain: int = 0, key: bytes | None = None) -> None:
        self.off, self.length, self.refs, self.pins = off, length, refs, pins
        self.domain, self.key = domain, key


@dataclasses.dataclass(frozen=True)
class IndexStatistics:
    unique_blocks: int
    used_bytes: int
    blocks_written: int
    data_bytes_written: int
    dedup_hits: int
    corrupt_reads: int
    reserved_bytes: int
    dedup_verify_reads: int
    dedup_collisions: int
