"""The block index's part of a checkpoint cut (split out of kvfs/blockindex/__init__.py).

The block rows at a checkpoint's cut, copy-on-write like kvfs/namespace/cut.py's
TreeCut. Only ``refs`` of an entry ever changes (its extent and domain are fixed
at creation), so the index saves an entry's refs before it changes them, and
:meth:`IndexCut.write` (a worker thread; :meth:`IndexCut.build` for fsck) reads
the live entry, then prefers a saved value. Entries made after the cut are not in
it: their extents were free at the cut, and the store's copy of the free map says
so.

Taking the cut copies nothing big. The entry objects are listed by
:meth:`IndexCut.list_entries`, in a later loop step (at a million blocks the
list holds the loop 13-20 ms on a small VM, and together with the tree's list it
was 40-70 ms in one step). Until that list is taken the index tells the cut what
the list would get wrong: an entry made meanwhile (:meth:`IndexCut.made`: the
list skips it, by identity) and an entry that leaves the index meanwhile
(:meth:`IndexCut.forget`: kept, unless it was made after the cut too).

The cut keeps entry objects rather than a copy of the dict (6 ms at a million
blocks instead of 31), so refs are saved by key, not per entry; they need not
be. Refs saved for a key no entry of the cut has are never read. A key has one
entry at a time, and an entry of the cut leaves the index only once it has no
refs: either they dropped after the cut (``drop_ref`` saved them first) or it
had none at the cut. A later entry under that key saves its refs before its
first change, when it has none: 0 either way, the cut's value.
"""
from __future__ import annotations

import itertools
from typing import Any

from .. import schema


class IndexCut:
    def __init__(self, index: Any) -> None:          # the BlockIndex (importing it would be a cycle)
        self.entries = None         # list_entries() fills it, a loop step later
        self.gone = []              # entries of the cut that left the index before that
        self._made = {}             # key -> entry made after the cut, before the list
        self._live = index.entries
        self.writing = [(off, n) for _, off, n in index._writing.values()]
        self._refs = {}

    def list_entries(self) -> None:
        """On the loop, in a later step than the cut: list the index's entry objects."""
        if self.entries is None:
            self.entries = list(self._live.values())

    # -- called by the index, on the loop -----------------------------------------
    def preserve(self, key: bytes, entry: Any) -> None:
        """Before ``entry``'s refs change."""
        if key not in self._refs:
            self._refs[key] = entry.refs

    def made(self, key: bytes, entry: Any) -> None:
        """A new entry under ``key``: not the cut's."""
        if self.entries is None:
            self._made[key] = entry

    def forget(self, key: bytes, entry: Any) -> None:
        """``entry`` leaves the index: keep it for the cut if the list is not taken yet."""
        if self.entries is None:
            if self._made.get(key) is entry:
                del self._made[key]          # made and gone between the cut and the list
            else:
                self.gone.append(entry)

    # -- in a worker thread ---------------------------------------------------------
    def build(self) -> tuple[list[schema.BlockRow], list[tuple[int, int]]]:
        """(BlockRows of the cut, extents only RAM knew about at the cut: free for the checkpoint)."""
        self.list_entries()
        transient = list(self.writing)
        return list(self._rows(transient)), transient

    def write(self, writer: schema.CheckpointWriter) -> list[tuple[int, int]]:
        """Write the cut's BlockRows into ``writer`` (a schema.CheckpointWriter) as they are made;
        returns the extents only RAM knew about at the cut."""
        assert self.entries is not None, "list_entries() first, on the loop"
        transient = list(self.writing)
        writer.start_rows("blocks")
        for row in self._rows(transient):
            writer.add_row(row)
        return transient

    def _rows(self, transient):
        """The BlockRows at the cut; extents of blocks nothing named at the cut go to ``transient``."""
        made = self._made             # no longer changes: the list is taken
        for e in itertools.chain(self.entries, self.gone):
            key = e.key
            if made and made.get(key) is e:
                continue
            refs = self._refs.get(key)
            if refs is None:
                refs = e.refs
                refs = self._refs.get(key, refs)
            if refs:
                yield schema.BlockRow(key, e.off, e.length, refs, e.domain)
            else:
                transient.append((e.off, e.length))
