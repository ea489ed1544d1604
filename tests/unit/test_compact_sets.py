"""Names of a file and owners of a content: one value, or a set only when there are several."""
import stat

from kvfs.namespace import ROOT_INO
from kvfs.namespace.inodes import Inode, add_name, drop_name, names_of

from .helpers import close_and_check, mkfs, open_fs, running, write_file


def test_a_file_keeps_one_name_without_a_tuple_and_a_set_only_from_two():
    inode = Inode(20, stat.S_IFREG | 0o644, 0, 0, now=0)
    assert names_of(inode) == ()
    add_name(inode, (1, b"a"))
    assert (inode.names, inode.name_dir) == (b"a", 1) and list(names_of(inode)) == [(1, b"a")]
    add_name(inode, (1, b"a"))                     # the same link again: no change
    assert (inode.names, inode.name_dir) == (b"a", 1)
    add_name(inode, (5, b"a"))                     # the same name in another directory is another link
    assert inode.names == {(1, b"a"), (5, b"a")} and inode.name_dir is None
    add_name(inode, (5, b"b"))
    assert set(names_of(inode)) == {(1, b"a"), (5, b"a"), (5, b"b")}
    drop_name(inode, (1, b"a"))
    drop_name(inode, (5, b"a"))
    assert (inode.names, inode.name_dir) == (b"b", 5) and list(names_of(inode)) == [(5, b"b")]
    drop_name(inode, (9, b"b"))                    # not one of its names: no change
    drop_name(inode, (5, b"c"))
    assert list(names_of(inode)) == [(5, b"b")]
    drop_name(inode, (5, b"b"))
    assert inode.names == () and inode.name_dir is None and names_of(inode) == ()
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
