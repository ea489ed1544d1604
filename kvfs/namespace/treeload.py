"""Mount's hot loop: the checkpoint's inode rows made into the tree's Inodes.

A remount at issue 10's scale makes a million Inodes here. The checkpoint
stream (kvfs/schema/stream.py) hands the rows over validated: runs of
regular files in lists of up to a few hundred, every other row alone. A list
of files is made at once, with one call for their blocks' index keys and one
dict update, not a few function calls per file (about 8% of a remount's
instructions); other rows, and the rows of a list (fsck), one by one. Both
ways make the same Inodes (the unit tests compare them slot by slot).
"""
from __future__ import annotations

import stat
from itertools import islice
from operator import itemgetter
from stat import S_IFREG
from typing import Any, Iterable

from .. import schema
from ..errors import FormatError
from .inodes import Inode


def load_rows(tree: Any, rows: Iterable[schema.InodeRow | None], *, consume: bool) -> bool:
    """Enter checkpoint ``rows`` (a list of InodeRows, or a stream) into ``tree.inodes``.

    Returns whether some file names a block the index lacks (the tree then
    checks every file's blocks after replay). With ``consume`` a list lets go
    of each row once it is an Inode.
    """
    batches = rows.batches() if not isinstance(rows, list) else ((_row_fields(rows, drop=consume), False),)
    missing = False
    for batch, only_files in batches:
        if only_files:
            missing |= _load_files(tree.inodes, tree.journal, batch)
        else:
            missing |= _load_one_by_one(tree, batch)
    return missing


def _load_one_by_one(tree, rows):
    inodes, missing = tree.inodes, False
    for ino, mode, uid, gid, nlink, rdev, atime, mtime, ctime, payload in rows:
        if ino in inodes:
            raise FormatError(f"checkpoint holds inode {ino} twice")
        if mode & 0o170000 == S_IFREG:
            missing |= _load_file(tree, ino, mode, uid, gid, nlink, rdev, atime, mtime, ctime, payload)
        else:
            _load_inode(tree, ino, mode, uid, gid, nlink, rdev, atime, mtime, ctime, payload)
    return missing


def _load_files(inodes, journal, rows):
    """Regular files' validated rows as idle Inodes (namespace/idle.py); True if a block is missing."""
    inos, modes, uids, gids, nlinks, rdevs, atimes, mtimes, ctimes, payloads = zip(*rows)
    if len(set(inos)) != len(inos) or not inodes.keys().isdisjoint(inos):
        seen = set()
        for ino in inos:
            if ino in inodes or ino in seen:
                raise FormatError(f"checkpoint holds inode {ino} twice")
            seen.add(ino)
    # The index's key objects for the whole list in one call (see _load_file).
    sizes = tuple(map(_first, payloads))
    key_lists = tuple(map(_second, payloads))
    counts = set(map(len, key_lists))
    every_key = [key for keys in key_lists for key in keys] if counts != _ONE else list(map(_first, key_lists))
    present = journal.stored_keys(every_key)
    missing = present != every_key
    if missing:
        present = [p if p is not None else k for p, k in zip(present, every_key)]
    if counts == _ONE and None not in present:
        committed = present                 # a one-block file keeps its key bare (Inode.committed)
    else:
        unpacked = iter(present)
        committed = [keys[0] if len(keys) == 1 and keys[0] is not None else keys
                     for keys in (tuple(islice(unpacked, len(k))) for k in key_lists)]
    made = Inode.loaded_files(inos, modes, uids, gids, nlinks, atimes, mtimes, ctimes, committed, sizes)
    if any(rdevs):
        for inode, rdev in zip(made, rdevs):
            if rdev:
                inode.rdev = rdev
    inodes.update(zip(inos, made))
    return missing


_ONE = {1}
_first, _second = itemgetter(0), itemgetter(1)


def _load_file(tree, ino, mode, uid, gid, nlink, rdev, atime, mtime, ctime, payload):
    """A regular file's checkpoint row (validated: kvfs/schema/validate.py), as an idle Inode.

    Returns True if one of its blocks is missing from the index."""
    # With the index's key objects: a decoded copy freed now is reused by the
    # next row's (a million freed at the end of the load left 64 MB of empty
    # allocator pools). None: a hole, or a block the index lacks.
    size, keys = payload
    present = tree.journal.stored_keys(keys)
    missing = present != keys
    if missing:
        present = [p or k for p, k in zip(present, keys)]
    # Equal timestamps share one int object (48 bytes each): a file
    # written once has mtime == ctime, and often atime too.
    if atime == mtime:
        atime = mtime
    if ctime == mtime:
        ctime = mtime
    inode = Inode.loaded_file(ino, mode, uid, gid, nlink, atime, mtime, ctime, present, size)
    if rdev:
        inode.rdev = rdev
    tree.inodes[ino] = inode
    return missing


def _load_inode(tree, ino, mode, uid, gid, nlink, rdev, atime, mtime, ctime, payload):
    """A checkpoint row of any other type (directory, symlink, node), as an Inode."""
    # msgpack decodes every int above 256 into an object of its own: modes
    # and owners (Inode shares them) repeat (kvfs/base/sharedints.py).
    inode = Inode(ino, mode, uid, gid, rdev)
    atime = mtime if atime == mtime else atime
    ctime = mtime if ctime == mtime else ctime
    inode.nlink, inode.atime, inode.mtime, inode.ctime = nlink, atime, mtime, ctime
    if stat.S_ISDIR(mode):
        inode.parent = payload[0]
        inode.entries.add_all(payload[1])      # validated: distinct names (kvfs/schema/validate.py)
    elif stat.S_ISLNK(mode):
        inode.target = payload
    tree.inodes[ino] = inode


def _row_fields(rows, drop):
    """Each InodeRow of a list as its fields in wire order; with ``drop`` the list lets go of each row."""
    for i, row in enumerate(rows):
        yield row.to_wire()
        if drop:
            rows[i] = None
