"""A clean unmount writes a checkpoint only when the journal holds something since the last one.

At a million files a checkpoint takes seconds; an unmount right after
``kvfs-admin checkpoint`` (or after nothing but reads) has nothing to fold.
The in-process rules are in tests/unit/test_unmount_checkpoint.py; here the
real daemon, through real syscalls, across remounts.
"""
import os

SKIPPED = "the journal is empty: the last checkpoint stands, none written"


def logged(kvfs):
    return "".join(p.read_text(errors="replace") for p in sorted(kvfs.logs) if p.exists())


def test_an_unmount_after_a_checkpoint_writes_none_and_loses_nothing(kvfs):
    files = {f"f{i}": os.urandom(5000 + i) for i in range(50)}
    for name, data in files.items():
        (kvfs.mnt / name).write_bytes(data)
    kvfs.admin("checkpoint", str(kvfs.mnt))
    generation = kvfs.stats()["generation"]
    for name, data in files.items():                   # reads record nothing
        assert (kvfs.mnt / name).read_bytes() == data
    kvfs.umount()
    assert logged(kvfs).count(SKIPPED) == 1
    kvfs.mount()
    assert kvfs.stats()["generation"] == generation    # no checkpoint at unmount, none after mount
    assert {p.name: p.read_bytes() for p in kvfs.mnt.iterdir() if p.name != ".kvfs"} == files

    (kvfs.mnt / "late").write_bytes(b"written after the checkpoint")
    os.unlink(kvfs.mnt / "f0")
    kvfs.umount()                                      # records since: a checkpoint
    assert logged(kvfs).count(SKIPPED) == 1
    kvfs.mount()
    assert kvfs.stats()["generation"] == generation + 1
    assert kvfs.stats()["journal_bytes"] == 0
    assert (kvfs.mnt / "late").read_bytes() == b"written after the checkpoint"
    assert not (kvfs.mnt / "f0").exists()
    kvfs.umount()
    kvfs.assert_fsck_clean()
