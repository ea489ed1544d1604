"""Mount's memory: what a remounted namespace keeps per file.

Issue 10 measures the daemon's RSS after a remount. Besides the size of the
live objects, objects decoded twice decide it: a block's key in the index and
again in the file's block list, equal timestamps. (The other part, the peak
while the checkpoint's rows and the tree were both whole in memory, is
measured by tools/kvfs-bench meta's RSS after remount, not here: at a test's
scale the journal's read buffer hides it.)
"""
import array

import trio

from .helpers import close_and_check, fill_files, mkfs, open_fs, running

FILES = 1500


async def _fill(fs, files=FILES):
    async with running(fs):
        await fill_files(fs.ns, files)


def _files(fs):
    return [i for i in fs.ns.tree.inodes.values() if i.is_file]


def test_a_remounted_file_shares_its_block_keys_with_the_index(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    trio.run(_fill, fs)
    fs.close()

    fs = open_fs(path)
    files = _files(fs)
    assert len(files) == FILES
    for inode in files:
        (key,) = inode.committed
        assert key is fs.index.entries[key].key, "the file keeps its own copy of the index's key"
        assert inode._committed is key, "a one-block file keeps its key in a tuple of its own"
        # Its one name: the directory entry's own key object and the directory's own
        # inode number, not a (directory, name) tuple.
        directory = fs.ns.tree.inodes[inode.name_dir]
        (name,) = [n for n in directory.entries.names() if n == inode.names]
        assert name is inode.names and inode.name_dir is directory.ino
        # Idle: no live content object and no pin until something opens it (namespace/idle.py).
        assert inode.data is None and fs.index.entries[key].pins == 0
        # Written after it was made: mtime == ctime, one int object for both.
        assert inode.ctime == inode.mtime and inode.ctime is inode.mtime
    # Every file has the same mode and size (4096: above the ints Python
    # shares itself), and every block the same length: one object each.
    assert len({id(i.mode) for i in files}) == 1 and len({id(i.size_committed) for i in files}) == 1
    assert files[0].size_committed == 4096
    lengths = {id(e.length) for e in fs.index.entries.values()}
    assert len(fs.index.entries) == FILES and len(lengths) == 1
    # The eviction policy holds the mount's files packed, oldest first: arrays, no object a file.
    small = fs.ns.evictor.policy._small
    stats = small.statistics()
    assert len(small) == stats["slots"] == stats["log_entries"] == FILES and not stats["extra"]
    assert all(isinstance(a, array.array) for a in (small._log, *small._slots))
    assert small.first()[0] == min(files, key=lambda i: (i.mtime, i.ino)).ino
    close_and_check(fs)


def test_sizes_modes_and_block_lengths_written_live_share_one_object(tmp_path):
    """Files written through the namespace (not loaded) share their repeated ints too."""
    fs = open_fs(mkfs(tmp_path))

    async def fill_and_seal():
        async with running(fs, commit_interval=0.05):
            await fill_files(fs.ns, 200)
            await fs.ns.flush_all()
            files = _files(fs)
            assert len({id(i.mode) for i in files}) == 1 and len({id(i.size_committed) for i in files}) == 1
            assert files[0].size_committed == 4096 and files[0].mode > 256
            assert len({id(e.length) for e in fs.index.entries.values()}) == 1

    trio.run(fill_and_seal)
    close_and_check(fs)


def test_shared_ints_are_bounded_and_only_ints(monkeypatch):
    from kvfs.base import sharedints
    monkeypatch.setattr(sharedints, "_seen", {})          # a table of its own, which it fills
    assert sharedints.shared(True) is True and sharedints.shared(4096.0) == 4096.0
    assert type(sharedints.shared(4096.0)) is float
    big = 10 ** 12 + 7
    assert sharedints.shared(int(str(big))) is sharedints.shared(int(str(big)))
    for n in range(sharedints.LIMIT + 10):
        sharedints.shared(10 ** 13 + n)
    assert len(sharedints._seen) == sharedints.LIMIT          # full: later values are returned as they are
    fresh = int(str(10 ** 14))
    assert sharedints.shared(fresh) is fresh


def test_a_loaded_file_has_every_slot_of_an_inode_made_the_long_way():
    """Inode.loaded_file (mount's constructor, one per file) sets what __init__ and load's fields set."""
    from kvfs.namespace.inodes import Inode
    key = bytes(range(16))
    for committed, size, rdev in (([key], 4096, 0), ([key, None], 2 << 20, 0), ([], 0, 0), ([None], 7, 5)):
        slow = Inode(40, 0o100644, 1000, 1001, rdev)
        slow.nlink, slow.atime, slow.mtime, slow.ctime = 3, 5, 6, 7
        slow.committed, slow.size_committed = committed, size
        fast = Inode.loaded_file(40, 0o100644, 1000, 1001, 3, 5, 6, 7, committed, size)
        if rdev:
            fast.rdev = rdev
        for slot in Inode.__slots__:
            assert getattr(fast, slot) == getattr(slow, slot), (slot, committed)
        assert fast.committed == tuple(committed) and fast.is_file and fast.names == ()
