"""Metadata space: every durable change is charged against the checkpoint slot.

A checkpoint that does not fit its slot used to kill the daemon and leave the
store unmountable. Now operations that would not fit get ENOSPC, the estimate
is an upper bound of the real checkpoint, and a failed commit leaves the mount up.
"""
import errno
import os
import random
import stat

import pytest

from kvfs import schema
from kvfs.device import Device
from kvfs.errors import NoSpace
from kvfs.namespace import ROOT_INO
from kvfs.namespace.inodes import INDEX_BLOCK_COST

from .helpers import (BS, DIR_MODE, FILE_MODE, close_and_check, lookup_path, mkfs, open_fs, pattern,
                      running, write_file)

LINK_MODE = stat.S_IFLNK | 0o777


def recounted(ns):
    """``metadata_bytes()`` as it would be with the running count recomputed from scratch."""
    return ns.tree.recount_metadata() + INDEX_BLOCK_COST * ns.journal.block_count() + 4096


def written_checkpoint_bytes(path):
    """Payload size of the newest checkpoint on the device (read beside the open stack)."""
    device = Device.open(str(path), readonly=True, lock=False)
    try:
        sb = schema.Superblock.decode(device.pread_sync(0, schema.SECTOR))
        headers = [schema.decode_checkpoint_header(device.pread_sync(off, schema.SECTOR), sb.checkpoint_len,
                                                   sb.hash_seed)
                   for off in (sb.checkpoint_a_off, sb.checkpoint_b_off)]
    finally:
        device.close()
    generation, payload_len, _ = max(h for h in headers if h is not None)
    return payload_len


async def test_estimate_bounds_the_checkpoint_and_tracks_every_change(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    ns = fs.ns
    rng = random.Random(3)
    async with running(fs):
        dirs, names = [ROOT_INO], []
        for step in range(400):
            parent = rng.choice(dirs)
            name = f"n{step}-".encode() + b"x" * rng.randrange(0, 200)
            kind = rng.random()
            if kind < 0.15:
                dirs.append(ns.make(parent, name, DIR_MODE, 0, 0))
            elif kind < 0.35:
                ns.make(parent, name, LINK_MODE, 0, 0, target=b"t" * rng.randrange(1, 4000))
                names.append((parent, name))
            elif kind < 0.7:
                await write_file(ns, parent, name, pattern(step, rng.randrange(0, 3 * BS)))
                names.append((parent, name))
            elif names and kind < 0.85:
                p, n = names.pop(rng.randrange(len(names)))
                ns.unlink(p, n, directory=False)
            elif names:
                p, n = names.pop(rng.randrange(len(names)))
                new = n + b"-renamed"
                await ns.rename(p, n, parent, new)
                names.append((parent, new))
            assert ns.metadata_bytes() == recounted(ns), f"step {step}: running count drifted"
        estimate = ns.metadata_bytes()
        await ns.checkpoint()                           # the real thing, free map and all
        real = written_checkpoint_bytes(path)
        assert real <= estimate, (real, estimate)
        assert ns.metadata_bytes() < 3 * real, "the estimate is too loose to be useful"
    fs.close()
    fs = open_fs(path)
    assert fs.ns.metadata_bytes() == recounted(fs.ns)
    close_and_check(fs)


async def test_symlink_flood_gets_enospc_and_the_checkpoint_always_fits(tmp_path):
    """The review's repro: 4000-byte symlink targets until the slot is full (64 MiB store)."""
    path = mkfs(tmp_path, size=64 << 20)
    fs = open_fs(path)
    ns = fs.ns
    async with running(fs):
        made = 0
        with pytest.raises(NoSpace) as e:
            for made in range(100_000):
                ns.make(ROOT_INO, f"link{made:06d}".encode(), LINK_MODE, 0, 0, target=b"t" * 4000)
                if made % 800 == 799:
                    await ns.commit()
        assert e.value.errno == errno.ENOSPC
        assert made > 1000, "a 9 MiB slot holds well over a thousand such links"
        # statfs's free inode count is honest: about that many small files still fit.
        figures = ns.statfs()
        assert figures.inodes == len(ns.tree.inodes) + figures.free_inodes
        small = 0
        with pytest.raises(NoSpace) as e:
            for small in range(100_000):
                ns.make(ROOT_INO, f"s{small:05d}".encode(), DIR_MODE, 0, 0)
        assert e.value.errno == errno.ENOSPC
        assert figures.free_inodes // 2 <= small <= 2 * figures.free_inodes + 1
        assert ns.statfs().free_inodes == 0
        await ns.checkpoint()                            # fits: this used to kill the daemon
        assert written_checkpoint_bytes(path) <= ns.metadata_bytes()
        for i in range(10):
            ns.unlink(ROOT_INO, f"link{i:06d}".encode(), directory=False)
        ns.make(ROOT_INO, b"after-deletes", LINK_MODE, 0, 0, target=b"t" * 4000)
        # A write that adds blocks is charged before it takes any data.
        fh, _, _ = ns.open(ns.make(ROOT_INO, b"f", FILE_MODE, 0, 0), os.O_WRONLY)
        with pytest.raises(NoSpace) as e:
            await ns.write(fh, BS * 1_000_000, b"x")       # a million new block slots
        assert e.value.errno == errno.ENOSPC
        await ns.release(fh)
    fs.close()
    fs = open_fs(path)
    assert lookup_path(fs.ns, "after-deletes") is not None
    close_and_check(fs)
