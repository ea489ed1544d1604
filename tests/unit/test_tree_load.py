"""Mount's load of inode rows (kvfs/namespace/treeload.py, kvfs/schema/stream.py batches).

Lists of regular files are made into Inodes a list at a time; every other list
row by row. Both ways must make the same inodes, slot for slot, for every shape
of file a checkpoint holds: one block, several, holes, none, a block the index
lacks, a device number, timestamps equal or not.
"""
import os

import msgpack
import pytest
import trio

from kvfs import schema
from kvfs.errors import FormatError
from kvfs.namespace import ROOT_INO, treeload
from kvfs.namespace.inodes import Inode
from kvfs.namespace.tree import Tree
from kvfs.schema.stream import decode_streaming

from .helpers import BS, close_and_check, mkfs, open_fs, running, write_file


async def _files_of_every_shape(ns):
    await write_file(ns, ROOT_INO, b"one-block", b"a" * 4096)
    await write_file(ns, ROOT_INO, b"three-blocks", os.urandom(2 * BS + 100))
    await write_file(ns, ROOT_INO, b"empty", b"")
    ino = ns.make(ROOT_INO, b"hole-first", 0o100644, 0, 0)
    fh, _, _ = ns.open(ino, os.O_WRONLY)
    await ns.write(fh, BS + 5, b"tail")            # block 0 is a hole
    await ns.release(fh)
    await write_file(ns, ROOT_INO, b"same-as-one-block", b"a" * 4096)      # deduplicated: one key, two files


def _file_rows(fs):
    """The files' rows of the store's state, as the checkpoint stream yields them, plus odd shapes."""
    rows = [row.to_wire() for row in fs.ns.tree.snapshot().inodes if row.mode & 0o170000 == 0o100000]
    shapes = {len(row[9][1]) for row in rows}
    assert {0, 1, 3} <= shapes and any(None in row[9][1] for row in rows), shapes
    top = max(row[0] for row in rows)
    lost = [top + 1, 0o100600, 7, 8, 1, 0, 1, 2, 3, [4096, [bytes(range(16))]]]   # a block the index lacks
    device = [top + 2, 0o100644, 0, 0, 1, 9, 5, 5, 5, [0, []]]                     # rdev, equal timestamps
    all_hole = [top + 3, 0o100644, 0, 0, 1, 0, 5, 6, 7, [4096, [None]]]
    # Decoded as mount decodes them: every int an object of its own, as msgpack makes them.
    return msgpack.unpackb(msgpack.packb(rows + [lost, device, all_hole]))


def _trees(fs):
    return [Tree(fs.index, fs.ns.tree.now) for _ in range(2)]


def test_a_list_of_files_makes_the_inodes_rows_one_by_one_make(tmp_path):
    fs = open_fs(mkfs(tmp_path))

    async def fill():
        async with running(fs):
            await _files_of_every_shape(fs.ns)

    trio.run(fill)
    rows = _file_rows(fs)
    # As one list, and as lists of one-block files only (a list of those keeps their keys bare).
    one_block = [row for row in rows if len(row[9][1]) == 1]
    assert len(one_block) >= 4
    for rows in (rows, one_block):
        _compare_loads(fs, rows)
    close_and_check(fs)


def _compare_loads(fs, rows):
    by_list, by_row = _trees(fs)
    assert treeload._load_files(by_list.inodes, by_list.journal, rows) is True        # the lost block
    assert treeload._load_one_by_one(by_row, rows) is True
    assert by_list.inodes.keys() == by_row.inodes.keys() == {row[0] for row in rows}
    for ino, fast in by_list.inodes.items():
        slow = by_row.inodes[ino]
        for slot in Inode.__slots__:
            assert getattr(fast, slot) == getattr(slow, slot), (ino, slot)
        assert fast.rdev == slow.rdev and fast.committed == slow.committed
        # The same memory too: shared ints (kvfs/base/sharedints.py), equal timestamps as one object.
        for slot in ("mode", "uid", "gid", "size_committed"):
            assert getattr(fast, slot) is getattr(slow, slot), (ino, slot)
        assert (fast.atime is fast.mtime, fast.ctime is fast.mtime) == (slow.atime is slow.mtime,
                                                                         slow.ctime is slow.mtime)
        # The index's own key objects, as one by one (test_load_memory.py says why).
        for mine, theirs in zip(fast.committed, slow.committed):
            assert mine is theirs
    made = {row[0]: by_list.inodes[row[0]] for row in rows}
    assert {i.committed for i in made.values() if i.size_committed == 4096} >= {(bytes(range(16)),), (None,)}
    assert any(i.rdev == 9 for i in made.values()) == any(row[5] for row in rows)
    shared = [i for i in made.values() if i.size_committed == 4096 and i.committed[0] in fs.index.entries]
    assert len(shared) == 2 and shared[0].committed[0] is shared[1].committed[0]


def test_a_list_of_files_refuses_an_inode_twice(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    row = [40, 0o100644, 0, 0, 1, 0, 5, 5, 5, [0, []]]
    tree, _ = _trees(fs)
    with pytest.raises(FormatError, match="inode 40 twice"):
        treeload._load_files(tree.inodes, tree.journal, [row, [41] + row[1:], list(row)])
    tree, _ = _trees(fs)
    treeload._load_files(tree.inodes, tree.journal, [row])
    with pytest.raises(FormatError, match="inode 40 twice"):
        treeload._load_files(tree.inodes, tree.journal, [[41] + row[1:], row])
    close_and_check(fs)


KEY = bytes(range(16))


def _wire(rows):
    inodes = [[1, 0o040755, 0, 0, 2, 0, 5, 5, 5, [1, [[b"f%d" % i, 16 + i] for i in range(rows)]]]]
    inodes += [[16 + i, 0o100644, 0, 0, 1, 0, 7, 8, 8, [4096, [KEY]]] for i in range(rows)]
    return {"next_ino": 16 + rows, "inodes": inodes, "blocks": [[KEY, 1 << 20, 4096, rows]],
            "free": [], "provisional": [], "pinned": []}


def test_the_stream_says_which_lists_hold_files_only():
    stream = decode_streaming(msgpack.packb(_wire(5)), 16, block_size=4096).inodes
    batches = list(stream.batches(size=2))
    assert [(len(rows), only_files) for rows, only_files in batches] == [(1, False), (2, True), (2, True), (1, True)]
    assert [row[0] for rows, _ in batches for row in rows] == [1, 16, 17, 18, 19, 20]
    w = _wire(3)
    w["inodes"].insert(2, [30, 0o040700, 0, 0, 2, 0, 5, 5, 5, [1, []]])         # a directory among the files
    w["inodes"][0][9][1].append([b"d", 30])
    w["inodes"][0][4] = 3
    batches = list(decode_streaming(msgpack.packb(w), 16).inodes.batches(size=8))
    assert [[row[0] for row in rows] for rows, _ in batches] == [[1], [16], [30], [17, 18]]
    assert [only_files for _, only_files in batches] == [False, True, False, True]
    with pytest.raises(RuntimeError, match="only once"):
        list(stream.batches())


def test_a_bad_row_is_refused_with_its_list_and_nothing_after_it_is_built():
    w = _wire(5)
    w["inodes"].insert(4, [19, 0o100644, 0, 0, 1, 0, 7, 8, 8, [4096, [b"short"]]])
    batches = decode_streaming(msgpack.packb(w), 16).inodes.batches(size=2)
    assert [row[0] for row in next(batches)[0]] == [1]
    assert [row[0] for row in next(batches)[0]] == [16, 17]
    with pytest.raises(FormatError, match="block key"):
        next(batches)                               # 18 and the bad 19: 18 is not yielded


def test_a_remounted_store_of_every_file_shape_reads_back(tmp_path):
    """The whole mount path: the rows go through the stream's lists and back to the same files."""
    path = mkfs(tmp_path)
    fs = open_fs(path)

    async def fill():
        async with running(fs):
            await _files_of_every_shape(fs.ns)

    trio.run(fill)
    before = {row.ino: row for row in fs.ns.tree.snapshot().inodes}
    fs.close()
    fs = open_fs(path)
    after = {row.ino: row for row in fs.ns.tree.snapshot().inodes}
    assert after == before
    assert fs.ns.tree.file_count == sum(1 for row in before.values() if row.mode & 0o170000 == 0o100000)
    close_and_check(fs)


def test_the_schema_state_round_trips_through_the_lists():
    w = _wire(600)                                       # more rows than one list holds
    state = decode_streaming(msgpack.packb(w), 16).inodes
    assert [schema.InodeRow(*f) for f in state.fields()] == [schema.InodeRow(*row) for row in w["inodes"]]
