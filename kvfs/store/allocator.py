"""The free-space map of the data region."""
from __future__ import annotations

import bisect
from typing import Iterable, Optional

from .. import schema
from ..errors import FormatError, NoSpace

Extent = tuple[int, int]                    # (device offset, bytes)
FreeMap = tuple[list[int], dict[int, int]]  # Allocator.copy_state(): the starts, and the length at each


class Allocator:
    """Free extents of the data region as a sorted list of starts plus a length map.

    Offsets and lengths are bytes, always multiples of SECTOR. Allocation is
    next-fit from a rotating cursor, which keeps equal-sized KV blocks packed in
    write order and makes the common case O(log n).

    A block must lie in one contiguous extent, so free bytes alone do not say
    whether a block fits: a region fragmented into 512 KiB holes has space but
    no room for a 1 MiB block. ``slots`` counts the whole ``slot``-sized pieces
    the free extents hold (sum of ``len // slot``). Invariant, relied on by the
    block index's reservations: an allocation of at most ``slot`` bytes lowers
    ``slots`` by at most one, so ``k <= slots`` reserved blocks can always be
    allocated. Allocations smaller than a slot are placed, where possible, in
    the spare tail of an extent, so they cost no slot.

    Runs. Plain next-fit interleaves files flushed at the same time (an engine
    writes several chunks at once), and a file whose blocks are scattered costs
    a reader one device call per block instead of one per run of adjacent
    blocks (kvfs/blockcache/reads.py). So a caller may say where its block
    should go (``follow``: the end of the file's previous block, or where a run
    already begun leaves room for it; taken when that space is free) and,
    for a block that starts a run, how much room to leave after it
    (``window``: the cursor moves past it, so other allocations go elsewhere
    while the run grows into it). Both are preferences: a window's space is
    free space like any other, taken once next-fit comes round to it. Either
    way a piece is cut from a free extent at a whole number of slots from the
    extent's start, so the invariant above holds for them too.
    """

    SMALL_FIT_SCAN = 64          # extents examined for a slot-free home of a small allocation

    def __init__(self, start: int, length: int, free_extents: Optional[Iterable[Extent]] = None, *,
                 slot: int = schema.SECTOR) -> None:
        self.start = start
        self.end = start + length
        self.slot = slot
        self._starts: list[int] = []
        self._len: dict[int, int] = {}
        self._cursor = start
        self.free_bytes = 0
        self.slots = 0
        for off, n in (free_extents if free_extents is not None else [(start, length)]):
            self.free(off, n)

    def extents(self) -> list[Extent]:
        return [(s, self._len[s]) for s in self._starts]

    def copy_state(self) -> FreeMap:
        """A cheap copy of the map (two C-level copies): ``extents_of`` turns it into extents later."""
        return self._starts.copy(), self._len.copy()

    @staticmethod
    def extents_of(state: FreeMap) -> list[Extent]:
        starts, lengths = state
        return [(s, lengths[s]) for s in starts]

    def allocate(self, nbytes: int, *, follow: Optional[int] = None, window: int = 0, lead: int = 0) -> int:
        """An extent of ``nbytes`` (rounded up to sectors).

        ``follow``, ``window``: see the class. ``lead``: a block that starts a run
        before ``lead`` blocks of its file that come earlier (their flushes are still
        hashing) is placed ``lead`` slots into the run, leaving them room.
        """
        nbytes = schema.align_up(nbytes)
        if follow is not None:
            start = self._free_extent_at(follow)
            if (start is not None and (follow - start) % self.slot == 0
                    and start + self._len[start] >= follow + nbytes):
                self._take(start, follow, nbytes)
                return follow
        if not window or nbytes < self.slot:
            return self._next_fit(nbytes)
        gap = lead * self.slot
        # Room for the lead is looked for among a few extents only: on a fragmented
        # store a full search would walk every free extent for each such block.
        found = self._find(gap + nbytes, self.SMALL_FIT_SCAN) if gap else None
        if found is None:
            gap = 0
            found = self._find(nbytes)
        start, run = found
        self._take(start, run + gap, nbytes)
        self._cursor = run + max(schema.align_up(window), gap + nbytes)
        return run + gap

    def _free_extent_at(self, off):
        """The start of the free extent that holds ``off``, or None."""
        i = bisect.bisect_right(self._starts, off) - 1
        if i >= 0 and off < self._starts[i] + self._len[self._starts[i]]:
            return self._starts[i]
        return None

    def _next_fit(self, nbytes):
        if nbytes < self.slot:
            count = len(self._starts)
            first = bisect.bisect_left(self._starts, self._cursor)
            for i in range(min(count, self.SMALL_FIT_SCAN)):
                start = self._starts[(first + i) % count]
                if self._len[start] % self.slot >= nbytes:
                    # From the extent's end: its whole slots stay whole.
                    off = start + self._len[start] - nbytes
                    self._take(start, off, nbytes)
                    return off
        start, off = self._find(nbytes)
        self._take(start, off, nbytes)
        self._cursor = off + nbytes
        return off

    def _find(self, nbytes, scan=None):
        """Next-fit: (start of the free extent, offset in it) where ``nbytes`` go, from the cursor.

        NoSpace if no extent has room; with ``scan``, None if none of the first
        ``scan`` extents from the cursor has."""
        if nbytes >= self.slot:
            # The cursor inside a free extent (a window's end, or a freed extent that
            # merged with the one it pointed at): start there, not at the next extent,
            # rounded up to a whole number of slots from the extent's start so that
            # the cut leaves its slots whole.
            start = self._free_extent_at(self._cursor)
            if start is not None and start < self._cursor:
                off = self._cursor + (start - self._cursor) % self.slot
                if start + self._len[start] - off >= nbytes:
                    return start, off
        count = len(self._starts)
        first = bisect.bisect_left(self._starts, self._cursor)
        for i in range(count if scan is None else min(count, scan)):
            start = self._starts[(first + i) % count]
            if self._len[start] >= nbytes:
                return start, start
        if scan is not None:
            return None
        raise NoSpace(f"no free extent of {nbytes} bytes ({self.free_bytes} bytes free in total)")

    def allocate_at(self, off: int, nbytes: int) -> None:
        """Mark [off, off+nbytes) allocated; it must be free (used by replay)."""
        nbytes = schema.align_up(nbytes)
        i = bisect.bisect_right(self._starts, off) - 1
        if i < 0 or self._starts[i] + self._len[self._starts[i]] < off + nbytes:
            raise FormatError(f"extent [{off}, +{nbytes}) is referenced twice or lies outside free space")
        self._take(self._starts[i], off, nbytes)

    def _take(self, ext_start, off, nbytes):
        ext_len = self._remove(ext_start)
        head = off - ext_start
        tail = ext_start + ext_len - (off + nbytes)
        if head:
            self._insert(ext_start, head)
        if tail:
            self._insert(off + nbytes, tail)
        self.free_bytes -= nbytes

    def _insert(self, off, nbytes):
        bisect.insort(self._starts, off)
        self._len[off] = nbytes
        self.slots += nbytes // self.slot

    def _remove(self, off):
        """Take the free extent starting at ``off`` out of the map; return its length."""
        nbytes = self._len.pop(off)
        del self._starts[bisect.bisect_left(self._starts, off)]
        self.slots -= nbytes // self.slot
        return nbytes

    def free(self, off: int, nbytes: int) -> None:
        nbytes = schema.align_up(nbytes)
        if off < self.start or off + nbytes > self.end or off % schema.SECTOR:
            raise FormatError(f"freeing extent [{off}, +{nbytes}) outside the data region")
        i = bisect.bisect_left(self._starts, off)
        if i < len(self._starts) and self._starts[i] < off + nbytes:
            raise FormatError(f"double free of extent [{off}, +{nbytes})")
        if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] > off:
            raise FormatError(f"double free of extent [{off}, +{nbytes})")
        self.free_bytes += nbytes
        # Coalesce with the following and the preceding free extent.
        if i < len(self._starts) and self._starts[i] == off + nbytes:
            nbytes += self._remove(self._starts[i])
        if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] == off:
            prev = self._starts[i - 1]
            off, nbytes = prev, self._remove(prev) + nbytes
        self._insert(off, nbytes)
