"""Names of a file and owners of a content: one value, or a set only when there are several."""
import stat

from kvfs.namespace import ROOT_INO
from kvfs.namespace.inodes import Inode, add_name, drop_name, names_of

from .helpers import close_and_check, mkfs, open_fs, running, write_file


def test_a_file_keeps_its_names_as_one_tuple_until_it_has_two():
    inode = Inode(20, stat.S_IFREG | 0o644, 0, 0, now=0)
    assert names_of(inode) == ()
    add_name(inode, (1, b"a"))
    assert inode.names == (1, b"a") and list(names_of(inode)) == [(1, b"a")]
    add_name(inode, (1, b"a"))                     # the same link again: no change
    assert inode.names == (1, b"a")
    add_name(inode, (5, b"b"))                     # a hard link
    assert inode.names == {(1, b"a"), (5, b"b")}
    drop_name(inode, (1, b"a"))
    assert inode.names == (5, b"b")
    drop_name(inode, (9, b"not-a-name"))
    assert inode.names == (5, b"b")
    drop_name(inode, (5, b"b"))
    assert inode.names == () and names_of(inode) == ()
    directory = Inode(21, stat.S_IFDIR | 0o755, 0, 0, now=0)
    assert directory.names is None                 # directories have none to track


async def test_owners_of_a_content_follow_dedup_copies_and_unlinks(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    async with running(fs):
        inos = [await write_file(ns, ROOT_INO, b"copy%d" % i, b"same bytes" * 1000) for i in range(3)]
        await ns.tree.content.ready()                # the index is built on first use
        key = ns.inode(inos[0]).content_key
        assert set(ns.tree.content_owners(key)) == set(inos)
        ns.unlink(ROOT_INO, b"copy0", directory=False)
        ns.forget(inos[0], 1)
        ns.unlink(ROOT_INO, b"copy1", directory=False)
        ns.forget(inos[1], 1)
        assert ns.tree.content_owners(key) == (inos[2],)
        assert ns.tree.content.by_content[key] == inos[2]  # one owner: a number, not a set
        ns.unlink(ROOT_INO, b"copy2", directory=False)
        ns.forget(inos[2], 1)
        assert ns.tree.content_owners(key) == () and key not in ns.tree.content.by_content
    close_and_check(fs)
