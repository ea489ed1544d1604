"""Dedup domains, the public content key and dedup_verify, in-process (issue 12, "Tenants").

The mounted side (other uids through a real allow_other mount, statfs) is
tests/test_tenants.py.
"""
import errno
import hashlib
import os

import pytest
import xxhash

from kvfs.server import fsck
from kvfs.blockindex import DedupDomains
from kvfs.errors import CorruptBlock, DedupCollision, InvalidArgument
from kvfs.namespace import ROOT_INO
from kvfs.namespace.contentindex import HOLE_KEY

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, read_all, running

ALICE, BOB, CAROL = 1000, 1001, 1002


def key(fs, ino):
    """The content key of a file (computed on demand: see kvfs/namespace/contentindex.py)."""
    return fs.ns.tree.content.key(fs.ns.tree.inodes[ino])


async def write_as(ns, uid, name, data):
    ino = ns.make(ROOT_INO, name, 0o100600, uid, uid)
    fh, _, _ = ns.open(ino, os.O_WRONLY)
    await ns.write(fh, 0, data)
    await ns.fsync(fh)
    await ns.release(fh)
    return ino


def block_keys(fs, ino):
    return fs.ns.tree.inodes[ino].committed


async def test_each_uid_is_its_own_dedup_domain(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    data = pattern(1, 3 * BS)
    async with running(fs):
        a1 = await write_as(fs.ns, ALICE, b"a1", data)
        written = fs.index.statistics().blocks_written
        b1 = await write_as(fs.ns, BOB, b"b1", data)
        # Bob's identical bytes are stored again, under other keys: nothing he can
        # observe (space, timing, keys) depends on what Alice stored.
        assert fs.index.statistics().blocks_written == written + 3
        assert fs.index.statistics().dedup_hits == 0
        assert not set(block_keys(fs, a1)) & set(block_keys(fs, b1))
        assert key(fs, a1) != key(fs, b1)
        # Within one uid, dedup works as before.
        a2 = await write_as(fs.ns, ALICE, b"a2", data)
        assert fs.index.statistics().blocks_written == written + 3
        assert fs.index.statistics().dedup_hits == 3
        assert block_keys(fs, a2) == block_keys(fs, a1)
        assert key(fs, a2) == key(fs, a1)
        for ino in (a1, b1, a2):
            assert await read_all(fs.ns, ino) == data
    close_and_check(fs)
    fs = open_fs(fs.device.path)              # domains survive a remount: reads verify
    try:
        for ino in (a1, b1, a2):
            assert await read_all(fs.ns, ino) == data
    finally:
        close_and_check(fs)


async def test_dedup_groups_share_within_a_group_and_not_beyond(tmp_path):
    fs = open_fs(mkfs(tmp_path), dedup_groups=DedupDomains.parse(f"{ALICE}+{BOB}"))
    data = pattern(2, 2 * BS)
    async with running(fs):
        a = await write_as(fs.ns, ALICE, b"a", data)
        b = await write_as(fs.ns, BOB, b"b", data)
        c = await write_as(fs.ns, CAROL, b"c", data)
        assert fs.index.statistics().dedup_hits == 2          # Bob's, not Carol's
        assert block_keys(fs, a) == block_keys(fs, b) != block_keys(fs, c)
    close_and_check(fs)


def test_domain_numbers_name_the_group_not_a_uid(tmp_path):
    secret = os.urandom(32)
    solo, pair = DedupDomains(secret), DedupDomains(secret, DedupDomains.parse(f"{ALICE}+{BOB}"))
    assert solo.of(ALICE) != solo.of(BOB)
    assert pair.of(ALICE) == pair.of(BOB) != solo.of(ALICE)    # a new group is a new domain
    assert DedupDomains(os.urandom(32)).of(ALICE) != solo.of(ALICE)   # keyed by the secret
    everyone = DedupDomains(secret, "all")
    assert everyone.of(ALICE) == everyone.of(CAROL) != 0
    assert DedupDomains(b"").of(ALICE) == 0                    # a version 1 store: no domains
    for bad in ("1000+x", "1000+1001:1001", "-1"):
        with pytest.raises(InvalidArgument, match="dedup_groups"):
            DedupDomains.parse(bad)


async def test_the_public_key_is_a_keyed_prf_of_the_internal_one(tmp_path):
    """user.kvfs.key is BLAKE2b(internal key) under the secret: knowing it and the bytes
    gives no equation in the secret to solve, unlike the xxh3 key itself."""
    fs = open_fs(mkfs(tmp_path))
    data = pattern(3, BS + 5)
    async with running(fs):
        ino = await write_as(fs.ns, ALICE, b"f", data)
        inode = fs.ns.tree.inodes[ino]
        keys = inode.committed
        internal = fs.index.key_of(len(data).to_bytes(8, "little") + b"".join(k or HOLE_KEY for k in keys))
        assert fs.ns.tree.content.key(inode) == hashlib.blake2b(internal, key=fs.store.key_secret, digest_size=16,
                                                    person=b"kvfs public id").digest()
        assert fs.ns.tree.content.key(inode) != internal
        sb = fs.store.sb
        domain = fs.index.domain_of(ALICE)
        assert keys[0] == xxhash.xxh3_128_digest(sb.key_secret + domain.to_bytes(8, "little") + data[:BS],
                                                 seed=sb.hash_seed)
    close_and_check(fs)


@pytest.mark.expect_errors("fails its checksum", "dedup hit whose stored bytes differ",
                           "flushing a block failed", "flush failed")
async def test_dedup_verify_compares_bytes_and_refuses_a_damaged_hit(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, dedup_verify=True)
    data = pattern(4, 2 * BS)
    async with running(fs):
        await write_as(fs.ns, ALICE, b"first", data)
        second = await write_as(fs.ns, ALICE, b"second", data)
        stats = fs.index.statistics()
        assert (stats.dedup_hits, stats.dedup_verify_reads, stats.dedup_collisions) == (2, 2, 0)
        assert await read_all(fs.ns, second) == data
        # Damage the stored copy behind kvfs's back: the next dedup hit reads it,
        # sees other bytes, and the write fails (EIO) instead of naming them.
        key = block_keys(fs, second)[0]
        off, _ = fs.index.extent(key)
        fs.cache.drop_clean()               # the verification must read the device
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(bytes(64))
        ino = fs.ns.make(ROOT_INO, b"third", 0o100600, ALICE, ALICE)
        fh, _, _ = fs.ns.open(ino, os.O_WRONLY)
        await fs.ns.write(fh, 0, data)
        with pytest.raises(DedupCollision) as caught:
            await fs.ns.fsync(fh)
        assert caught.value.errno == errno.EIO
        await fs.ns.release(fh)
        assert fs.index.statistics().dedup_collisions == 1
    fs.close()
    assert_fsck_finds_only_the_damaged_block(path, key)


def assert_fsck_finds_only_the_damaged_block(path, key):
    problems = fsck.check(str(path)).problems
    assert problems and all(key.hex() in p or "corrupt blocks" in p for p in problems), problems


@pytest.mark.expect_errors("fails its checksum")
async def test_without_dedup_verify_a_damaged_hit_still_never_reads_wrong_bytes(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path, cache_size=4 * BS)
    data = pattern(5, BS)
    async with running(fs):
        first = await write_as(fs.ns, ALICE, b"first", data)
        off, _ = fs.index.extent(block_keys(fs, first)[0])
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(bytes(64))
        second = await write_as(fs.ns, ALICE, b"second", data)   # a dedup hit on the damaged block
        assert fs.index.statistics().dedup_hits == 1
        fs.cache.drop_clean()
        with pytest.raises(CorruptBlock):
            await read_all(fs.ns, second)
    fs.close()
    assert_fsck_finds_only_the_damaged_block(path, block_keys(fs, first)[0])
