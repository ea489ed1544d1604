"""The unmount's checkpoint is written only when the journal holds something since the last one.

Durability.checkpoint_unless_folded: an empty journal means the last checkpoint
already says everything, so none is written; any record since then (committed
or still queued) means one is. Pins, which only checkpoints record, revert when
their checkpoint fails, so an empty journal never hides an unrecorded pin.
"""
import os

import pytest

from kvfs.errors import KvfsError
from kvfs.namespace import ROOT_INO

from .helpers import FILE_MODE, close_and_check, mkfs, open_fs, pattern, running


async def write_file(ns, name, data):
    ino = ns.make(ROOT_INO, name, FILE_MODE, 0, 0)
    fh, _, _ = ns.open(ino, os.O_WRONLY)
    await ns.write(fh, 0, data)
    await ns.release(fh)
    return ino


async def test_an_empty_journal_needs_no_checkpoint_and_a_record_does(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    store = fs.store
    async with running(fs, persist=False):
        await write_file(fs.ns, b"a", pattern(1, 5000))
        await fs.ns.flush_all()
        assert await fs.ns.checkpoint_unless_folded() is True        # the create and content records
        written = store.statistics().checkpoints
        generation = store.generation
        assert await fs.ns.checkpoint_unless_folded() is False       # nothing since
        assert fs.ns.lookup(ROOT_INO, b"a") is not None               # reads record nothing
        assert await fs.ns.checkpoint_unless_folded() is False
        assert (store.statistics().checkpoints, store.generation) == (written, generation)
        await write_file(fs.ns, b"b", pattern(2, 5000))
        await fs.ns.flush_all()                                       # committed to the journal
        assert store.journal_fill > 0
        assert await fs.ns.checkpoint_unless_folded() is True
        fs.ns.unlink(ROOT_INO, b"a", directory=False)                 # queued, not yet committed
        assert await fs.ns.checkpoint_unless_folded() is True
        assert store.statistics().checkpoints == written + 2
        assert store.journal_fill == 0
    close_and_check(fs)
    again = open_fs(path)
    try:
        assert again.replayed.get("records", 0) == 0                  # the checkpoint holds it all
        with pytest.raises(KvfsError):
            again.ns.lookup(ROOT_INO, b"a")
        ino = again.ns.lookup(ROOT_INO, b"b")
        fh, _, _ = again.ns.open(ino, os.O_RDONLY)
        assert bytes(await again.ns.read(fh, 0, 5000)) == pattern(2, 5000)
        await again.ns.release(fh)
    finally:
        close_and_check(again)


async def test_a_pin_whose_checkpoint_fails_is_undone(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs, persist=False):
        ino = await write_file(fs.ns, b"a", pattern(1, 5000))
        await fs.ns.flush_all()
        await fs.ns.checkpoint()
        fs.device.fence("test: the device is gone")
        with pytest.raises(KvfsError):
            await fs.ns.admin.pin([ino])
        assert fs.ns.tree.pinned == set()
    fs.close()
