"""Issue 12, "Tenants": uids on one allow_other mount cannot read, delete, probe or poison
each other's data.

Each uid's blocks are deduplicated only within its own domain (tests/unit/test_tenants_unit.py
has the key arithmetic), so what one tenant stored shows nowhere another can
look: not in statfs, not in the keys, not in what the device is asked to do.
The unprivileged side runs the system Python (the venv's is under a root-only
directory) with a small probe script, as tests/test_by_hash_view.py does.
"""
import errno
import hashlib
import os

from kvfs import schema
from userprobe import run_probe

ALICE, BOB, CAROL = 1000, 1001, 1002
MiB = 1 << 20

# Runs as another uid: each op is [name, *args]; prints one JSON result per op.
PROBE = r"""
import hashlib, json, os, random, sys

def content(seed, size):
    return random.Random(int(seed)).randbytes(int(size))

def write(path, seed, size, mode):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, int(mode, 8))
    try:
        os.write(fd, content(seed, size))
        os.fsync(fd)
    finally:
        os.close(fd)
    return int(size)

def bfree(path):
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize

OPS = {
    "write": write,
    "sha": lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest(),
    "unlink": os.unlink,
    "rename": os.rename,
    "truncate": lambda p: os.truncate(p, 0),
    "key": lambda p: os.getxattr(p, "user.kvfs.key").decode(),
    "bfree": bfree,
    "listdir": lambda p: sorted(os.listdir(p)),
}
"""


def as_user(uid, *ops):
    """Run probe ops as ``uid``: each result is its value, or ("errno", n)."""
    return [r["ok"] if "ok" in r else ("errno", r["errno"]) for r in run_probe(uid, PROBE, ops)]


def sha_of(seed, size):
    import random
    return hashlib.sha256(random.Random(seed).randbytes(size)).hexdigest()


def test_private_files_stay_private_and_the_sticky_bit_holds(shared_kvfs):
    fs = shared_kvfs()                                    # the root is mode 1777 (sticky)
    secret = fs.mnt / "alice.bin"
    assert as_user(ALICE, ["write", secret, 1, MiB, "600"]) == [MiB]
    got = as_user(BOB, ["sha", secret], ["write", secret, 2, 10, "600"], ["truncate", secret],
                  ["unlink", secret], ["rename", secret, fs.mnt / "bob.bin"], ["key", secret])
    assert got == [("errno", errno.EACCES), ("errno", errno.EACCES), ("errno", errno.EACCES),
                   ("errno", errno.EPERM), ("errno", errno.EPERM), ("errno", errno.EACCES)]
    # Nothing Bob tried changed Alice's file; she still may do all of it.
    assert as_user(ALICE, ["sha", secret]) == [sha_of(1, MiB)]
    assert as_user(ALICE, ["rename", secret, fs.mnt / "moved"], ["unlink", fs.mnt / "moved"]) == [None, None]
    fs.umount()
    fs.assert_fsck_clean()


def test_a_tenant_cannot_learn_what_another_stored(shared_kvfs):
    """Bob writes bytes Alice stored: space, keys and device writes behave as for new bytes."""
    fs = shared_kvfs("eviction_policy=none")
    size = 4 * MiB
    for uid in (ALICE, BOB):
        os.mkdir(fs.mnt / str(uid), 0o700)
        os.chown(fs.mnt / str(uid), uid, uid)
    alice, bob = fs.mnt / str(ALICE), fs.mnt / str(BOB)
    assert as_user(ALICE, ["write", alice / "x", 7, size, "600"]) == [size]

    def bob_writes(name, seed):
        before = fs.stats()
        free_before, written, free_after = as_user(BOB, ["bfree", fs.mnt], ["write", bob / name, seed, size, "600"],
                                                   ["bfree", fs.mnt])
        after = fs.stats()
        assert written == size
        return (free_before - free_after, after["blocks_written"] - before["blocks_written"],
                after["dedup_hits"] - before["dedup_hits"])

    known = bob_writes("same-as-alice", 7)           # bytes Alice has
    fresh = bob_writes("new", 8)                     # bytes nobody has
    assert known == fresh == (size, 4, 0), (known, fresh)
    keys = as_user(BOB, ["key", bob / "same-as-alice"]) + as_user(ALICE, ["key", alice / "x"])
    assert keys[0] != keys[1] and all(len(k) == 32 for k in keys)
    # The owner's own copies still deduplicate.
    before = fs.stats()
    assert as_user(ALICE, ["write", alice / "x2", 7, size, "600"]) == [size]
    after = fs.stats()
    assert (after["blocks_written"] - before["blocks_written"], after["dedup_hits"] - before["dedup_hits"]) == (0, 4)
    assert as_user(ALICE, ["key", alice / "x2"]) == [keys[1]]
    for uid, path, seed in ((ALICE, alice / "x", 7), (BOB, bob / "same-as-alice", 7), (BOB, bob / "new", 8)):
        assert as_user(uid, ["sha", path]) == [sha_of(seed, size)]
    fs.umount()
    fs.assert_fsck_clean()


def test_dedup_groups_share_only_inside_the_group(shared_kvfs):
    fs = shared_kvfs(f"dedup_groups={ALICE}+{BOB}")
    size = 2 * MiB
    results = {}
    for uid in (ALICE, BOB, CAROL):
        before = fs.stats()
        assert as_user(uid, ["write", fs.mnt / f"f{uid}", 3, size, "600"]) == [size]
        results[uid] = fs.stats()["dedup_hits"] - before["dedup_hits"]
    assert results == {ALICE: 0, BOB: 2, CAROL: 0}
    fs.umount()
    fs.assert_fsck_clean()


def test_dedup_verify_bytes_reads_the_stored_copy_on_every_hit(shared_kvfs):
    fs = shared_kvfs("dedup_verify=bytes")
    data = os.urandom(3 * MiB)
    for name in ("a", "b"):
        (fs.mnt / name).write_bytes(data)
    fs.flush()
    stats = fs.stats()
    assert (stats["dedup_hits"], stats["dedup_verify_reads"], stats["dedup_collisions"]) == (3, 3, 0)
    assert (fs.mnt / "b").read_bytes() == data
    fs.umount()
    fs.assert_fsck_clean()


def test_the_store_file_and_its_secret_are_root_only(kvfs_factory):
    fs = kvfs_factory()
    with open(fs.device, "wb") as f:               # an operator's pre-made, world-readable file
        f.truncate(4 << 30)
    os.chmod(fs.device, 0o644)
    fs.mkfs()
    assert os.stat(fs.device).st_mode & 0o777 == 0o600
    with open(fs.device, "rb") as f:
        sb = schema.Superblock.decode(f.read(schema.SECTOR))
    assert sb.version == 2 and len(sb.key_secret) == 32 and any(sb.key_secret)
    os.chmod(fs.device, 0o640)                     # loosened again: the mount says what that exposes
    fs.mount()
    fs.umount()
    assert "content-key secret; chmod 600 it" in fs.log.read_text()
    fs.assert_fsck_clean()
