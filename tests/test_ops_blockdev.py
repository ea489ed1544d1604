"""kvfs on a real block device: a loop device over a sparse file.

mkfs takes the size from the device, the daemon opens it with O_DIRECT, the
core round trip and the dedup check pass, `kvfs-admin stats` says it is a block
device, and freed extents are discarded (BLKDISCARD on the loop device punches
holes in its backing file).
"""
import hashlib
import json
import os
import random
import shutil
import subprocess

import pytest

from kvfsmount import KvfsMount, run_tool

MiB = 1 << 20
LOOP_SIZE = 1536 * MiB

pytestmark = pytest.mark.skipif(shutil.which("losetup") is None, reason="losetup (util-linux) is not installed")


@pytest.fixture
def loopdev(tmp_path):
    backing = tmp_path / "backing.img"
    with open(backing, "wb") as f:
        f.truncate(LOOP_SIZE)
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        yield dev, backing
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


@pytest.fixture
def blockfs(loopdev, tmp_path):
    dev, backing = loopdev
    (tmp_path / "fs").mkdir()
    fs = KvfsMount(tmp_path / "fs")
    fs.device = dev
    fs.backing = backing
    run_tool("mkfs", dev)                                # no --size: it comes from the device
    fs.mount()
    yield fs
    fs.teardown()                                        # umount, then fsck.kvfs on the block device


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


def test_loop_device_round_trip_dedup_and_stats(blockfs):
    fs = blockfs
    stats = fs.stats()
    assert stats["device"] == fs.device and stats["device_kind"] == "block device"
    assert stats["direct_io"] is True
    assert 0.9 * LOOP_SIZE < stats["capacity_bytes"] < LOOP_SIZE
    shown = run_tool("admin", "stats", fs.mnt).stdout
    assert f"device      {fs.device}  (block device, O_DIRECT, 1.0 MiB blocks)" in shown

    expected = {}
    for i, size in enumerate((0, 1, 4095, MiB + 3, 32 * MiB)):
        data = pattern(i, size)
        (fs.mnt / f"f{size}").write_bytes(data)
        expected[f"f{size}"] = hashlib.sha256(data).hexdigest()
    fs.flush()

    used = fs.stats()["used_bytes"]
    chunk = pattern(99, 8 * MiB)
    for rank in range(8):                               # 8 identical files: one copy stored
        (fs.mnt / f"rank{rank}.bin").write_bytes(chunk)
    fs.flush()
    after = fs.stats()
    assert after["used_bytes"] - used == 8 * MiB
    assert after["dedup_hits"] >= 7 * 8

    fs.remount()
    for name, digest in expected.items():
        assert hashlib.sha256((fs.mnt / name).read_bytes()).hexdigest() == digest, name
    for rank in range(8):
        assert (fs.mnt / f"rank{rank}.bin").read_bytes() == chunk


def allocated(path):
    return os.stat(path).st_blocks * 512


def test_freed_extents_are_discarded_on_the_block_device(blockfs):
    fs = blockfs
    for i in range(4):
        (fs.mnt / f"big{i}").write_bytes(pattern(200 + i, 16 * MiB))
    fs.flush()
    full = allocated(fs.backing)
    for i in range(4):
        os.unlink(fs.mnt / f"big{i}")
    run_tool("admin", "checkpoint", fs.mnt)             # commits the frees; discard precedes reuse
    run_tool("admin", "flush", fs.mnt)
    subprocess.run(["sync"], check=True)
    freed = full - allocated(fs.backing)
    assert freed >= 60 * MiB, f"backing file kept {full - freed} of {full} bytes after the discard"
    assert json.loads(run_tool("admin", "stats", "--json", fs.mnt).stdout)["used_bytes"] == 0
