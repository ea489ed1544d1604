"""No metadata exhaustion through a mount (issue 12, "Bad names and arguments").

The largest metadata one call can add: a 4095-byte symlink target under a
255-byte name, and hard links with 255-byte names. A loop of them on a small
store must end in ENOSPC, with the daemon alive, committed files intact, a clean
unmount (the checkpoint still fits), the store mountable again and fsck clean.
Extended attributes cost nothing: kvfs stores none (EOPNOTSUPP, see the
conformance table). The errno of each bad name and argument is in
tests/test_conformance.py's table. The same holds for a flood by an unprivileged
user, and a store left with more metadata than one checkpoint slot still mounts.
"""
import errno
import os
import stat
import subprocess

import pytest

from filedata import pattern, write_file

MiB = 1 << 20


def long_name(prefix, i):
    name = f"{prefix}{i:07d}"
    return name + "n" * (255 - len(name))


def test_flood_of_huge_symlinks_and_links_ends_in_enospc(kvfs_factory):
    fs = kvfs_factory(size="64M", mount_options=["eviction_policy=none"])
    fs.mkfs()
    fs.mount()
    committed = {f"data{i}": pattern(100 + i, MiB + i) for i in range(3)}
    for name, data in committed.items():
        write_file(fs.mnt / name, data, fsync=True)
    flood = fs.mnt / "flood"
    flood.mkdir()
    made = links = 0
    failure = None
    for i in range(100_000):
        try:
            os.symlink("t" * 4095, flood / long_name("s", i))
            made += 1
            if i % 4 == 0:
                os.link(fs.mnt / "data0", flood / long_name("h", i))
                links += 1
            if i % 100 == 0:
                try:
                    os.setxattr(flood / long_name("s", i), "user.big", b"v" * 65536, follow_symlinks=False)
                except OSError as exc:
                    assert exc.errno in (errno.EOPNOTSUPP, errno.EPERM), exc    # never stored
        except OSError as exc:
            failure = exc.errno
            break
    assert failure == errno.ENOSPC, f"the flood ended with {failure} after {made} symlinks"
    assert made > 500, made
    # The daemon is alive: it answers, serves committed files, and frees space on unlink.
    stats = fs.stats()
    assert stats["metadata_bytes"] <= stats["metadata_capacity"]
    for name, data in committed.items():
        assert (fs.mnt / name).read_bytes() == data
    assert os.stat(fs.mnt / "data0").st_nlink == 1 + links
    for i in range(0, 40, 4):
        os.unlink(flood / long_name("s", i))
    os.symlink("t" * 4095, flood / "after-unlinks")
    fs.umount()                                         # the checkpoint of a full slot fits
    fs.assert_fsck_clean()
    fs.mount()
    for name, data in committed.items():
        assert (fs.mnt / name).read_bytes() == data
    assert len(os.listdir(flood)) == made - 10 + links + 1
    assert os.readlink(flood / "after-unlinks") == "t" * 4095


# -- an unprivileged user's flood; a store already over its checkpoint slot (issue 7, item 3) --

SYMLINK_FLOOD = r"""
import errno, json, os, sys, time
root, batches = sys.argv[1], int(sys.argv[2])
made, error = 0, None
for batch in range(batches):
    try:
        for _ in range(800):
            os.symlink("t" * 4000, os.path.join(root, f"l{made:06d}"))
            made += 1
    except OSError as exc:
        error = exc.errno
        break
    time.sleep(0.5)                # the review's batches, with commits in between
print(json.dumps({"made": made, "errno": error}))
"""


def test_symlink_flood_by_a_user_gets_enospc_and_the_store_stays_mountable(shared_kvfs):
    import json
    fs = shared_kvfs("commit_interval=0.2", size="64M")
    flood = fs.mnt / "flood"
    flood.mkdir(mode=0o777)
    os.chmod(flood, 0o777)
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "/usr/bin/python3", "-c", SYMLINK_FLOOD, str(flood), "10"],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["errno"] == errno.ENOSPC, result
    assert result["made"] > 1000
    stats = fs.stats()                                   # the daemon is alive and says why
    assert stats["metadata_bytes"] > 0.9 * stats["metadata_capacity"]
    ffree = os.statvfs(fs.mnt).f_ffree
    assert ffree < 100
    with pytest.raises(OSError) as e:               # about f_ffree small entries still fit
        for i in range(2 * ffree + 2):
            os.mkdir(fs.mnt / f"small{i}")
    assert e.value.errno == errno.ENOSPC
    for i in range(200):
        os.unlink(flood / f"l{i:06d}")
    os.mkdir(fs.mnt / "after-deletes")
    fs.umount()
    fs.assert_fsck_clean()
    fs.mount()
    assert len(os.listdir(flood)) == result["made"] - 200
    assert (fs.mnt / "after-deletes").is_dir()


@pytest.mark.expect_errors(
    r"kvfs\.server\.daemon: could not checkpoint after replay, serving from the journal: metadata \(\d+ bytes\) exceeds the checkpoint slot",
)
def test_store_whose_state_already_exceeds_its_checkpoint_slot_mounts(kvfs_factory):
    """A store left by the old code: journal + checkpoint hold more than one slot."""
    import trio
    from kvfs import schema
    from unit.helpers import open_fs, running

    fs = kvfs_factory(size="64M")
    fs.mkfs()

    async def overfill():
        store = open_fs(fs.device)
        ns = store.ns
        async with running(store, persist=False):
            i = 0
            while ns.metadata_bytes() < 0.9 * ns.metadata_capacity():
                ns._emit(schema.Make(1, f"l{i:06d}".encode(), ns.tree.next_ino, stat.S_IFLNK | 0o777, 0, 0,
                                     0, ns.now(), b"t" * 4000))   # straight to the journal: no charge
                i += 1
            await ns.checkpoint()
            while ns.metadata_bytes() < 1.1 * store.store.checkpoint_capacity():
                ns._emit(schema.Make(1, f"l{i:06d}".encode(), ns.tree.next_ino, stat.S_IFLNK | 0o777, 0, 0,
                                     0, ns.now(), b"t" * 4000))
                i += 1
            await ns.commit()
        store.close()
        return i

    links = trio.run(overfill)
    fs.mount()                                     # used to die in the post-replay checkpoint
    assert len(os.listdir(fs.mnt)) == links + 1    # + .kvfs
    with pytest.raises(OSError) as e:
        os.symlink("x", fs.mnt / "new")
    assert e.value.errno == errno.ENOSPC
    for i in range(600):
        os.unlink(fs.mnt / f"l{i:06d}")
    fs.admin("checkpoint", fs.mnt)                 # now it fits
    os.symlink("x", fs.mnt / "new")
    fs.umount()
    fs.assert_fsck_clean()
    fs.mount()
    assert len(os.listdir(fs.mnt)) == links - 600 + 2
