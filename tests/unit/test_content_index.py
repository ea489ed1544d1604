"""The content index (kvfs/namespace/contentindex.py): built on first use, then kept exact.

A mount loads without computing any file's content key; the by-hash view builds the
index in slices, and whatever changes while it builds, or after, is entered at once.
The index is checked against a recount from scratch after every step.
"""
import os

import trio

from kvfs.namespace import ROOT_INO
from kvfs.namespace import contentindex

from .helpers import close_and_check, mkfs, open_fs, pattern, running, write_file


def recount(tree):
    """content key -> set of inode numbers, from the files themselves."""
    expect = {}
    for inode in tree.inodes.values():
        if inode.is_file and not inode.provisional:
            key = tree.content.key_of(inode.size_committed, inode.committed)
            expect.setdefault(key, set()).add(inode.ino)
    return expect


def as_sets(by_content):
    return {key: set(owners) if isinstance(owners, set) else {owners} for key, owners in by_content.items()}


async def test_built_on_first_use_and_kept_exact_through_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(contentindex, "SLICE", 3)     # many slices: changes land between them
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs):
        for i in range(12):
            await write_file(fs.ns, ROOT_INO, b"f%02d" % i, pattern(i % 4, 5000))   # 4 contents, 3 copies each
    close_and_check(fs)
    fs = open_fs(path)
    ns = fs.ns
    tree = ns.tree
    async with running(fs):
        assert not tree.content.built and tree.content.by_content == {}
        assert all(i.content_key is None for i in tree.inodes.values() if i.is_file)   # none computed at load
        ino = ns.lookup(ROOT_INO, b"f05")
        assert await ns.content_key(ino) == tree.content.key_of(tree.inodes[ino].size_committed,
                                                                tree.inodes[ino].committed)
        assert tree.content.by_content == {}                  # one key on demand: no index
        changed = []

        async def change_while_building():
            await trio.sleep(0)
            fh, _, _ = ns.open(ns.lookup(ROOT_INO, b"f00"), os.O_WRONLY | os.O_TRUNC)
            await ns.write(fh, 0, pattern(99, 3000))
            await ns.release(fh)
            await ns.seal(ns.inode(ns.lookup(ROOT_INO, b"f00")))
            ns.unlink(ROOT_INO, b"f01", directory=False)
            await write_file(ns, ROOT_INO, b"new", pattern(1, 5000))
            changed.append(True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(change_while_building)
            nursery.start_soon(tree.content.ready)
        assert changed and tree.content.built
        assert as_sets(tree.content.by_content) == recount(tree)
        await write_file(ns, ROOT_INO, b"after", pattern(2, 5000))        # built: entered at once
        ns.unlink(ROOT_INO, b"f02", directory=False)
        assert as_sets(tree.content.by_content) == recount(tree)
    close_and_check(fs)


async def test_a_cancelled_build_starts_over(tmp_path, monkeypatch):
    monkeypatch.setattr(contentindex, "SLICE", 1)
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs):
        for i in range(6):
            await write_file(fs.ns, ROOT_INO, b"f%d" % i, pattern(i, 4000))
    close_and_check(fs)
    fs = open_fs(path)
    tree = fs.ns.tree
    async with running(fs):
        with trio.move_on_after(0) as scope:
            await tree.content.ready()
        assert scope.cancelled_caught and not tree.content.built and tree.content.by_content == {}
        await tree.content.ready()
        assert as_sets(tree.content.by_content) == recount(tree)
    close_and_check(fs)
