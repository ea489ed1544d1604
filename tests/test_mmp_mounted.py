"""Multi-mount protection with real daemons: two "hosts" on one machine against one store.

The same-host ``flock`` would stop a second mount of the store file before
MMP is reached, so the second host mounts the same bytes through a loop
device (``losetup`` over the store file: another inode, which the lock does
not see), and each daemon gets its own host id from the test hook
``KVFS_TEST_HOST_ID``. Heartbeats are short (mount option ``mmp_interval``),
so the grace periods are a second or two.
"""
import errno
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from images.storeimage import unpack_to
from kvfs.store import mmp
from kvfsmount import run_tool

MiB = 1 << 20
FAST = 0.2                      # seconds between heartbeats
IMAGES = Path(__file__).parent / "images"


@pytest.fixture
def attach_loop():
    """``attach(path)`` -> a loop device over ``path``; detached after the test's mounts are gone.

    Ask for it before kvfs_factory, so that it is torn down after it."""
    if not os.path.exists("/dev/loop-control") or shutil.which("losetup") is None:
        pytest.skip("needs loop devices (losetup) to give one store a second path")
    attached = []

    def attach(path):
        proc = subprocess.run(["losetup", "--find", "--show", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"losetup failed: {proc.stderr}"
        attached.append(proc.stdout.strip())
        return Path(attached[-1])

    yield attach
    for dev in attached:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def two_hosts(kvfs_factory, attach_loop, a_interval=FAST, b_interval=FAST):
    """Host A mounts the store file, host B the same store through a loop device."""
    a = kvfs_factory("host-a", size="256M", env={mmp.HOST_ID_ENV: "host-a"},
                     mount_options=[f"mmp_interval={a_interval}"])
    a.mkfs()
    b = kvfs_factory("host-b", size="256M", env={mmp.HOST_ID_ENV: "host-b"},
                     mount_options=[f"mmp_interval={b_interval}"])
    b.device = attach_loop(a.device)
    return a, b


def try_mount(fs, *extra):
    """mount.kvfs as fs.mount() runs it, but its failure is returned, not raised."""
    opts = ",".join([*fs.mount_options, f"log={fs.log}"])
    return run_tool("mount", fs.device, fs.mnt, "-o", opts, *extra, check=False, timeout=120,
                    env=fs.mount_env())


def wait_for(predicate, what, limit=10.0):
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_live_store_refuses_a_second_host_by_name_and_a_clean_umount_frees_it(attach_loop, kvfs_factory):
    a, b = two_hosts(kvfs_factory, attach_loop)
    a.mount()
    first = a.stats()
    wait_for(lambda: a.stats()["mmp_seq"] - first["mmp_seq"] >= 3, "the heartbeat to advance three times")
    later = a.stats()
    assert first["mmp"] == later["mmp"] == "owner"
    assert later["mmp_heartbeats"] > first["mmp_heartbeats"], "the heartbeat advances every interval"
    assert "host id host-a" in later["mmp_owner"] and f"pid {a.pid}" in later["mmp_owner"]
    assert "mmp         owner, sequence" in a.admin("stats", a.mnt).stdout
    data = os.urandom(2 * MiB + 5)
    (a.mnt / "from-a").write_bytes(data)
    a.flush()

    refused = try_mount(b)
    assert refused.returncode == 1 and not b.mounted
    message = refused.stderr
    assert "the store is in use (multi-mount protection)" in message
    assert "host id host-a" in message and f"pid {a.pid}" in message and "mounted 20" in message
    assert "--force" in message and "Unmount it on that host first" in message
    (a.mnt / "still-writable").write_bytes(b"yes")           # the owner did not notice a thing
    a.flush()

    a.umount()                                                 # CLEAN: no watching, no grace period
    b.mount()
    assert "taking over" not in b.log.read_text()
    assert (b.mnt / "from-a").read_bytes() == data and (b.mnt / "still-writable").read_bytes() == b"yes"
    assert "host id host-b" in b.stats()["mmp_owner"]
    b.umount()


def test_after_kill9_another_host_takes_over_once_the_grace_period_has_passed(attach_loop, kvfs_factory):
    a, b = two_hosts(kvfs_factory, attach_loop)
    a.mount()
    data = os.urandom(3 * MiB)
    (a.mnt / "durable").write_bytes(data)
    a.flush()
    a.kill9()                                                  # the record stays IN_USE, its heartbeat stops
    b.mount()
    # "Its heartbeat stopped": the verdict of a record watched for the whole grace period.
    log = b.log.read_text()
    assert "taking over from host" in log and "host id host-a" in log and "its heartbeat stopped" in log
    assert (b.mnt / "durable").read_bytes() == data
    b.umount()


def test_force_and_a_crash_on_the_owners_own_host_take_over_without_the_grace_period(attach_loop, kvfs_factory):
    slow = 2.0                                                 # A's grace period: 8.5 s
    a, b = two_hosts(kvfs_factory, attach_loop, a_interval=slow)
    a.mount()
    (a.mnt / "one").write_bytes(b"1" * MiB)
    a.flush()
    a.kill9()
    b.mount("force")                                           # fstab/systemd spelling of --force
    assert "force was given" in b.log.read_text()              # taken over without watching
    (b.mnt / "two").write_bytes(b"2" * MiB)
    b.kill9()

    # Host B again, after its own crash: its pid is gone from this host, so no watching.
    b.mount()
    assert "its process no longer runs on this host" in b.log.read_text()   # taken over without watching
    assert (b.mnt / "one").read_bytes() == b"1" * MiB
    b.umount()


@pytest.mark.expect_errors("another host took the store over", "unmounted without writing back",
                           "writing back its content failed", "flush(ing a block)? failed")
def test_a_forced_takeover_fences_the_live_owner_and_the_new_owners_data_stays_intact(attach_loop,
                                                                                      kvfs_factory):
    a, b = two_hosts(kvfs_factory, attach_loop)
    a.mount()
    old = os.urandom(2 * MiB)
    (a.mnt / "old").write_bytes(old)
    a.flush()
    b.mount("force")
    # B's claim waited two heartbeat intervals: A's next heartbeat found B's record.
    wait_for(lambda: a.stats()["mmp_fenced"] == 1, "host A to notice the takeover")
    assert "another host took the store over" in a.stats()["mmp"] and "host id host-b" in a.stats()["mmp"]
    log = a.log.read_text()
    assert " CRITICAL kvfs.store: " in log and "stopped writing to the device" in log

    with pytest.raises(OSError) as refused:
        (a.mnt / "new-on-a").write_bytes(b"lost")
    assert refused.value.errno == errno.EROFS
    with pytest.raises(OSError) as refused:
        os.unlink(a.mnt / "old")
    assert refused.value.errno == errno.EROFS
    with pytest.raises(OSError) as refused:
        with open(a.mnt / "old", "r+b") as f:
            f.write(os.urandom(MiB))
            f.flush()
            os.fsync(f.fileno())
    assert refused.value.errno in (errno.EROFS, errno.EIO)
    assert (a.mnt / "old").read_bytes() == old                # reads of stored data go on, never wrong

    mine = os.urandom(3 * MiB + 1)
    (b.mnt / "new-on-b").write_bytes(mine)
    (b.mnt / "old").write_bytes(b"replaced by B")
    b.flush()
    a.umount()                                                 # writes nothing: no flush, no checkpoint
    assert "unmounted without writing back" in a.log.read_text()
    b.umount()
    b.assert_fsck_clean()
    a.mount()                                                  # the store now holds exactly B's changes
    assert (a.mnt / "new-on-b").read_bytes() == mine
    assert (a.mnt / "old").read_bytes() == b"replaced by B"
    assert not (a.mnt / "new-on-a").exists()
    a.umount()


@pytest.mark.expect_errors("heartbeat could not be written", "unmounted without writing back",
                           "writing back its content failed", "flush(ing a block)? failed")
def test_a_heartbeat_that_cannot_be_written_fences_the_mount(kvfs_factory):
    fs = kvfs_factory(size="256M", faults=[], mount_options=["io_retry=0", f"mmp_interval={FAST}"])
    fs.mkfs()
    fs.mount()
    kept = os.urandom(MiB)
    (fs.mnt / "kept").write_bytes(kept)
    fs.flush()
    mmp_sector = [8192, 12288]
    fs.set_faults([{"op": "write", "range": mmp_sector, "effect": "eio"}])
    wait_for(lambda: fs.stats()["mmp_fenced"] == 1, "the failed heartbeat to fence the mount")
    fs.set_faults([])                                          # the device recovers; the fence stays
    time.sleep(3 * FAST)
    stats = fs.stats()
    assert stats["mmp_fenced"] == 1 and "heartbeat could not be written" in stats["mmp"]
    assert stats["faults_injected"]["eio"] >= 1
    with pytest.raises(OSError) as refused:
        (fs.mnt / "after").write_bytes(b"x")
    assert refused.value.errno == errno.EROFS
    assert (fs.mnt / "kept").read_bytes() == kept
    fs.umount()
    # The record was left IN_USE, naming a pid that is gone: this host takes it over at once.
    fs.mount()
    assert "its process no longer runs on this host" in fs.log.read_text()
    assert (fs.mnt / "kept").read_bytes() == kept and not (fs.mnt / "after").exists()
    fs.umount()


def test_fsck_refuses_a_store_live_on_another_host_unless_forced(attach_loop, kvfs_factory):
    a, b = two_hosts(kvfs_factory, attach_loop)
    a.mount()
    (a.mnt / "f").write_bytes(os.urandom(MiB))
    a.flush()
    for args in ((), ("--repair",)):
        refused = run_tool("fsck", *args, b.device, check=False)
        assert refused.returncode == 1, refused.stdout
        assert "the store is in use" in refused.stderr and "host id host-a" in refused.stderr
        assert "fsck.kvfs checks no store that is in use (--force" in refused.stderr
    forced = run_tool("fsck", "--force", b.device, check=False)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "note: multi-mount protection: in use, owner host" in forced.stdout
    assert "note: warning: --force: not checked whether the MMP owner is alive" in forced.stdout
    a.umount()
    after = run_tool("fsck", b.device, check=False)
    assert after.returncode == 0
    assert "note: multi-mount protection: clean, last owner host" in after.stdout and "host-a" in after.stdout


def test_a_version_1_store_mounts_without_mmp_and_says_so(kvfs_factory):
    fs = kvfs_factory("v1")
    manifest = IMAGES / "format-v1.json"
    unpack_to(manifest.with_suffix(".img.xz").read_bytes(), fs.device)
    proc = try_mount(fs)
    assert proc.returncode == 0, proc.stderr
    fs.pid = fs.stats()["pid"]
    assert proc.stderr == "", "a mount that works prints nothing"
    assert "multi-mount protection needs a format version 2 store" in fs.log.read_text()
    stats = fs.stats()
    assert stats["mmp"] == "off (format version 1 store)" and "mmp_seq" not in stats
    fs.umount()
    assert "note: multi-mount protection: none (a format version 1 store)" in fs.fsck().stdout
