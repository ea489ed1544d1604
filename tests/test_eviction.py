"""Eviction: a full store makes room instead of failing the engine (issue 11).

Everything goes through a real mount: LMCache-style chunk files, kvfs-admin
evict/pin/unpin, and the statistics.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from filedata import pattern
from kvfsmount import run_tool

MiB = 1 << 20
CHUNK = 32 * MiB
BASE = pattern(4242, CHUNK)


def chunk(index):
    """A 32 MiB chunk whose every 1 MiB block is unique (no dedup between chunks)."""
    data = bytearray(BASE)
    for block in range(CHUNK // MiB):
        data[block * MiB:block * MiB + 16] = index.to_bytes(8, "little") + block.to_bytes(8, "little")
    return bytes(data)


def write_chunk(path, index):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        assert os.write(fd, chunk(index)) == CHUNK
    finally:
        os.close(fd)


def admin_json(fs, *args):
    return json.loads(fs.admin(*args, "--json").stdout)


def test_eviction_keeps_the_store_from_filling(kvfs_factory):
    """4 GiB of chunks into a 1 GiB store: no writer sees ENOSPC, used space stays under the
    high watermark, re-read and pinned chunks survive, the rest go oldest-first."""
    fs = kvfs_factory(size="1G", mount_options=["commit_interval=0.2"])
    fs.mkfs()
    fs.mount()
    d = fs.mnt / "lmcache"
    d.mkdir()
    hot, pinned = [0, 1], [2]
    total = 4 * (1 << 30) // CHUNK
    for i in range(total):
        write_chunk(d / f"c{i:04d}.pt", i)          # an ENOSPC here fails the test
        if i == 2:
            fs.admin("pin", d / "c0002.pt")
        if i % 4 == 3:
            for h in hot:                           # the engine keeps hitting a few chunks
                assert (d / f"c{h:04d}.pt").read_bytes()[:16] == chunk(h)[:16]
    fs.flush()
    stats = fs.stats()
    assert stats["evictions"] > 0 and stats["evicted_bytes"] >= stats["evictions"] * CHUNK
    assert stats["used_fraction"] <= stats["high_watermark"], stats["used_fraction"]
    assert stats["pinned_files"] == 1 and stats["pinned_bytes"] == CHUNK
    present = sorted(int(p.name[1:5]) for p in d.iterdir())
    for i in hot + pinned:
        assert i in present, f"chunk {i} (hot or pinned) was evicted"
        assert (d / f"c{i:04d}.pt").read_bytes() == chunk(i)
    cold = [i for i in range(total) if i not in hot + pinned]
    kept = [i for i in cold if i in present]
    assert kept == cold[len(cold) - len(kept):], "chunks that were never read again left out of order"
    assert len(kept) >= 10                          # the store still holds the newest chunks
    fs.umount()
    fs.assert_fsck_clean()
    fs.mount()
    assert sorted(int(p.name[1:5]) for p in d.iterdir()) == present


def test_manual_eviction_dry_run_changes_nothing_and_to_used_gets_there(kvfs_factory):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    fs.mount()
    for i in range(16):                             # 512 MiB: about 55% of the data region
        write_chunk(fs.mnt / f"c{i}", i)
    fs.flush()
    before = fs.stats()
    names = sorted(os.listdir(fs.mnt))
    dry = admin_json(fs, "evict", fs.mnt, "--to-used", "10", "--dry-run")
    assert dry["dry_run"] and dry["files"] > 0
    assert sorted(os.listdir(fs.mnt)) == names and fs.stats()["used_bytes"] == before["used_bytes"]
    out = fs.admin("evict", fs.mnt, "--to-used", "10").stdout
    assert out.startswith("evicted ") and "used now" in out
    after = fs.stats()
    assert 0.05 <= after["used_fraction"] <= 0.12, after["used_fraction"]
    assert after["evictions"] == dry["files"]


def test_pins_survive_remounts_and_unpinned_files_go(kvfs_factory):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    fs.mount()
    for i in range(3):
        write_chunk(fs.mnt / f"c{i}", i)
    fs.flush()
    assert "pinned 1 file(s)" in fs.admin("pin", fs.mnt / "c1").stdout
    fs.umount()
    fs.mount()
    assert fs.stats()["pinned_files"] == 1
    fs.admin("evict", fs.mnt, "--to-used", "0")
    assert sorted(os.listdir(fs.mnt)) == [".kvfs", "c1"]
    with pytest.raises(FileNotFoundError):
        open(fs.mnt / "c0", "rb")                   # an evicted chunk is a miss, never a short read
    fs.admin("unpin", fs.mnt / "c1")
    fs.admin("evict", fs.mnt, fs.mnt / "c1")
    assert sorted(os.listdir(fs.mnt)) == [".kvfs"]


def test_the_kernel_answers_stats_itself_and_forgets_an_evicted_name(kvfs_factory):
    """The kernel keeps entries and attributes for an hour (kvfs/fuse/ops.py ENTRY_TIMEOUT), so
    repeated stats never reach the daemon; eviction, the one change made behind the kernel's
    back, drops the names it removes from the kernel's cache, so they vanish at once."""
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    fs.mount()
    names = [fs.mnt / f"c{i}" for i in range(3)]
    for i, name in enumerate(names):
        write_chunk(name, i)
    fs.flush()
    for name in names:
        assert os.stat(name).st_size == CHUNK
    counters = ("kernel_lookup_requests", "kernel_getattr_requests")
    # On a 6.18 kernel a few seconds after the files were made, the kernel now and then
    # asks again for all of them once (seen 0-2 times in the first 4 s, never later;
    # cause not found). So: some 1.5 s window out of three must reach the daemon not
    # at all. With entries or attributes kept 1 s, every window does.
    windows = []
    for _ in range(3):
        before = fs.stats()
        time.sleep(1.5)                             # past the 1 s the kernel used to keep them
        for name in names:
            assert os.stat(name).st_size == CHUNK and os.path.exists(name)
        after = fs.stats()
        windows.append({c: after[c] - before[c] for c in counters})
        if not any(windows[-1].values()):
            break
    assert not any(windows[-1].values()), windows
    fs.admin("evict", fs.mnt, names[0])
    assert fs.stats()["kernel_entry_invalidations"] == 1
    # The drop runs in pyfuse3's notify thread once the evict command's request is done.
    deadline = time.monotonic() + 30
    while os.path.exists(names[0]):
        assert time.monotonic() < deadline, "the evicted name is still in the kernel's cache"
        time.sleep(0.05)
    with pytest.raises(FileNotFoundError):
        os.stat(names[0])
    assert os.stat(names[1]).st_size == CHUNK and sorted(os.listdir(fs.mnt)) == [".kvfs", "c1", "c2"]
    fs.umount()
    fs.assert_fsck_clean()


def test_bad_eviction_input_gets_one_line(kvfs_factory, tmp_path, shared_kvfs):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    proc = run_tool("mount", fs.device, fs.mnt, "-o", "high_watermark=70,low_watermark=80", check=False)
    assert proc.returncode == 1 and not fs.mounted
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "watermarks out of order" in proc.stderr
    proc = run_tool("admin", "evict", tmp_path, "--to-used", "10", check=False)
    assert proc.returncode == 1 and "is not a mounted kvfs" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    shared = shared_kvfs()
    (shared.mnt / "mine").write_bytes(b"x" * 100)
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-m", "kvfs.cli.admin", "evict", str(shared.mnt), "--to-used", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (f"kvfs-admin: evict {shared.mnt}: permission denied: changing a mounted kvfs "
                                   f"needs root or the mount's owner"), proc.stderr
    assert (shared.mnt / "mine").exists()
