"""kvfs.store.opening: the store loads while the multi-mount claim waits, and is loaded
again if its metadata moved meanwhile (a forced-out owner committing until it notices).

Time passes only when the claim sleeps (World, from helpers); what another writer does
meanwhile runs in that sleep, on a second handle of the same store file.
"""
import time

import pytest
import trio

from kvfs import schema
from kvfs.device import Device
from kvfs.errors import Busy, FormatError
from kvfs.namespace import ROOT_INO
from kvfs.store import mmp
from kvfs.store.loader import load, read_superblock
from kvfs.store.opening import claim_and_load, release_quietly

from .helpers import World, flip_byte, mkfs, mmp_settings, on_disk, open_fs, running, write_file


def another_writer_commits(path, name, *, checkpoint):
    """A second, unclaimed handle makes a file and commits it (and checkpoints, if asked)."""
    fs = open_fs(path)

    async def work():
        async with running(fs, persist=False):
            await write_file(fs.ns, ROOT_INO, name, b"late" * 100)
            await fs.ns.flush_all()                  # the journal gets its frames
            if checkpoint:
                await fs.ns.checkpoint()
    trio.run(work)
    fs.close()


def names_in(loaded):
    made = {r.name for r in loaded.records if isinstance(r, schema.Make)}
    rows = loaded.state.inodes if loaded.state else []
    return made, rows


@pytest.fixture
def store(tmp_path):
    path = mkfs(tmp_path)
    another_writer_commits(path, b"before", checkpoint=True)
    device = Device.open(str(path), lock=False)
    yield path, device, read_superblock(device)
    device.close()


def test_an_untouched_store_loads_once_as_a_plain_load_would(store, caplog):
    path, device, sb = store
    world = World()
    loaded, guard = claim_and_load(device, sb, mmp_settings(world, "host-a"))
    try:
        plain = load(device)
        assert loaded.generation == plain.generation and loaded.records == plain.records
        assert loaded.state == plain.state
        assert sum(world.slept) == mmp.claim_wait(0.25)
        assert "loading it again" not in caplog.text
        first = guard.heartbeats
        deadline = time.monotonic() + 10
        while guard.heartbeats == first:             # the guard heartbeats on its own already
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert on_disk(device, sb).host_id == "host-a"
    finally:
        release_quietly(guard)
    assert on_disk(device, sb).state == schema.MMP_CLEAN


@pytest.mark.parametrize("checkpoint", [False, True], ids=["journal-frame", "checkpoint"])
def test_a_commit_while_the_claim_waits_is_seen(store, caplog, checkpoint):
    path, device, sb = store
    generation_before = load(device).generation
    world = World()
    done = []

    def during_sleep():
        if not done:                                 # once, at the claim's first sleep
            done.append(True)
            another_writer_commits(path, b"late", checkpoint=checkpoint)
    world.during_sleep = during_sleep
    loaded, guard = claim_and_load(device, sb, mmp_settings(world, "host-a"))
    try:
        assert done
        assert "loading it again" in caplog.text
        made, _ = names_in(loaded)
        fresh = load(device)
        assert (loaded.generation, loaded.records, loaded.state) == (fresh.generation, fresh.records, fresh.state)
        if not checkpoint:
            assert b"late" in made                   # the new journal frame's Make record
        else:
            assert loaded.generation > generation_before
    finally:
        release_quietly(guard)


def test_a_damaged_store_fails_its_load_and_the_claim_is_released(store):
    path, device, sb = store
    flip_byte(path, sb.checkpoint_b_off + schema.SECTOR + 10)   # the payload of the active slot
    flip_byte(path, sb.checkpoint_a_off + schema.SECTOR + 10)   # and of the other one
    world = World()
    with pytest.raises(FormatError):
        claim_and_load(device, sb, mmp_settings(world, "host-a"))
    assert on_disk(device, sb).state == schema.MMP_CLEAN           # released, not left in use


def test_a_live_owner_refuses_the_claim_after_the_load(store):
    path, device, sb = store
    owner = mmp.claim(device, sb, mmp_settings(World(), "host-a"))
    world = World()
    world.during_sleep = owner.heartbeat_sync        # host-a heartbeats while host-b watches
    with pytest.raises(Busy):
        claim_and_load(device, sb, mmp_settings(world, "host-b"))
    assert on_disk(device, sb).host_id == "host-a"
    owner.release_sync()


def test_what_the_caller_builds_runs_on_the_load_and_again_after_a_reload(store, caplog):
    """The daemon builds its index and namespace in ``prepare``, while the claim
    waits; if the metadata moved, what it built from the first load is dropped and
    built again from the second."""
    path, device, sb = store
    world = World()
    built = []

    def prepare(loaded):
        built.append(names_in(loaded)[0])
        return ("built", loaded)

    def during_sleep():
        if len(world.slept) == 1:
            another_writer_commits(path, b"late", checkpoint=False)
    world.during_sleep = during_sleep
    (tag, loaded), guard = claim_and_load(device, sb, mmp_settings(world, "host-a"), prepare=prepare)
    try:
        assert tag == "built" and "loading it again" in caplog.text
        # (Whether the first load saw the new frame depends on which thread got there first.)
        assert len(built) == 2 and b"late" in built[1]
        assert b"late" in names_in(loaded)[0]           # the result is the second build's
    finally:
        release_quietly(guard)


def test_a_build_that_fails_releases_the_claim(store):
    path, device, sb = store
    world = World()

    def prepare(loaded):
        raise FormatError("the namespace is inconsistent")
    with pytest.raises(FormatError, match="inconsistent"):
        claim_and_load(device, sb, mmp_settings(world, "host-a"), prepare=prepare)
    assert on_disk(device, sb).state == schema.MMP_CLEAN
