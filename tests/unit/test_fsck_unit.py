"""fsck: detection and repair of damaged data and inconsistent metadata.

Each test builds a real store, damages it (flipped bytes on the device, or a
checkpoint written from a deliberately inconsistent state), runs the checker,
repairs, and ends with a clean check. These are synchronous tests because
``fsck.check(repair=True)`` runs its own trio loop.
"""
import dataclasses
import errno
import hashlib

import pytest
import trio

from kvfs.server import fsck
from kvfs.errors import Busy, FormatError
from kvfs.namespace import ROOT_INO

from .helpers import (BS, DIR_MODE, assert_fsck_clean, close_and_check, flip_byte, lookup_path, mkfs,
                      open_fs, pattern, read_all, running, write_file)


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


async def populate(path):
    """/a (+ hard link /d/a-link), /b, /c (same content as /b); returns inode numbers and keys."""
    fs = open_fs(path)
    ns = fs.ns
    async with running(fs):
        d = ns.make(ROOT_INO, b"d", DIR_MODE, 0, 0)
        a = await write_file(ns, ROOT_INO, b"a", pattern(1, 2 * BS + 100))
        ns.link(a, d, b"a-link")
        b = await write_file(ns, ROOT_INO, b"b", pattern(2, BS))
        c = await write_file(ns, ROOT_INO, b"c", pattern(2, BS))
        inodes = ns.tree.inodes
        info = {"a": list(inodes[a].committed), "b": list(inodes[b].committed),
                "extent": {k: fs.index.extent(k) for k in inodes[a].committed + inodes[b].committed}}
        assert inodes[b].committed == inodes[c].committed          # deduplicated
        for ino in (d, a, b, c):
            ns.forget(ino, inodes[ino].lookups)
    fs.close()
    return info


def test_fresh_and_populated_stores_check_clean(tmp_path):
    path = mkfs(tmp_path)
    report = assert_fsck_clean(path)
    assert any("journal" in n for n in report.notes)
    trio.run(populate, path)
    before = digest(path)
    report = assert_fsck_clean(path)
    assert report.repairs == []
    assert digest(path) == before                 # a plain check writes nothing


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
def test_flipped_byte_in_a_block_is_found_and_repair_removes_the_file(tmp_path):
    path = mkfs(tmp_path)
    info = trio.run(populate, path)
    bad_key = info["a"][1]
    off, _ = info["extent"][bad_key]
    flip_byte(path, off + 777)

    report = fsck.check(str(path))
    assert not report.clean
    text = "\n".join(report.problems)
    assert bad_key.hex() in text
    assert "/a: has corrupt blocks" in text and "/d/a-link: has corrupt blocks" in text
    assert "/b" not in text and "/c" not in text
    assert fsck.check(str(path)).problems == report.problems       # checking changed nothing

    report = fsck.check(str(path), repair=True)
    assert any("removed damaged file" in r for r in report.repairs)
    assert any("wrote checkpoint" in r for r in report.repairs)
    assert_fsck_clean(path)

    async def after():
        fs = open_fs(path)
        ns = fs.ns
        assert lookup_path(ns, "a") is None and lookup_path(ns, "d/a-link") is None
        assert await read_all(ns, lookup_path(ns, "b")) == pattern(2, BS)
        assert await read_all(ns, lookup_path(ns, "c")) == pattern(2, BS)
        # Only the b/c block remains; every extent of /a went back to free space.
        assert set(fs.index.entries) == set(info["b"])
        assert fs.store.statistics().free_bytes == fs.store.sb.data_len - BS
        # The repaired store is fully usable: the damaged block's content can be stored again.
        async with running(fs):
            await write_file(ns, ROOT_INO, b"a", pattern(1, 2 * BS + 100))
        close_and_check(fs)
    trio.run(after)


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
def test_corrupt_shared_block_removes_every_file_naming_it(tmp_path):
    path = mkfs(tmp_path)
    info = trio.run(populate, path)
    off, _ = info["extent"][info["b"][0]]
    flip_byte(path, off)
    report = fsck.check(str(path))
    text = "\n".join(report.problems)
    assert "/b: has corrupt blocks" in text and "/c: has corrupt blocks" in text
    assert "/a:" not in text
    fsck.check(str(path), repair=True)
    assert_fsck_clean(path)

    async def after():
        fs = open_fs(path)
        assert lookup_path(fs.ns, "b") is None and lookup_path(fs.ns, "c") is None
        assert await read_all(fs.ns, lookup_path(fs.ns, "a")) == pattern(1, 2 * BS + 100)
        close_and_check(fs)
    trio.run(after)


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
def test_no_data_check_skips_block_verification(tmp_path):
    path = mkfs(tmp_path)
    info = trio.run(populate, path)
    off, _ = info["extent"][info["a"][0]]
    flip_byte(path, off + 5)
    assert fsck.check(str(path), verify_data=False).clean
    assert not fsck.check(str(path)).clean
    flip_byte(path, off + 5)
    assert_fsck_clean(path)


async def write_inconsistent_checkpoint(path, mutate):
    """Populate, then write a checkpoint of a deliberately inconsistent state.

    The state is the real one, as the namespace and the block index hand it to
    the store (``schema.CheckpointState``); ``mutate(state, fs)`` edits its rows
    by field name and may return extents the checkpoint's free map must also
    list (the store's ``transient`` argument: extents only RAM knows about).
    """
    fs = open_fs(path)
    async with running(fs, persist=False):
        ns = fs.ns
        d = ns.make(ROOT_INO, b"d", DIR_MODE, 0, 0)
        f = await write_file(ns, d, b"f", pattern(3, 2 * BS))
        g = await write_file(ns, ROOT_INO, b"g", pattern(4, BS))
        for ino in (d, f, g):
            ns.forget(ino, 1)
        await ns.flush_all()
        assert fs.store.statistics().records_pending == 0 and fs.store.pending_free_bytes == 0
        blocks, transient = fs.index.snapshot()
        state = dataclasses.replace(ns.tree.snapshot(), blocks=blocks)
        extra_free = mutate(state, fs) or []
        await fs.store.checkpoint(state, [*transient, *extra_free])
    fs.close()


def rows(state):
    """The checkpoint's InodeRows by inode number (editing one edits the state)."""
    return {row.ino: row for row in state.inodes}


def repair_and_expect_clean(path, *expected):
    report = fsck.check(str(path))
    text = "\n".join(report.problems)
    for phrase in expected:
        assert phrase in text, text
    fsck.check(str(path), repair=True)
    return assert_fsck_clean(path)


def test_leaked_extent_is_found_and_returned_to_free_space(tmp_path):
    path = mkfs(tmp_path)

    def leak(state, fs):
        leak.off = fs.store.allocate(3 * BS)     # allocated, named by nothing: not in the free map
    trio.run(write_inconsistent_checkpoint, path, leak)
    repair_and_expect_clean(path, f"{3 * BS} bytes at {leak.off} are neither used nor free (leaked)")

    async def after():
        fs = open_fs(path)
        used = fs.index.statistics().used_bytes
        assert fs.store.statistics().free_bytes == fs.store.sb.data_len - used
        assert await read_all(fs.ns, lookup_path(fs.ns, "d/f")) == pattern(3, 2 * BS)
        close_and_check(fs)
    trio.run(after)


def test_overlapping_free_and_used_extents_are_repaired(tmp_path):
    path = mkfs(tmp_path)

    def overlap(state, fs):
        return [(state.blocks[0].off, 4096)]                    # a used block also listed free
    trio.run(write_inconsistent_checkpoint, path, overlap)
    repair_and_expect_clean(path, "overlaps the previous one")


def test_wrong_reference_count_is_recomputed(tmp_path):
    path = mkfs(tmp_path)

    def bump(state, fs):
        block = state.blocks[0]
        assert block.refs == 1
        state.blocks[0] = dataclasses.replace(block, refs=block.refs + 2)
        bump.key = block.key
    trio.run(write_inconsistent_checkpoint, path, bump)
    repair_and_expect_clean(path, f"block {bump.key.hex()}: reference count 3, files name it 1 times")

    async def after():
        fs = open_fs(path)
        assert fs.index.entries[bump.key].refs == 1
        assert await read_all(fs.ns, lookup_path(fs.ns, "d/f")) == pattern(3, 2 * BS)
        close_and_check(fs)
    trio.run(after)


def test_too_low_reference_count_is_found(tmp_path):
    """A count below the names would free the block while a file still names it (a double free)."""
    path = mkfs(tmp_path)

    def drop(state, fs):
        block = state.blocks[0]
        state.blocks[0] = dataclasses.replace(block, refs=0)
        drop.key = block.key
    trio.run(write_inconsistent_checkpoint, path, drop)
    repair_and_expect_clean(path, f"block {drop.key.hex()}: reference count 0, files name it 1 times")


def test_wrong_link_counts_are_recomputed(tmp_path):
    path = mkfs(tmp_path)

    def links(state, fs):
        by_ino = rows(state)
        assert by_ino[ROOT_INO].nlink == 3                # root: 2 + one subdirectory
        by_ino[ROOT_INO].nlink = 7
        f = lookup_path(fs.ns, "d/f")
        assert by_ino[f].nlink == 1                       # one name only
        by_ino[f].nlink = 2
    trio.run(write_inconsistent_checkpoint, path, links)
    repair_and_expect_clean(path, "/: link count 7, expected 3", "/d/f: link count 2, expected 1")


def test_unreachable_inode_is_dropped(tmp_path):
    path = mkfs(tmp_path)

    def detach(state, fs):
        by_ino = rows(state)
        d = lookup_path(fs.ns, "d")
        detach.f = lookup_path(fs.ns, "d/f")
        detach.keys = list(fs.ns.tree.inodes[detach.f].committed)
        assert by_ino[d].entries == [(b"f", detach.f)]
        by_ino[d].payload = [by_ino[d].parent, []]        # d no longer lists f
    trio.run(write_inconsistent_checkpoint, path, detach)
    repair_and_expect_clean(path, f"inode {detach.f} is not reachable from the root")

    async def after():
        fs = open_fs(path)
        assert detach.f not in fs.ns.tree.inodes
        assert all(k not in fs.index.entries for k in detach.keys)      # its blocks were freed
        assert await read_all(fs.ns, lookup_path(fs.ns, "g")) == pattern(4, BS)
        close_and_check(fs)
    trio.run(after)


def test_next_inode_number_at_or_below_one_in_use_is_refused_by_mount_and_repaired(tmp_path):
    """A checkpoint whose next_ino is not above every inode it holds (the fuzzer made
    next_ino 0): fsck saw an empty tree and crashed (max() of nothing), because its
    snapshot left out inodes at or above next_ino, as a live cut must. Now fsck lists
    them all and reports it, mount refuses, and --repair makes it mountable again."""
    path = mkfs(tmp_path)

    def zero(state, fs):
        zero.top = max(row.ino for row in state.inodes)
        state.next_ino = 0
    trio.run(write_inconsistent_checkpoint, path, zero)
    with pytest.raises(FormatError, match=f"next inode number 0 is not above inode {zero.top} in use"):
        open_fs(path)
    repair_and_expect_clean(path, f"next inode number 0 is not above the largest in use ({zero.top})")

    async def after():
        fs = open_fs(path)
        assert fs.ns.tree.next_ino == zero.top + 1
        assert await read_all(fs.ns, lookup_path(fs.ns, "d/f")) == pattern(3, 2 * BS)
        assert await read_all(fs.ns, lookup_path(fs.ns, "g")) == pattern(4, BS)
        close_and_check(fs)
    trio.run(after)


def _add_ghost(state, fs):
    row = rows(state)[lookup_path(fs.ns, "d")]
    row.payload = [row.parent, [*row.entries, (b"ghost", 999)]]


def test_dangling_entry_is_reported_by_a_plain_check(tmp_path):
    path = mkfs(tmp_path)
    trio.run(write_inconsistent_checkpoint, path, _add_ghost)
    report = fsck.check(str(path))
    assert any("entry b'ghost' names missing inode 999" in p for p in report.problems)


def test_dangling_entry_is_removed_by_repair(tmp_path):
    path = mkfs(tmp_path)
    trio.run(write_inconsistent_checkpoint, path, _add_ghost)
    report = fsck.check(str(path), repair=True)
    assert any("entry b'ghost' names missing inode 999" in p for p in report.problems)
    assert_fsck_clean(path)

    async def after():
        fs = open_fs(path)
        assert lookup_path(fs.ns, "d/ghost") is None
        assert await read_all(fs.ns, lookup_path(fs.ns, "d/f")) == pattern(3, 2 * BS)
        close_and_check(fs)
    trio.run(after)


@pytest.mark.expect_errors(r"kvfs\.namespace(\.\w+)?: inode \d+ names blocks missing from the index")
def test_file_naming_a_missing_block_is_removed(tmp_path):
    path = mkfs(tmp_path)

    def drop(state, fs):
        f = lookup_path(fs.ns, "d/f")
        key = fs.ns.tree.inodes[f].committed[0]
        state.blocks = [b for b in state.blocks if b.key != key]
        return [fs.index.extent(key)]                    # its extent is listed free
    trio.run(write_inconsistent_checkpoint, path, drop)
    repair_and_expect_clean(path, "/d/f: has missing blocks")

    async def after():
        fs = open_fs(path)
        assert lookup_path(fs.ns, "d/f") is None
        assert lookup_path(fs.ns, "d") is not None
        assert await read_all(fs.ns, lookup_path(fs.ns, "g")) == pattern(4, BS)
        close_and_check(fs)
    trio.run(after)


def test_check_refuses_a_mounted_store(tmp_path):
    path = mkfs(tmp_path)

    async def held():
        fs = open_fs(path)
        try:
            with pytest.raises(Busy, match="in use") as info:
                fsck.check(str(path))
            assert info.value.errno == errno.EBUSY
        finally:
            fs.close()
    trio.run(held)
    assert_fsck_clean(path)
