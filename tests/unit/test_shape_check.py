"""The mount's namespace shape check (kvfs.namespace.shape) against the walk that explains it.

check_shape decides with C-level passes; explain_shape walks every inode and
entry and names the first defect. On random trees of real Inodes, valid and
broken in each way a loaded namespace can be broken, the two must agree.
"""
import random
import stat

from kvfs.errors import FormatError
from kvfs.namespace.inodes import ROOT_INO, Inode
from kvfs.namespace.shape import check_shape, explain_shape

DIR, FILE, LINK = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777


def random_tree(rng):
    """A valid namespace: nested directories, files (some hard-linked), a symlink."""
    root = Inode(ROOT_INO, DIR, 0, 0)
    root.parent = ROOT_INO
    inodes, dirs, next_ino = {ROOT_INO: root}, [root], 16
    for _ in range(rng.randint(0, 12)):
        parent = rng.choice(dirs)
        sub = Inode(next_ino, DIR, 0, 0)
        sub.parent = parent.ino
        parent.entries.add(b"d%d" % next_ino, next_ino)
        parent.nlink += 1
        inodes[next_ino] = sub
        dirs.append(sub)
        next_ino += 1
    files = []
    for _ in range(rng.randint(0, 60)):
        node = Inode(next_ino, rng.choice((FILE, FILE, FILE, LINK)), 0, 0)
        node.nlink = 0
        inodes[next_ino] = node
        files.append(node)
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            rng.choice(dirs).entries.add(b"f%d-%d" % (next_ino, node.nlink), next_ino)
            node.nlink += 1
        next_ino += 1
    return inodes, dirs, files


def breakages(rng, inodes, dirs, files):
    def file_nlink(): rng.choice(files).nlink += rng.choice((-1, 1))
    def dir_nlink(): rng.choice(dirs).nlink += rng.choice((-1, 1))
    def missing_child(): rng.choice(dirs).entries.add(b"ghost", 999_999)
    def unnamed_file(): rng.choice(files).nlink and _unname(rng, inodes, rng.choice(files))
    def orphan_file():
        node = Inode(999_998, FILE, 0, 0)
        inodes[node.ino] = node
    def orphan_with_no_links():
        node = Inode(999_997, FILE, 0, 0)
        node.nlink = 0                  # its link count agrees: unreachable all the same
        inodes[node.ino] = node
    def root_named(): rng.choice(dirs).entries.add(b"root-again", ROOT_INO)
    def wrong_parent():
        sub = rng.choice(dirs[1:])
        sub.parent = rng.choice([d for d in dirs if d.ino != sub.parent]).ino
    def dir_named_twice():
        sub = rng.choice(dirs[1:])
        rng.choice(dirs).entries.add(b"again", sub.ino)
    def cycle():
        # a directory moved under its own subtree: unreachable, its parent field kept honest
        a = rng.choice(dirs[1:])
        below = [d for d in dirs if _under(inodes, d, a)]
        target = rng.choice(below)
        old = inodes[a.parent]
        for name, child in old.entries.items():
            if child == a.ino:
                old.entries.remove(name)
        old.nlink -= 1
        target.entries.add(b"loop", a.ino)
        target.nlink += 1
        a.parent = target.ino
    def root_parent(): inodes[ROOT_INO].parent = 17
    return [file_nlink, dir_nlink, missing_child, unnamed_file, orphan_file, orphan_with_no_links, root_named,
            wrong_parent, dir_named_twice, cycle, root_parent]


def _unname(rng, inodes, node):
    for d in [i for i in inodes.values() if i.is_dir]:
        for name, child in d.entries.items():
            if child == node.ino:
                d.entries.remove(name)
                return


def _under(inodes, d, a):
    """Whether directory d is a, or below it."""
    while True:
        if d.ino == a.ino:
            return True
        if d.ino == ROOT_INO:
            return False
        d = inodes[d.parent]


def verdict(check, inodes):
    try:
        check(inodes)
    except FormatError as exc:
        return str(exc)
    return None


def test_valid_trees_pass_both():
    rng = random.Random(1)
    for _ in range(300):
        inodes, _, _ = random_tree(rng)
        assert verdict(explain_shape, inodes) is None
        assert verdict(check_shape, inodes) is None


def test_broken_trees_fail_both_with_the_walks_message():
    rng = random.Random(2)
    refused = {}
    for trial in range(1100):
        inodes, dirs, files = random_tree(rng)
        if len(dirs) < 3 or len(files) < 3:
            continue
        breakage = breakages(rng, inodes, dirs, files)[trial % 11]
        breakage()
        expected = verdict(explain_shape, inodes)
        assert verdict(check_shape, inodes) == expected, breakage.__name__
        refused[breakage.__name__] = refused.get(breakage.__name__, 0) + (expected is not None)
    # Every kind of breakage was met, and refused (a file's nlink at 0 with its name gone
    # is still refused: unreachable).
    assert len(refused) == 11 and min(refused.values()) > 20, refused
