"""Checkpoints built off the event loop from copy-on-write cuts (kvfs/namespace/cut.py, issue 10).

The cut must equal what a synchronous snapshot at the same instant would have
said, however the namespace changes while the rows are built; and a store
checkpointed while operations went on must reload to exactly the live tree.
"""
import os
import stat

import pytest
import trio

from kvfs.namespace import ROOT_INO

from .helpers import close_and_check, mkfs, open_fs, pattern, read_all, running, write_file

DIR_MODE = stat.S_IFDIR | 0o755


def rows_by_ino(state):
    """A CheckpointState's rows, comparable: directory entries in name order."""
    out = {}
    for row in state.inodes:
        wire = row.to_wire()
        if stat.S_ISDIR(row.mode):
            wire[-1] = [row.parent, sorted(map(tuple, row.entries))]
        out[row.ino] = wire
    return out


def tree_as_rows(fs):
    return rows_by_ino(fs.ns.tree.snapshot())


async def populate(fs, files, dirs=4):
    """``files`` small files in ``dirs`` directories, all sealed and committed."""
    d = [fs.ns.make(ROOT_INO, f"d{i}".encode(), DIR_MODE, 0, 0) for i in range(dirs)]
    for i in range(files):
        await write_file(fs.ns, d[i % dirs], f"f{i}".encode(), pattern(i, 100 + i % 1000), sync=False)
    await fs.ns.flush_all()
    return d


async def mutate(ns, dirs, rounds):
    """Every kind of change the tree has hooks for, to inodes and names that existed at the cut."""
    for i in range(rounds):
        d = dirs[i % len(dirs)]
        ns.unlink(d, f"f{i}".encode(), directory=False)                       # Remove
        await ns.rename(d, f"f{i + 100}".encode(), d, f"f{i}".encode())     # Move into the hole
        await ns.rename(d, f"f{i + 200}".encode(), d, f"f{i + 300}".encode())  # Move over an existing name
        ino = ns.tree.dir(d).entries.get(f"f{i + 400}".encode())
        ns.link(ino, dirs[(i + 1) % len(dirs)], f"link{i}".encode())          # Link
        await ns.setattr(ino, mode=0o100600, uid=7)                             # Attrs
        await write_file(ns, d, f"new{i}".encode(), b"fresh")                  # Make + Content
        fh, _, _ = ns.open(ns.tree.dir(d).entries.get(f"f{i + 500}".encode()), os.O_WRONLY)
        await ns.write(fh, 0, b"rewritten")                                    # mtime, then Content
        await ns.fsync(fh)
        await ns.release(fh)
        await trio.sleep(0)


# A checkpoint lists the inode and block objects a loop step after its cut: the
# changes in between must not show either ("late"), nor those after the list ("at once").
LIST_WHEN = ["at-once", "late"]


@pytest.mark.parametrize("list_when", LIST_WHEN)
async def test_a_cut_keeps_the_state_of_its_instant(tmp_path, list_when):
    fs = open_fs(mkfs(tmp_path))
    async with running(fs):
        dirs = await populate(fs, 800)
        expected = tree_as_rows(fs)
        cut = fs.ns.tree.cut()
        if list_when == "at-once":
            cut.list_inodes()
        await mutate(fs.ns, dirs, 40)
        changed = tree_as_rows(fs)
        built = rows_by_ino(cut.build())
        fs.ns.tree.end_cut()
        assert changed != expected                  # the changes were real ...
        assert built == expected                    # ... and the cut did not see them
        stats = cut.statistics()
        assert 0 < stats.rows_saved_on_loop < 400 and stats.names_saved_on_loop > 0
        assert stats.rows_built_off_loop + stats.rows_saved_on_loop == len(expected)
    close_and_check(fs)


async def test_a_checkpoint_taken_while_operations_go_on_reloads_to_the_live_tree(tmp_path):
    path = mkfs(tmp_path, size=4 << 30)           # a block slot per small file
    fs = open_fs(path)
    async with running(fs):
        dirs = await populate(fs, 6000)
        done = trio.Event()

        async def checkpoint():
            await fs.ns.checkpoint()
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(checkpoint)
            while fs.ns.tree._cut is None:            # the checkpoint takes its cut first
                await trio.sleep(0)
            await mutate(fs.ns, dirs, 60)
        assert done.is_set()
        stats = fs.ns.statistics()
        assert stats.checkpoint_rows_saved_on_loop > 0          # changes landed while rows were built
        assert stats.checkpoint_rows_built_off_loop > 5000     # and nearly every row off the loop
        await fs.ns.commit()                      # the changes after the cut go to the new journal
        fs.device.sync_sync()
        live = tree_as_rows(fs)
        contents = {ino: await read_all(fs.ns, ino) for ino, i in fs.ns.tree.inodes.items() if i.is_file}
    fs.close()
    # Reload from that checkpoint plus the journal after it: exactly the live tree.
    # (The running() exit wrote one more checkpoint; rows must match either way.)
    fs = open_fs(path)
    try:
        assert tree_as_rows(fs) == live
        for ino, data in contents.items():
            assert await read_all(fs.ns, ino) == data
    finally:
        close_and_check(fs)


def block_rows(rows):
    return sorted(row.to_wire() for row in rows)


@pytest.mark.parametrize("list_when", LIST_WHEN)
async def test_an_index_cut_keeps_the_blocks_of_its_instant(tmp_path, list_when):
    """Refs changed, blocks made, and a block freed and made again under the same key
    after the cut: the cut's rows are still those of its instant."""
    fs = open_fs(mkfs(tmp_path))
    async with running(fs):
        ns = fs.ns
        dirs = await populate(fs, 800)
        await ns.commit()
        ns.drop_caches()                # no cached data pins a block: an unlinked file's block goes
        expected_rows, expected_transient = fs.index.snapshot()
        cuts = fs.index.cut()
        index_cut = cuts[0]
        if list_when == "at-once":
            fs.index.list_cut(cuts)
        # A block freed after the cut, then made again with the same content: a new entry, same key.
        victim = ns.tree.dir(dirs[3]).entries.get(b"f799")
        (key,) = ns.tree.inodes[victim].committed
        old_off = fs.index.entries[key].off
        ns.unlink(dirs[3], b"f799", directory=False)
        ns.forget(victim, 1 << 30)      # as the kernel would: the orphan and its pin go
        await ns.commit()
        assert key not in fs.index.entries
        await write_file(ns, dirs[1], b"again", pattern(799, 100 + 799))
        assert fs.index.entries[key].refs == 1
        if list_when == "at-once":
            assert fs.index.entries[key] not in index_cut.entries
        await mutate(ns, dirs, 20)
        await ns.commit()
        built_rows, _ = index_cut.build()
        fs.index.end_cut()
        assert block_rows(fs.index.snapshot()[0]) != block_rows(expected_rows)    # the changes were real
        assert block_rows(built_rows) == block_rows(expected_rows)                # the cut saw none of them
        assert [r.off for r in built_rows if r.key == key] == [old_off]
    close_and_check(fs)
