"""Part of the block index: where a file's new blocks go, so that it lies in runs.

Why. A cold read fetches adjacent blocks with one device call per run of up to
PREFETCH_RUN_BLOCKS (kvfs/blockcache/reads.py). Plain next-fit allocation put
blocks in the order their flushes claimed space: an engine writing several chunks
at once (LMCache's disk_io_threads) interleaved them, and the flush workers,
hashing in parallel, put even a lone file's blocks out of order. Such a chunk cost
a reader a device call and a thread hand-off per block (issue 9).

How. The block cache hands each new block's neighbours in its file to
BlockIndex.store_blocks as a :class:`RunHint`. When the block gets its extent,
after its hashing, the index asks the allocator for the spot at the block's
distance from the nearest neighbour that has one (``follow``); with none placed,
the block starts a run, RUN_WINDOW_BLOCKS long, leaving room before it for the
neighbours still hashing (``lead``). Everything here is a preference
(kvfs/store/allocator.py, "Runs"): a spot that is taken means a new run, never a
failed write.
"""
from __future__ import annotations

from typing import Sequence

# Room for a run's blocks from its first (whole blocks). A chunk flushed beside
# others lies in runs of eight, and PREFETCH_RUN_BLOCKS of a run are one device
# call: as many calls as if the chunk had been written alone.
RUN_WINDOW_BLOCKS = 8


class Placement:
    """Where one block lies, or is being written, on the device (``at``; None while it has
    no extent). The index sets ``at`` when it claims the block's extent."""

    __slots__ = ("at",)

    def __init__(self, at: int | None = None) -> None:
        self.at = at


class RunHint:
    """A new block's neighbours in its file: ``own`` is its :class:`Placement`; ``before``
    and ``after`` those of the blocks just before and after it, nearest first, up to
    the first that is not being written (a stored block, the last one that counts, or
    a hole, which has none)."""

    __slots__ = ("own", "before", "after")

    def __init__(self, own: Placement, before: Sequence[Placement], after: Sequence[Placement]) -> None:
        self.own, self.before, self.after = own, before, after


def run_position(hint: RunHint, block_size: int) -> tuple[int | None, int]:
    """(follow, lead) for Allocator.allocate, read when the block gets its extent."""
    for distance, placement in enumerate(hint.before, 1):
        if placement.at is not None:
            return placement.at + distance * block_size, 0
    for distance, placement in enumerate(hint.after, 1):
        if placement.at is not None:
            return placement.at - distance * block_size, 0
    return None, len(hint.before)
