"""A mount's checkpoint checks in a forked child (kvfs/store/childcheck.py) against the same checks in process.

The child path is taken for payloads of MIN_PAYLOAD bytes and more; these
tests lower the bar to 0 so the small fuzzing image takes it, and compare the
two ways on the same damaged checkpoints: refused alike (the same message for
a single defect), accepted alike.
"""
import os
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfs.store import childcheck

from .fuzzing import FUZZ
from .helpers import (close_and_check, hostile_state, hostile_writes, loaded_state, lookup_path, mkfs, open_fs,
                      pattern, read_all, real_wire, running, write_checkpoint, write_file)

IN_PROCESS = 1 << 62


def mount_outcome(path, monkeypatch, min_payload):
    """('mounted', how the rows were checked) or (exception type name, message) of a read-only mount."""
    monkeypatch.setattr(childcheck, "MIN_PAYLOAD", min_payload)
    try:
        fs = open_fs(path, readonly=True)
    except Exception as exc:        # noqa: BLE001 - the outcome is what is compared
        return type(exc).__name__, str(exc)
    how = fs.replayed.get("checkpoint_check")
    fs.close()
    return "mounted", how


def damaged_outcomes(img, wire, monkeypatch):
    state = loaded_state(img)
    writes = write_checkpoint(img, state, wire)
    assert writes is not None
    with img.damaged(writes):
        return (mount_outcome(img.path, monkeypatch, IN_PROCESS),
                mount_outcome(img.path, monkeypatch, 0))


async def test_a_store_checked_by_a_child_mounts_with_every_file(tmp_path, monkeypatch):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    files = {b"one": pattern(1, 5000), b"two": pattern(2, 3 * 65536 + 17), b"empty": b""}
    async with running(fs):
        for name, data in files.items():
            await write_file(fs.ns, 1, name, data)
    close_and_check(fs)
    monkeypatch.setattr(childcheck, "MIN_PAYLOAD", 0)
    fs = open_fs(path)
    assert fs.replayed["checkpoint_check"] == "child process"
    async with running(fs, persist=False):
        for name, data in files.items():
            assert await read_all(fs.ns, lookup_path(fs.ns, name.decode())) == data
    close_and_check(fs)
    monkeypatch.setattr(childcheck, "MIN_PAYLOAD", IN_PROCESS)
    fs = open_fs(path)
    assert "checkpoint_check" not in fs.replayed
    close_and_check(fs)


def _bad_mode(wire):
    next(r for r in wire["inodes"] if r[1] & 0o170000 == 0o100000)[1] = "rw-r--r--"


def _bad_block_refs(wire):
    wire["blocks"][0][3] = -1


def _overlap(wire):
    wire["blocks"][1][1] = wire["blocks"][0][1]


def _too_many_blocks(wire):
    row = next(r for r in wire["inodes"] if r[1] & 0o170000 == 0o100000 and len(r[9][1]) == 1)
    row[9][1].append(row[9][1][0])


def _not_a_row(wire):
    wire["inodes"].append(7)


@pytest.mark.parametrize("edit", [_bad_mode, _bad_block_refs, _overlap, _too_many_blocks, _not_a_row],
                         ids=lambda f: f.__name__.strip("_"))
def test_one_defect_is_refused_alike_with_the_same_message(image, monkeypatch, edit):
    wire = real_wire(image)
    edit(wire)
    in_process, in_child = damaged_outcomes(image, wire, monkeypatch)
    assert in_process[0] == "FormatError"
    assert in_child == in_process


def test_a_child_that_dies_leaves_the_checks_to_the_mount(image, monkeypatch):
    parent, refusal = os.getpid(), childcheck._refusal

    def die_in_the_child(check):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return refusal(check)
    monkeypatch.setattr(childcheck, "_refusal", die_in_the_child)
    assert mount_outcome(image.path, monkeypatch, 0) == ("mounted", "here (the child died)")
    wire = real_wire(image)
    _bad_block_refs(wire)
    in_process, in_child = damaged_outcomes(image, wire, monkeypatch)
    assert in_process[0] == "FormatError" and in_child == in_process


@pytest.mark.expect_errors(r"names blocks missing from the index")     # a dropped block row
@FUZZ
@given(data=st.data())
def test_hostile_checkpoints_are_refused_or_mounted_alike(image, data): 
    writes = hostile_writes(image, data.draw(hostile_state(real_wire(image))))
    if writes is None:
        return
    with pytest.MonkeyPatch.context() as monkeypatch, image.damaged(writes):
        in_process = mount_outcome(image.path, monkeypatch, IN_PROCESS)
        in_child = mount_outcome(image.path, monkeypatch, 0)
    # Refused alike (with several defects the first one met may differ), or mounted alike.
    assert in_child[0] == in_process[0], (in_process, in_child)
    if in_process[0] == "mounted":
        assert in_process[1] is None and in_child[1] == "child process"


def test_inode_rows_that_are_not_an_array_are_judged_as_in_process(image, monkeypatch):
    """Found by the fuzzer: a map where the rows' array belongs is decoded whole, not streamed."""
    for rows in ({}, {1: 2}, "x"):
        wire = real_wire(image)
        wire["inodes"] = rows
        in_process, in_child = damaged_outcomes(image, wire, monkeypatch)
        assert in_child[0] == in_process[0], rows
