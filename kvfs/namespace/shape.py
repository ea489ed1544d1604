"""The shape a loaded namespace must have before the live operations may work on it."""
import stat

from ..errors import FormatError
from .inodes import ROOT_INO


def check_shape(inodes):
    """FormatError unless the loaded namespace is a tree that the live operations can work on.

    Mount calls this after replay (fsck does not: it reports and repairs the same
    defects). Every entry names an existing inode, every directory has exactly one
    name and its parent is that name's directory, every inode is reachable from the
    root (so the parents of directories hold no cycle), and link counts match.
    """
    S_ISDIR = stat.S_ISDIR
    root = inodes[ROOT_INO]
    if not root.is_dir or root.parent != ROOT_INO:
        raise FormatError("the root is not a directory that is its own parent")
    # One pass over the entries counts every inode's names and each directory's
    # subdirectories; then a walk over the directories alone. (At a million files
    # every pass over them costs a remount a second, so there are only two.)
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
    # Every directory but the root is named once, in its parent (checked above):
    # a directory the walk from the root misses sits on a cycle of parents.
    # Every entry is in a directory, so once all directories are reachable,
    # an inode is reachable exactly when it has a name.
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
