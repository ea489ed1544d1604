"""Idle files keep no live content object (kvfs/namespace/idle.py).

A million chunk files must fit in little RAM, so a regular file whose live
content is its durable content has ``inode.data is None`` and pins nothing;
an open or a truncate builds the live content from the durable record, and
the last close (or the background seal) drops it again. These tests follow
one file through each transition and check the bytes, the pins and fsck.
"""
import os

import trio

from kvfs.namespace import ROOT_INO

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, read_all, running, slow_writes, write_file


def pins(fs, inode):
    return [fs.index.entries[k].pins for k in inode.committed if k is not None]


async def test_a_file_is_idle_after_its_seal_and_live_while_open(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    first, second = pattern(1, 2 * BS + 100), pattern(2, BS + 7)
    async with running(fs):
        ns = fs.ns
        ino = await write_file(ns, ROOT_INO, b"f", first)
        inode = ns.inode(ino)
        assert inode.data is None and pins(fs, inode) == [0, 0, 0]
        assert ns.attr(ino)[0].size == len(first)

        fh, _, _ = ns.open(ino, os.O_RDONLY)
        assert inode.data is not None and pins(fs, inode) == [1, 1, 1]
        assert bytes(await ns.read(fh, 0, len(first))) == first
        await ns.release(fh)
        assert inode.data is None and pins(fs, inode) == [0, 0, 0]

        # A rewrite: live while written and until its content is recorded, idle after.
        fh, _, _ = ns.open(ino, os.O_WRONLY | os.O_TRUNC)
        await ns.write(fh, 0, second)
        await ns.release(fh)
        assert inode.data is not None, "dropped before its content was recorded"
        await ns.flush_all()
        await trio.testing.wait_all_tasks_blocked()
        assert inode.data is None and inode.size_committed == len(second)
        assert await read_all(ns, ino) == second

        # A truncate of an idle file (no open) builds the live content first.
        await ns.setattr(ino, size=BS // 2)
        await ns.flush_all()
        await trio.testing.wait_all_tasks_blocked()
        assert inode.data is None and inode.size_committed == BS // 2
        assert await read_all(ns, ino) == second[:BS // 2]
    close_and_check(fs)

    fs = open_fs(path)
    async with running(fs):
        inode = fs.ns.inode(ino)
        assert inode.data is None and pins(fs, inode) == [0]
        assert await read_all(fs.ns, ino) == second[:BS // 2]
        assert inode.data is None
    close_and_check(fs)


async def test_a_file_open_twice_stays_live_until_its_last_close(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    data = pattern(3, BS)
    async with running(fs):
        ns = fs.ns
        ino = await write_file(ns, ROOT_INO, b"g", data)
        a, _, _ = ns.open(ino, os.O_RDONLY)
        b, _, _ = ns.open(ino, os.O_RDONLY)
        live = ns.inode(ino).data
        await ns.release(a)
        assert ns.inode(ino).data is live
        assert bytes(await ns.read(b, 0, BS)) == data
        await ns.release(b)
        assert ns.inode(ino).data is None
    close_and_check(fs)


async def test_an_idle_files_old_live_content_still_reads_right_or_fails(tmp_path):
    """Something that kept the dropped FileData (a prefetch still running) reads
    the durable blocks it names: the right bytes while the content stands, an
    error once a new content freed them, never another file's bytes."""
    path = mkfs(tmp_path)
    fs = open_fs(path)
    old, new = pattern(4, BS), pattern(5, BS)
    async with running(fs):
        ns = fs.ns
        ino = await write_file(ns, ROOT_INO, b"h", old)
        fh, _, _ = ns.open(ino, os.O_RDONLY)
        kept = ns.inode(ino).data
        await ns.release(fh)
        assert ns.inode(ino).data is None
        assert kept.size == BS and kept.blocks == list(ns.inode(ino).committed), "shedding changed the object"
        fs.cache.drop_clean()
        assert bytes(await fs.cache.read(kept, 0, BS)) == old
        await write_file(ns, ROOT_INO, b"h2", new)
        await ns.rename(ROOT_INO, b"h2", ROOT_INO, b"h")
        ns.forget(ino, 1)                                        # the kernel lets go: the old block is freed
        await ns.flush_all()
        assert kept.blocks[0] not in fs.index.entries
        fs.cache.drop_clean()
        try:
            got = bytes(await fs.cache.read(kept, 0, BS))
        except Exception as exc:                                 # the block is gone: an error is right
            got = exc
        assert got != new, "an old FileData served another file's bytes"
    close_and_check(fs)


async def test_a_seal_in_progress_keeps_the_live_content_another_seal_finished(tmp_path):
    """A rename seals the closed file first, while the file's background seal
    waits on the same slow device write. Whichever records the content, the
    other still holds the live content: the first to finish used to drop it
    under the second (AttributeError in the rename, EIO for the engine)."""
    path = mkfs(tmp_path)
    fs = open_fs(path, faults=slow_writes(0.2))
    data = pattern(6, 2 * BS)
    async with running(fs, commit_interval=60):
        ns = fs.ns
        await write_file(ns, ROOT_INO, b"final", b"old")
        ino = await write_file(ns, ROOT_INO, b"tmp.1", data, sync=False)   # its background seal starts
        assert ns.inode(ino).content_dirty
        await ns.rename(ROOT_INO, b"tmp.1", ROOT_INO, b"final")
        await trio.testing.wait_all_tasks_blocked()
        inode = ns.inode(ino)
        assert not inode.content_dirty and inode.data is None and not inode.data_holds
        assert await read_all(ns, ino) == data
    close_and_check(fs)


async def test_an_idle_file_unlinked_or_replaced_under_a_lookup_still_opens_with_its_bytes(tmp_path):
    """The kernel may open an inode after its name went (its lookup raced the
    unlink or the rename over it). An idle file then has to keep its content:
    built at that open from the durable record, whose references are gone, it
    read as zeros of the old size (tests/test_stress.py caught that)."""
    path = mkfs(tmp_path)
    fs = open_fs(path)
    old, new = pattern(7, BS + 5), pattern(8, 3 * BS)
    async with running(fs):
        ns = fs.ns
        unlinked = await write_file(ns, ROOT_INO, b"u", old)          # write_file holds one lookup
        replaced = await write_file(ns, ROOT_INO, b"r", old)
        await write_file(ns, ROOT_INO, b"r.tmp", new)
        assert ns.inode(unlinked).data is None and ns.inode(replaced).data is None
        ns.unlink(ROOT_INO, b"u", directory=False)
        await ns.rename(ROOT_INO, b"r.tmp", ROOT_INO, b"r")
        await ns.flush_all()
        await write_file(ns, ROOT_INO, b"churn", new)                 # new blocks may take freed space
        await ns.flush_all()
        for ino in (unlinked, replaced):
            assert ino in ns.tree.orphans
            assert await read_all(ns, ino) == old
        ns.forget(unlinked, 1)
        ns.forget(replaced, 1)
        assert unlinked not in ns.tree.orphans and replaced not in ns.tree.orphans
    close_and_check(fs)
