"""A copy-on-write cut of the durable namespace: a checkpoint's rows, built off the event loop.

A checkpoint must hold the state at one instant: exactly the records appended
before it. Building a million inode rows takes seconds, and on the event loop
that would stall every FUSE request for as long. So the instant is a *cut*:

* taking it (``Tree.cut``, on the loop) notes ``next_ino`` and sorts the small
  ``pinned`` set. It does not list the inodes: at a million inodes that list
  (one C-level copy, 13-20 ms on a small VM) and the block index's list would
  hold the loop for 40-70 ms together. :meth:`TreeCut.list_inodes` lists them
  in a later loop step instead, after the requests that queued meanwhile ran.
  Until then the cut keeps what that later list gets wrong: an inode made in
  between has a number at or above the cut's ``next_ino`` (skipped when rows
  are made), and one that leaves the tree in between is kept by
  :meth:`TreeCut.forget`;
* from then on, the tree calls :meth:`TreeCut.preserve` before it changes a
  durable field of an inode that existed at the cut, and
  :meth:`TreeCut.preserve_name` before it adds or removes a directory entry.
  The first call per inode (per name) saves its value *at the cut*; later ones
  cost a dict lookup;
* :meth:`TreeCut.write` runs in a worker thread and makes each row from the
  saved value if there is one, else from the live inode, and packs it into the
  checkpoint's writer at once (kvfs/schema/writer.py). :meth:`TreeCut.build`
  makes the same rows as a whole CheckpointState, for fsck and tests.

Why a live read in the thread is safe: every change saves the old value
before it touches the inode. The thread reads an inode's fields and *then*
checks for a saved value. If a change began before that check, its saved value
exists and wins; if none exists at the check, no change had begun, so the
fields the thread read were all the cut's. A directory's entries are copied
with ``dict.copy`` (atomic under the GIL), and then the names changed since the
cut (fetched after the copy) are put back to their values at the cut.

The tree ends the cut (:meth:`Tree.end_cut`) once the rows are built.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from .. import schema
from .inodes import Inode

ABSENT = None                 # preserve_name: the name did not exist at the cut


@dataclasses.dataclass(frozen=True)
class CutStatistics:
    rows_built_off_loop: int    # inode rows made in the worker thread from the live inode
    rows_saved_on_loop: int     # inode rows saved on the loop because a change came first
    names_saved_on_loop: int    # directory entries saved on the loop for the same reason


def inode_fields(inode: Inode) -> tuple:
    """What a checkpoint row says about ``inode``, less a directory's entries."""
    if inode.is_dir:
        payload = inode.parent
    elif inode.is_file:
        payload = [inode.size_committed, inode.committed]      # the list is replaced, never changed
    else:
        payload = inode.target
    return (inode.mode, inode.uid, inode.gid, inode.nlink, inode.rdev,
            inode.atime, inode.mtime, inode.ctime, payload, inode.provisional)


class TreeCut:
    def __init__(self, tree: Any, *, listed_now: bool = False) -> None:      # tree: the Tree (a cycle to import)
        """``listed_now``: list the inodes at the cut itself (fsck's snapshot, where nothing
        changes meanwhile); then every inode listed is in the cut, whatever its number, and
        fsck sees even one at or above a (damaged) next_ino."""
        self.inodes = None                  # list_inodes() fills it, a loop step later
        self._gone = []                     # inodes of the cut that left the tree before that
        self._live = tree.inodes            # read on the loop only (and by list_inodes)
        self.next_ino = tree.next_ino
        self.pinned = sorted(tree.pinned)
        self._saved = {}          # ino -> inode_fields at the cut
        self._names = {}          # directory ino -> {name: child ino at the cut, or ABSENT}
        self._built = 0
        self._listed_late = not listed_now
        if listed_now:
            self.list_inodes()

    def list_inodes(self) -> None:
        """On the loop, in a later step than the cut: list the tree's inode objects."""
        if self.inodes is None:
            self.inodes = list(self._live.values())

    # -- called by the tree, on the loop, before a change ------------------------
    def _in_cut(self, inode):
        # Inode numbers are never reused and an inode that leaves the tree never
        # comes back, so an inode in the tree now with a number below the cut's
        # next_ino was in the tree at the cut. (One that left since was preserved
        # before it left: the tree preserves an inode before it unlinks it.)
        return inode.ino < self.next_ino and self._live.get(inode.ino) is inode

    def preserve(self, inode: Inode) -> None:
        if inode.ino not in self._saved and self._in_cut(inode):
            self._saved[inode.ino] = inode_fields(inode)

    def forget(self, inode: Inode) -> None:
        """``inode`` leaves the tree (already preserved): keep it if the list is not taken yet."""
        if self.inodes is None and self._in_cut(inode):
            self._gone.append(inode)

    def preserve_name(self, directory: Inode, name: bytes) -> None:
        if self._in_cut(directory):
            names = self._names.setdefault(directory.ino, {})
            if name not in names:
                names[name] = directory.entries.get(name)

    # -- in a worker thread ---------------------------------------------------------
    def build(self) -> schema.CheckpointState:
        """The namespace's CheckpointState at the cut, whole (fsck; blocks and free map are added below)."""
        self.list_inodes()
        provisional = []
        rows = list(self._rows(provisional))
        return schema.CheckpointState(next_ino=self.next_ino, inodes=rows, blocks=[], free=None,
                                      provisional=provisional, pinned=self.pinned)

    def write(self, writer: schema.CheckpointWriter) -> None:
        """Write the namespace's part of the checkpoint into ``writer`` (a schema.CheckpointWriter),
        each row packed as it is made: a million rows never exist at once."""
        assert self.inodes is not None, "list_inodes() first, on the loop"
        provisional = []
        writer.put("next_ino", self.next_ino)
        writer.start_rows("inodes")
        for row in self._rows(provisional):
            writer.add_row(row)
        writer.put("provisional", provisional)
        writer.put("pinned", self.pinned)

    def _rows(self, provisional):
        """The InodeRows at the cut; inode numbers of provisional files go to ``provisional``."""
        next_ino = self.next_ino if self._listed_late else float("inf")
        for inode in itertools.chain(self.inodes, self._gone):    # our own lists: nobody changes them
            ino = inode.ino
            if ino >= next_ino:
                continue                                 # made after the cut, before the list
            fields = self._saved.get(ino)
            if fields is None:
                fields = inode_fields(inode)
                fields = self._saved.get(ino, fields)    # a change began meanwhile: its saved value
                self._built += 1
            *attrs, payload, is_provisional = fields
            if inode.is_dir:
                payload = [payload, self._entries_at_cut(inode)]
            if is_provisional:
                provisional.append(ino)
            yield schema.InodeRow(ino, *attrs, payload)

    def _entries_at_cut(self, directory):
        entries = dict(directory.entries.items_from_thread())
        changed = self._names.get(directory.ino)
        if changed:
            for name, ino in changed.copy().items():
                if ino is ABSENT:
                    entries.pop(name, None)
                else:
                    entries[name] = ino
        return list(entries.items())

    def statistics(self) -> CutStatistics:
        return CutStatistics(self._built, len(self._saved), sum(len(n) for n in self._names.values()))
