"""Device faults through a real mount, seen by writers, and counted (issue 12, "Faults from the device").

What must hold: a writer whose data cannot be made durable gets EIO from fsync, and
readers of that file get EIO, never stale or zero bytes; files committed before the
faults stay intact, byte for byte, after the plan is cleared and after a remount; the
daemon keeps serving the other files meanwhile; a device call that hangs gives its
caller EIO within io_timeout; and kvfs-admin stats counts the errors by kind. fsck is
clean at the end of every test (the fixture checks).

close() reports nothing: kvfs answers FUSE flush with ENOSYS (close returns at memory
speed, the data is written back in the background), so a flush failure reaches the
writer through fsync, and reaches every reader, but never close.

Each test prints a "FAULT-FIGURE kind injected outcome" line: the closing note's table
is `pytest -s tests/test_faults_writers.py | grep FAULT-FIGURE`.
"""
import errno
import os
import threading
import time

import pytest

from kvfs.device import Device
from kvfs.store import read_superblock
from kvfsmount import data_region, drop_kernel_cache, two_files, write_new

MiB = 1 << 20
FLUSH_FAILED = r"kvfs\.blockcache\.writeback: flushing a block failed"
SEAL_FAILED = r"kvfs\.namespace\.(durability|__init__): inode \d+: (flush|writing back its content) failed"
COMMIT_FAILED = r"kvfs\.namespace\.durability: committing metadata failed, will retry"
TIMED_OUT = r"kvfs\.device\.calls: .* did not return within [\d.]+ s \(io_timeout\)"


def figure(kind, injected, outcome):
    print(f"FAULT-FIGURE {kind} {injected} {outcome}")


def cold(fs):
    """The next reads go to the device: kvfs's clean cache and the kernel's page cache dropped."""
    fs.admin("drop-caches", fs.mnt)
    drop_kernel_cache()


def read_or_eio(path, size):
    """Read ``path`` MiB by MiB: (bytes read, reads that gave EIO). Any other error fails the test."""
    got, eio = [], 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in range(0, size, MiB):
            try:
                got.append((off, os.pread(fd, MiB, off)))
            except OSError as exc:
                assert exc.errno == errno.EIO, exc
                eio += 1
    finally:
        os.close(fd)
    return got, eio


def assert_right_or_eio(path, expected):
    got, eio = read_or_eio(path, len(expected))
    for off, data in got:
        assert data == expected[off:off + len(data)] and len(data) == min(MiB, len(expected) - off), \
            f"wrong or short bytes at {off}"
    return eio


def fsync_file(path, data=None, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    """Write ``data`` (if any) into ``path`` and fsync it; returns the fsync's OSError, or None."""
    fd = os.open(path, flags, 0o644)
    try:
        if data is not None:
            assert os.write(fd, data) == len(data)
        try:
            os.fsync(fd)
        except OSError as exc:
            return exc
        return None
    finally:
        os.close(fd)                 # never fails: kvfs answers FUSE flush with ENOSYS


def journal_range(fs):
    dev = Device.open(str(fs.device), readonly=True, lock=False)
    try:
        sb = read_superblock(dev)
    finally:
        dev.close()
    return [sb.journal_off, sb.journal_off + sb.journal_len]


def wait_for(predicate, what, limit=30.0):
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def delta(before, after, key):
    return after[key] - before[key]


def injected(stats, effect, since=None):
    """Faults of ``effect`` the daemon injected (since the statistics ``since``): over every plan."""
    return stats["faults_injected"][effect] - (since["faults_injected"][effect] if since else 0)


@pytest.mark.expect_errors(COMMIT_FAILED, TIMED_OUT, FLUSH_FAILED,
                           r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
def test_device_errors_are_counted_by_kind(kvfs_factory):
    """Each kind of fault moves its own counter by exactly what was injected."""
    # No timed commits: the sync fault must hit the commit the test's fsync makes, not
    # a background one that happens to run first on a slow host (its records would then
    # be committed again by that fsync, which rightly succeeds).
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0", "io_timeout=1", "commit_interval=3600"])
    fs.mkfs()
    fs.mount()
    victim, other, victim_range = two_files(fs)
    end = os.path.getsize(fs.device)
    data_range = [data_region(fs), end]
    assert fs.stats()["direct_io"], "with buffered I/O an MMP heartbeat would take the sync fault"

    # A read EIO (twice): the readers get the right bytes or EIO.
    cold(fs)
    before = fs.stats()
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "eio", "count": 2}])
    eio = assert_right_or_eio(fs.mnt / "victim", victim)
    after = fs.stats()
    assert delta(before, after, "device_read_errors") == injected(after, "eio", before) == 2, after
    figure("read-eio", 2, f"EIO to {eio} read(s), the other reads right; 0 wrong bytes")

    # A write EIO (once): the flush is retried and the file is right.
    before = fs.stats()
    fs.set_faults([{"op": "write", "range": data_range, "effect": "eio", "count": 1}])
    fresh = os.urandom(2 * MiB)                  # new blocks (a dedup hit writes nothing)
    assert fsync_file(fs.mnt / "w", fresh) is None
    after = fs.stats()
    assert delta(before, after, "device_write_errors") == injected(after, "eio", before) == 1, after
    assert (fs.mnt / "w").read_bytes() == fresh
    figure("write-eio", 1, "flush retried, fsync ok, right bytes")

    # A flush (fdatasync) EIO: the fsync that needed that commit gets EIO; the next one works.
    before = fs.stats()
    fs.set_faults([{"op": "sync", "effect": "eio", "count": 1}])
    err = fsync_file(fs.mnt / "s", b"synced" * 1000)
    assert err is not None and err.errno == errno.EIO, err
    assert fsync_file(fs.mnt / "s", flags=os.O_WRONLY) is None
    after = fs.stats()
    assert delta(before, after, "device_sync_errors") == injected(after, "eio", before) == 1, after
    figure("sync-eio", 1, "EIO to the fsync that needed it, the next fsync ok")

    # A discard EIO: best effort, nothing for the application to see.
    before = fs.stats()
    fs.set_faults([{"op": "discard", "effect": "eio", "count": 1}])
    os.unlink(fs.mnt / "w")
    fs.flush()                                   # the unlink is committed: its extents are discarded
    wait_for(lambda: injected(fs.stats(), "eio", before) == 1, "the discard")
    after = fs.stats()
    assert delta(before, after, "device_discard_errors") == 1, after
    figure("discard-eio", 1, "none (discard is best effort)")

    # A short read: absorbed by the device's loop, the bytes are right.
    cold(fs)
    before = fs.stats()
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "short", "count": 1}])
    assert assert_right_or_eio(fs.mnt / "victim", victim) == 0
    after = fs.stats()
    assert delta(before, after, "device_short_transfers") == injected(after, "short", before) == 1, after
    assert delta(before, after, "device_read_errors") == 0
    figure("short-read", 1, "absorbed, right bytes")

    # A silent bit flip: the block's checksum catches it; the reader gets EIO or right bytes.
    cold(fs)
    before = fs.stats()
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "flip", "count": 2}])
    eio = assert_right_or_eio(fs.mnt / "victim", victim)
    after = fs.stats()
    assert delta(before, after, "corrupt_reads") == injected(after, "flip", before) == 2, after
    assert delta(before, after, "device_read_errors") == 0
    figure("read-flip", 2, f"EIO to {eio} read(s), the other reads right; 0 wrong bytes")

    # A latency spike below io_timeout: slower, nothing else.
    cold(fs)
    before = fs.stats()
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "delay", "seconds": 0.3, "count": 2}])
    assert assert_right_or_eio(fs.mnt / "victim", victim) == 0
    after = fs.stats()
    assert injected(after, "delay", before) == 2 and delta(before, after, "device_timeouts") == 0, after
    figure("read-delay", 2, "slower, right bytes")

    # A stall far longer than io_timeout: EIO within the bound, counted as timeouts.
    cold(fs)
    before = fs.stats()
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "stall", "seconds": 4}])
    fd = os.open(fs.mnt / "victim", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            os.pread(fd, MiB, 0)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EIO
    after = fs.stats()
    # The EIO is io_timeout's (a stall that ends completes the read): counted as timeouts.
    assert 1 <= delta(before, after, "device_timeouts") <= injected(after, "stall", before), after
    wait_for(lambda: fs.stats()["device_late_calls"] == 0, "the late reads to finish")
    fs.set_faults([])
    assert assert_right_or_eio(fs.mnt / "victim", victim) == 0
    figure("read-stall-past-io_timeout", injected(after, "stall", before), "EIO within io_timeout, right bytes after")
    out = fs.admin("stats", fs.mnt).stdout
    assert "  device    failed 2 read, 1 write, 1 sync, 1 discard; " in out, out


@pytest.mark.expect_errors(FLUSH_FAILED, SEAL_FAILED)
def test_fsync_gets_eio_when_data_cannot_be_written_and_other_files_stay_intact(kvfs_factory):
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0"])
    fs.mkfs()
    fs.mount()
    kept = {name: os.urandom(3 * MiB + 17) for name in ("a", "b")}
    for name, data in kept.items():
        assert fsync_file(fs.mnt / name, data) is None
    fs.set_faults([{"op": "write", "range": [data_region(fs), os.path.getsize(fs.device)], "effect": "eio"}])
    err = fsync_file(fs.mnt / "lost", os.urandom(3 * MiB))
    assert err is not None and err.errno == errno.EIO, err
    assert fs.stats()["device_write_errors"] >= 1          # the device's refusal, passed on
    cold(fs)
    with pytest.raises(OSError) as info:               # a reader of the lost file: EIO, not zeros
        (fs.mnt / "lost").read_bytes()
    assert info.value.errno == errno.EIO
    err = fsync_file(fs.mnt / "lost", flags=os.O_WRONLY)   # and a later fsync says so again
    assert err is not None and err.errno == errno.EIO
    for name, data in kept.items():                    # the daemon serves the rest meanwhile
        assert (fs.mnt / name).read_bytes() == data
    assert sorted(os.listdir(fs.mnt)) == [".kvfs", "a", "b", "lost"]
    stats = fs.stats()
    assert stats["device_write_errors"] >= 1 and stats["device_write_errors"] == injected(stats, "eio")
    figure("write-eio-permanent", injected(stats, "eio"), "EIO to fsync and readers; other files right")
    fs.set_faults([])
    for name, data in kept.items():
        assert (fs.mnt / name).read_bytes() == data
    fs.remount()
    for name, data in kept.items():
        assert (fs.mnt / name).read_bytes() == data
    # Created, but no content of it ever became durable: a file that never got a content
    # record is dropped at mount (provisional, kvfs/namespace/tree.py), never shown empty.
    assert not (fs.mnt / "lost").exists()
    fs.umount()
    fs.assert_fsck_clean()


@pytest.mark.expect_errors(FLUSH_FAILED, SEAL_FAILED)
def test_a_background_flush_that_fails_after_close_reaches_fsync_and_readers(kvfs_factory):
    """close() returns at once (and cannot report what is not yet known); the flush fails
    afterwards, and from then on fsync and every reader get EIO, never the old bytes."""
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0"])
    fs.mkfs()
    fs.mount()
    old, new, bystander = os.urandom(3 * MiB), os.urandom(3 * MiB), os.urandom(2 * MiB)
    assert fsync_file(fs.mnt / "f", old) is None
    assert fsync_file(fs.mnt / "bystander", bystander) is None
    fs.set_faults([{"op": "write", "range": [data_region(fs), os.path.getsize(fs.device)], "effect": "eio"}])
    before = fs.stats()
    fd = os.open(fs.mnt / "f", os.O_WRONLY)            # an overwrite in place: the old bytes are on disk
    assert os.write(fd, new) == len(new)
    os.close(fd)                                       # returns 0: the flush has not even started
    wait_for(lambda: delta(before, fs.stats(), "device_write_errors") >= 3 and fs.stats()["dirty_bytes"] == 0,
             "the background flush to fail")
    err = fsync_file(fs.mnt / "f", flags=os.O_WRONLY)
    assert err is not None and err.errno == errno.EIO, err
    cold(fs)
    for _ in range(2):                                 # every reader, not just the first
        with pytest.raises(OSError) as info:
            (fs.mnt / "f").read_bytes()
        assert info.value.errno == errno.EIO
    assert (fs.mnt / "bystander").read_bytes() == bystander
    stats = fs.stats()
    figure("write-eio-after-close", injected(stats, "eio"), "EIO to the later fsync and readers; close 0")
    fs.set_faults([])
    with pytest.raises(OSError):                       # the loss sticks until the file is rewritten
        (fs.mnt / "f").read_bytes()
    fs.remount()
    assert (fs.mnt / "f").read_bytes() == old          # the last fsynced content: new was never durable
    assert (fs.mnt / "bystander").read_bytes() == bystander
    write_new(fs.mnt / "f", new)
    fs.flush()
    assert (fs.mnt / "f").read_bytes() == new


@pytest.mark.expect_errors(COMMIT_FAILED)
def test_a_journal_write_eio_fails_the_fsync_and_committed_files_survive(kvfs_factory):
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0"])
    fs.mkfs()
    fs.mount()
    kept = os.urandom(3 * MiB)
    assert fsync_file(fs.mnt / "kept", kept) is None
    fs.set_faults([{"op": "write", "range": journal_range(fs), "effect": "eio"}])
    pending = os.urandom(2 * MiB)
    err = fsync_file(fs.mnt / "pending", pending)
    assert err is not None and err.errno == errno.EIO, err
    assert (fs.mnt / "kept").read_bytes() == kept
    stats = fs.stats()
    assert stats["device_write_errors"] == injected(stats, "eio") >= 1
    figure("journal-write-eio", injected(stats, "eio"), "EIO to the fsync; committed files right")
    fs.set_faults([])
    assert fsync_file(fs.mnt / "pending", flags=os.O_WRONLY) is None     # the journal works again
    fs.remount()
    assert (fs.mnt / "kept").read_bytes() == kept
    assert (fs.mnt / "pending").read_bytes() == pending


@pytest.mark.expect_errors(TIMED_OUT)
def test_a_stalled_read_times_out_while_other_files_are_served(kvfs_factory):
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0", "io_timeout=1"])
    fs.mkfs()
    fs.mount()
    victim, other, victim_range = two_files(fs)
    cold(fs)
    stall = 8.0
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "stall", "seconds": stall}])
    result = {}

    def reader():
        try:
            (fs.mnt / "victim").read_bytes()
            result["error"] = None
        except OSError as exc:
            result["error"] = exc

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.3)
    assert (fs.mnt / "other").read_bytes() == other      # served while the victim's reader waits
    thread.join(60)
    assert not thread.is_alive(), "the reader of the stalled region was never released"
    assert result["error"] is not None and result["error"].errno == errno.EIO, result
    # Released by io_timeout, not by the stall's end: its calls were still running.
    stats = fs.stats()
    assert stats["device_timeouts"] >= 1 and stats["device_late_calls"] >= 1, stats
    wait_for(lambda: fs.stats()["device_late_calls"] == 0, "the late reads to finish", limit=stall + 10)
    fs.set_faults([])
    assert fs.stats()["device_read_errors"] == 0
    assert (fs.mnt / "victim").read_bytes() == victim    # nothing wrong was kept from the late reads
    figure("read-stall-concurrent", injected(stats, "stall"), "EIO within io_timeout; others served")
