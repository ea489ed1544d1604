"""Metadata space: every durable change is charged against the checkpoint slot.

A checkpoint that does not fit its slot used to kill the daemon and leave the
store unmountable. Now operations that would not fit get ENOSPC, the estimate
is an upper bound of the real checkpoint, and a failed commit leaves the mount up.
"""
import errno
import os
import random
import stat

import msgpack
import pytest

from kvfs.errors import FsError
from kvfs.namespace import ROOT_INO

from .helpers import (BS, DIR_MODE, FILE_MODE, close_and_check, lookup_path, mkfs, open_fs, pattern,
                      running, write_file)

LINK_MODE = stat.S_IFLNK | 0o777


def recount(ns):
    return sum(ns._inode_cost(i) for i in ns.inodes.values())


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
            assert ns._meta_bytes == recount(ns), f"step {step}: running count drifted"
        real = len(msgpack.packb(ns.snapshot()))
        assert real <= ns.metadata_bytes(), (real, ns.metadata_bytes())
        assert ns.metadata_bytes() < 3 * real, "the estimate is too loose to be useful"
    fs.close()
    fs = open_fs(path)
    assert fs.ns._meta_bytes == recount(fs.ns)
    close_and_check(fs)


async def test_symlink_flood_gets_enospc_and_the_checkpoint_always_fits(tmp_path):
    """The review's repro: 4000-byte symlink targets until the slot is full (64 MiB store)."""
    path = mkfs(tmp_path, size=64 << 20)
    fs = open_fs(path)
    ns = fs.ns
    async with running(fs):
        made = 0
        with pytest.raises(FsError) as e:
            for made in range(100_000):
                ns.make(ROOT_INO, f"link{made:06d}".encode(), LINK_MODE, 0, 0, target=b"t" * 4000)
                if made % 800 == 799:
                    await fs.store.commit()
        assert e.value.errno == errno.ENOSPC
        assert made > 1000, "a 9 MiB slot holds well over a thousand such links"
        # statfs's free inode count is honest: about that many small files still fit.
        figures = ns.statfs()
        assert figures.inodes == len(ns.inodes) + figures.free_inodes
        small = 0
        with pytest.raises(FsError) as e:
            for small in range(100_000):
                ns.make(ROOT_INO, f"s{small:05d}".encode(), DIR_MODE, 0, 0)
        assert e.value.errno == errno.ENOSPC
        assert figures.free_inodes // 2 <= small <= 2 * figures.free_inodes + 1
        assert ns.statfs().free_inodes == 0
        await fs.store.checkpoint()                      # fits: this used to kill the daemon
        for i in range(10):
            ns.unlink(ROOT_INO, f"link{i:06d}".encode(), directory=False)
        ns.make(ROOT_INO, b"after-deletes", LINK_MODE, 0, 0, target=b"t" * 4000)
        # A write that adds blocks is charged before it takes any data.
        fh, _, _ = ns.open(ns.make(ROOT_INO, b"f", FILE_MODE, 0, 0), os.O_WRONLY)
        with pytest.raises(FsError) as e:
            await ns.write(fh, BS * 1_000_000, b"x")       # a million new block slots
        assert e.value.errno == errno.ENOSPC
        await ns.release(fh)
    fs.close()
    fs = open_fs(path)
    assert lookup_path(fs.ns, "after-deletes") is not None
    close_and_check(fs)
