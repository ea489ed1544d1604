"""The shape a loaded namespace must have before the live operations may work on it."""
from __future__ import annotations

import stat
from collections import Counter
from itertools import repeat
from operator import attrgetter, ne

from ..errors import FormatError
from .inodes import ROOT_INO, Inode


def check_shape(inodes: dict[int, Inode]) -> None:
    """FormatError unless the loaded namespace is a tree that the live operations can work on.

    Mount calls this after replay (fsck does not: it reports and repairs the same
    defects). Every entry names an existing inode, every directory has exactly one
    name and its parent is that name's directory, every inode is reachable from the
    root (so the parents of directories hold no cycle), and link counts match.

    A remount of a million files runs this over every inode and entry, so it
    is C-level passes over columns (0.5 us an inode, against 1.2 for the walk
    of :func:`explain_shape`); when a pass fails, that walk names the defect.
    """
    root = inodes.get(ROOT_INO)
    directories = [i for i in inodes.values() if stat.S_ISDIR(i.mode)]
    dir_inos = {d.ino for d in directories}
    names, subdirs_of = Counter(), {}
    fine = root is not None and root.ino in dir_inos and root.parent == ROOT_INO
    has = inodes.__contains__
    for directory in directories if fine else ():
        children = directory.entries.inos()
        names.update(children)                        # every inode's names, counted in C
        subdirs = dir_inos.intersection(children)
        subdirs_of[directory.ino] = subdirs
        if not all(map(has, children)) or ROOT_INO in subdirs or \
                any(inodes[sub].parent != directory.ino for sub in subdirs):
            fine = False
            break
    if fine:
        fine = _directories_form_a_tree(inodes, directories, names, subdirs_of)
    if fine:
        # Each directory's expected count is checked above; in its place, its
        # link count, so that one pass compares every inode's names and links
        # (a file with no name is not reachable: 0 is never fine).
        for directory in directories:
            names[directory.ino] = directory.nlink
        counts = list(map(names.get, inodes.keys(), repeat(0)))
        fine = 0 not in counts and not any(map(ne, map(_NLINK, inodes.values()), counts))
    if not fine:
        explain_shape(inodes)
        raise FormatError("the namespace is not a tree")       # not reached: explained above


_NLINK = attrgetter("nlink")


def _directories_form_a_tree(inodes, directories, names, subdirs_of):
    """Every directory named once (the root never), reached from the root, with 2 + subdirectories links."""
    # Every directory but the root is named once, in its parent (its parent
    # field was checked against the directory naming it): one the walk from
    # the root misses sits on a cycle of parents.
    seen, todo = {ROOT_INO}, [ROOT_INO]
    while todo:
        for sub in subdirs_of[todo.pop()]:
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return len(seen) == len(directories) and all(
        names.get(d.ino, 0) == (d.ino != ROOT_INO) and d.nlink == 2 + len(subdirs_of[d.ino])
        for d in directories)


def explain_shape(inodes: dict[int, Inode]) -> None:
    """FormatError naming the first defect :func:`check_shape` refuses: a walk of every inode and entry."""
    S_ISDIR = stat.S_ISDIR
    root = inodes.get(ROOT_INO)
    if root is None or not root.is_dir or root.parent != ROOT_INO:
        raise FormatError("the root is not a directory that is its own parent")
    names, subdirs_of = {}, {}
    for directory in [i for i in inodes.values() if S_ISDIR(i.mode)]:
        dino, subdirs = directory.ino, []
        for name, child in directory.entries.items():
            node = inodes.get(child)
            if node is None:
                raise FormatError(f"directory {dino} entry {name!r} names missing inode {child}")
            if S_ISDIR(node.mode):
                if child == ROOT_INO or node.parent != dino:
                    raise FormatError(f"directory {child} is listed in {dino}, but its parent "
                                      f"is {node.parent}")
                subdirs.append(node)
            names[child] = names.get(child, 0) + 1
        subdirs_of[dino] = subdirs
    seen, todo = {ROOT_INO}, [ROOT_INO]
    while todo:
        for node in subdirs_of[todo.pop()]:
            if node.ino not in seen:
                seen.add(node.ino)
                todo.append(node.ino)
    for inode in inodes.values():
        ino, count = inode.ino, names.get(inode.ino, 0)
        if S_ISDIR(inode.mode):
            if ino not in seen:
                raise FormatError(f"inode {ino} is not reachable from the root")
            want = 2 + len(subdirs_of[ino])
            if count > 1 or inode.nlink != want:
                raise FormatError(f"inode {ino} has link count {inode.nlink} and {count} name(s)")
        elif not count and ino != ROOT_INO:
            raise FormatError(f"inode {ino} is not reachable from the root")
        elif inode.nlink != count:
            raise FormatError(f"inode {ino} has link count {inode.nlink} and {count} name(s)")
