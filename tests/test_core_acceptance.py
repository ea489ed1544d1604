"""Issue 2 acceptance: round trip, dedup, crash, corruption, full device, bad input.

Everything here goes through a real kvfs mount and ordinary syscalls.
"""
import errno
import hashlib
import os
import random
import subprocess
import threading
import time

import pytest

from filedata import pattern, write_file
from kvfsmount import run_tool
from threads import Workers

MiB = 1 << 20


def sha(path, chunk=8 * MiB):
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def test_round_trip_survives_umount_and_remount(kvfs):
    mnt = kvfs.mnt
    expected = {}
    sizes = {"empty": 0, "one": 1, "mib_plus_3": MiB + 3, "chunk32": 32 * MiB}
    for i, (name, size) in enumerate(sizes.items()):
        data = pattern(i, size)
        write_file(mnt / name, data)
        expected[name] = hashlib.sha256(data).hexdigest()
    # 1 GiB, written in 32 MiB pieces so the test does not hold it all in RAM twice.
    h = hashlib.sha256()
    with open(mnt / "gib", "wb", buffering=0) as f:
        for i in range(32):
            piece = pattern(1000 + i, 32 * MiB)
            h.update(piece)
            assert f.write(piece) == len(piece)
    expected["gib"] = h.hexdigest()
    (mnt / "a" / "b" / "c").mkdir(parents=True)
    for depth, d in enumerate(["a", "a/b", "a/b/c"]):
        data = pattern(50 + depth, 4096 * (depth + 1) + 7)
        write_file(mnt / d / f"f{depth}", data)
        expected[f"{d}/f{depth}"] = hashlib.sha256(data).hexdigest()

    def verify():
        for name, digest in expected.items():
            assert sha(mnt / name) == digest, name
        assert (mnt / "empty").stat().st_size == 0
        assert (mnt / "gib").stat().st_size == 1 << 30
        assert sorted(p.name for p in (mnt / "a").iterdir()) == ["b", "f0"]

    verify()
    kvfs.umount()
    kvfs.assert_fsck_clean()
    kvfs.mount()
    verify()


def test_dedup_of_eight_tp_ranks(kvfs):
    mnt = kvfs.mnt
    chunk = os.urandom(32 * MiB)
    kvfs.flush()
    before = kvfs.stats()
    for rank in range(8):
        write_file(mnt / f"deepseek@tp{rank}.pt", chunk)
    kvfs.flush()
    after = kvfs.stats()
    grew = after["used_bytes"] - before["used_bytes"]
    assert abs(grew - 32 * MiB) <= 0.02 * 32 * MiB, grew
    assert after["dedup_ratio"] >= 7.9, after["dedup_ratio"]
    assert after["unique_blocks"] - before["unique_blocks"] == 32

    # Rewriting identical bytes (LMCache after a restart) writes no data.
    written = after["data_bytes_written"]
    device_written = after["device_bytes_written"]
    write_file(mnt / "deepseek@tp3.pt", chunk)
    kvfs.flush()
    again = kvfs.stats()
    assert again["data_bytes_written"] == written
    # Nothing but multi-mount protection heartbeats (one 4 KiB sector each; a stats
    # snapshot may land between a heartbeat's write and its count).
    beats = again["mmp_heartbeats"] - after["mmp_heartbeats"]
    assert again["device_bytes_written"] - device_written in (4096 * beats, 4096 * (beats + 1))

    for rank in range(7):
        os.unlink(mnt / f"deepseek@tp{rank}.pt")
    kvfs.flush()
    assert kvfs.stats()["used_bytes"] == after["used_bytes"]
    os.unlink(mnt / "deepseek@tp7.pt")
    kvfs.flush()
    assert kvfs.stats()["used_bytes"] == before["used_bytes"]
    assert kvfs.stats()["unique_blocks"] == before["unique_blocks"]


@pytest.mark.slow
def test_crash_kill9_keeps_every_fsynced_file(kvfs):
    """Writers create files continuously; kill -9 the daemon 10 times at random moments."""
    mnt = kvfs.mnt
    committed = {}            # name -> sha256, only after fsync returned
    rng = random.Random(7)
    for round_no in range(10):
        lock = threading.Lock()
        killing = threading.Event()

        # Writers resolve names relative to a directory fd on the kvfs mount: after the
        # lazy unmount a plain path would silently land in the directory underneath.
        dir_fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)

        def writer(wid, stop):
            n = 0
            while not stop.is_set():
                name = f"r{round_no}-w{wid}-{n}"
                size = rng.choice([1, 4096, MiB - 5, 2 * MiB + 11, 5 * MiB])
                data = os.urandom(size)
                try:
                    write_file(name, data, fsync=True, dir_fd=dir_fd)
                except OSError:
                    if killing.is_set():
                        return               # the daemon died under us
                    raise
                with lock:
                    committed[name] = hashlib.sha256(data).hexdigest()
                n += 1

        # Leaving the block sets workers.stop, joins the writers and re-raises their failures.
        with Workers(timeout=60) as workers:
            for w in range(3):
                workers.start(writer, w, workers.stop)
            time.sleep(rng.uniform(0.3, 1.5))
            killing.set()
            kvfs.kill9()
        os.close(dir_fd)
        assert not os.listdir(mnt), "writes leaked into the directory under the mount"
        kvfs.mount()
        present = set(os.listdir(mnt))
        for name, digest in committed.items():
            assert name in present, (f"round {round_no}: committed file {name} is missing "
                                     f"(stat finds it: {(mnt / name).exists()})")
            assert sha(mnt / name) == digest, f"round {round_no}: committed file {name} is torn"
        for name in present - set(committed) - {".kvfs"}:
            # Not committed: it may be absent, empty (created, content not yet recorded)
            # or complete, but never partial or wrong.
            size = (mnt / name).stat().st_size
            data = (mnt / name).read_bytes()
            assert len(data) == size
            assert size in (0, 1, 4096, MiB - 5, 2 * MiB + 11, 5 * MiB), (name, size)
    assert len(committed) > 10
    kvfs.umount()
    kvfs.assert_fsck_clean()
    kvfs.mount()


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
def test_corrupt_block_gives_eio_and_fsck_repairs(kvfs):
    mnt = kvfs.mnt
    victim = pattern(1, 3 * MiB)
    bystander = pattern(2, 2 * MiB + 100)
    write_file(mnt / "victim", victim)
    write_file(mnt / "bystander", bystander)
    (mnt / "dir").mkdir()
    write_file(mnt / "dir" / "small", b"tiny")
    kvfs.umount()
    # Find the victim's second block on the device and flip one byte in it.
    with open(kvfs.device, "r+b") as dev:
        blob = dev.read()
        needle = victim[MiB + 4096:MiB + 4096 + 64]
        at = blob.find(needle)
        assert at > 0 and blob.find(needle, at + 1) == -1
        dev.seek(at)
        dev.write(bytes([blob[at] ^ 0xFF]))
    del blob
    report = kvfs.fsck()
    assert report.returncode != 0
    assert "/victim" in report.stdout and "corrupt" in report.stdout
    kvfs.mount()
    with pytest.raises(OSError) as err:
        (mnt / "victim").read_bytes()
    assert err.value.errno == errno.EIO
    assert (mnt / "bystander").read_bytes() == bystander
    assert kvfs.stats()["corrupt_reads"] >= 1
    kvfs.umount()
    repaired = kvfs.fsck("--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    kvfs.assert_fsck_clean()
    kvfs.mount()
    assert not (mnt / "victim").exists()
    assert (mnt / "bystander").read_bytes() == bystander
    assert (mnt / "dir" / "small").read_bytes() == b"tiny"


def test_full_device_enospc_then_delete_frees(kvfs_factory):
    fs = kvfs_factory(size="160M", mount_options=["eviction_policy=none"])   # ENOSPC, not eviction
    fs.mkfs()
    fs.mount()
    mnt = fs.mnt
    keep = pattern(9, 8 * MiB)
    write_file(mnt / "keep", keep, fsync=True)
    capacity = fs.stats()["capacity_bytes"]
    written = []
    with pytest.raises(OSError) as err:
        for i in range(capacity // (8 * MiB) + 4):
            write_file(mnt / f"fill{i}", os.urandom(8 * MiB))
            written.append(f"fill{i}")
    assert err.value.errno == errno.ENOSPC
    assert (mnt / "keep").read_bytes() == keep
    fs.flush()
    stats = fs.stats()
    assert stats["used_bytes"] <= capacity
    for name in written:
        os.unlink(mnt / name)
    # Space comes back: the same amount can be written again.
    for i in range(len(written)):
        write_file(mnt / f"again{i}", os.urandom(8 * MiB))
    fs.flush()
    assert (mnt / "keep").read_bytes() == keep
    fs.umount()
    fs.assert_fsck_clean()


class TestBadInput:
    def test_mkfs_refuses_existing_kvfs_without_force(self, tmp_path):
        dev = tmp_path / "dev"
        run_tool("mkfs", "--size", "128M", dev)
        proc = run_tool("mkfs", "--size", "128M", dev, check=False)
        assert proc.returncode != 0
        assert "already holds a kvfs" in proc.stderr
        assert proc.stderr.count("\n") == 1          # one line, no traceback
        assert run_tool("mkfs", "--force", dev).returncode == 0

    def test_mkfs_refuses_other_data(self, tmp_path):
        dev = tmp_path / "ext4.img"
        subprocess.run(["truncate", "-s", "64M", dev], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True)
        proc = run_tool("mkfs", dev, check=False)
        assert proc.returncode != 0 and "ext2/3/4" in proc.stderr

    @pytest.mark.parametrize("kind", ["random", "zeros", "truncated", "tiny"])
    def test_mount_rejects_non_kvfs_devices(self, tmp_path, kind):
        dev = tmp_path / "dev"
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        if kind == "random":
            dev.write_bytes(os.urandom(128 * MiB))
            expect = "not a kvfs device"
        elif kind == "zeros":
            subprocess.run(["truncate", "-s", "128M", dev], check=True)
            expect = "zero-filled"
        elif kind == "truncated":
            run_tool("mkfs", "--size", "256M", dev)
            os.truncate(dev, 200 * MiB)
            expect = "truncated"
        else:
            dev.write_bytes(b"x" * 1000)
            expect = "too small"
        proc = run_tool("mount", dev, mnt, check=False)
        assert proc.returncode != 0
        assert expect in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert not os.path.ismount(mnt)

    def test_mount_rejects_missing_and_busy_mountpoints(self, kvfs, tmp_path):
        other = tmp_path / "other"
        run_tool("mkfs", "--size", "128M", other)
        proc = run_tool("mount", other, tmp_path / "nowhere", check=False)
        assert proc.returncode != 0 and "does not exist" in proc.stderr
        proc = run_tool("mount", other, kvfs.mnt, check=False)
        assert proc.returncode != 0 and "busy" in proc.stderr
        # The same device twice is refused too (it is locked by the running daemon).
        second = tmp_path / "second"
        second.mkdir()
        proc = run_tool("mount", kvfs.device, second, check=False)
        assert proc.returncode != 0 and "in use" in proc.stderr

    def test_unknown_option_and_bad_arguments(self, kvfs, tmp_path):
        proc = run_tool("mount", kvfs.device, tmp_path, "-o", "bogus=1", check=False)
        assert proc.returncode != 0 and "unknown mount option 'bogus'" in proc.stderr
        proc = run_tool("mkfs", "--size", "lots", tmp_path / "x", check=False)
        assert proc.returncode == 2 and "invalid size" in proc.stderr
        proc = run_tool("admin", "stats", tmp_path, check=False)
        assert proc.returncode != 0 and "not a mounted kvfs" in proc.stderr

    def test_name_too_long(self, kvfs):
        with pytest.raises(OSError) as err:
            open(kvfs.mnt / ("x" * 256), "w")
        assert err.value.errno == errno.ENAMETOOLONG
        ok = kvfs.mnt / ("y" * 255)
        ok.write_bytes(b"fits")
        assert ok.read_bytes() == b"fits"


@pytest.mark.parametrize("command", [["umount"], ["fusermount3", "-u"]])
def test_plain_umount_loses_nothing(kvfs, command):
    data = pattern(11, 3 * MiB + 1)
    write_file(kvfs.mnt / "fsynced", data, fsync=True)
    write_file(kvfs.mnt / "closed", data[::-1])
    subprocess.run([*command, str(kvfs.mnt)], check=True)
    kvfs.wait_daemon_exit(kvfs.pid)
    kvfs.assert_fsck_clean()
    kvfs.mount()
    assert (kvfs.mnt / "fsynced").read_bytes() == data
    assert (kvfs.mnt / "closed").read_bytes() == data[::-1]     # the daemon flushed on its way out
