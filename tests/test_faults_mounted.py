"""Injected device faults through a real mount (kvfs/device/testfaults.py, issues 8 and 12).

The daemon gets its plan from KvfsMount(faults=...) and picks up every
KvfsMount.set_faults while it runs. What must hold: a slow device does not slow
close() while there is room for dirty data; a reader gets the right bytes or
EIO, never wrong bytes; a stall window holds reads and then completes them;
the daemon keeps serving; fsck is clean at the end (the fixture checks).
"""
import errno
import os
import threading
import time

import pytest

from kvfsmount import data_region, two_files, write_new

MiB = 1 << 20


def test_slow_device_keeps_close_at_memory_speed(kvfs_factory):
    fs = kvfs_factory(faults=[{"op": "write", "effect": "delay", "seconds": 1.5}])
    fs.mkfs()
    fs.mount()
    data = os.urandom(8 * MiB + 123)
    write_new(fs.mnt / "chunk", data)            # 9 blocks, each 1.5 s to the device
    stats = fs.stats()
    # Closed with the data still dirty, and the writer never waited for room.
    assert stats["writers_throttled"] == 0, stats
    assert stats["dirty_bytes"] > 0 and stats["flush_backlog_bytes"] > 0, stats
    assert (fs.mnt / "chunk").read_bytes() == data
    fs.flush()
    stats = fs.stats()
    assert stats["dirty_bytes"] == 0 and stats["data_bytes_written"] >= len(data)
    assert stats["faults_injected"]["delay"] >= 9, stats["faults_injected"]
    fs.set_faults([])                   # the remount's writes need no 1.5 s each
    fs.remount()
    assert (fs.mnt / "chunk").read_bytes() == data


@pytest.mark.expect_errors(r"kvfs\.blockindex: block [0-9a-f]+ at device offset \d+ fails its checksum")
@pytest.mark.parametrize("effect", ["eio", "flip"])
def test_bad_reads_give_eio_never_wrong_bytes(kvfs_factory, effect):
    fs = kvfs_factory(faults=[], mount_options=["io_retry=0"])     # a dead sector: no path to wait for
    fs.mkfs()
    fs.mount()
    victim, other, victim_range = two_files(fs)
    fs.umount()                                  # cold caches: the next reads go to the device
    fs.set_faults([{"op": "read", "range": victim_range, "effect": effect}])
    fs.mount()
    fd = os.open(fs.mnt / "victim", os.O_RDONLY)
    try:
        for off in range(0, len(victim), MiB):
            with pytest.raises(OSError) as info:
                got = os.pread(fd, MiB, off)
                assert got == victim[off:off + MiB], "wrong bytes"   # only if the read succeeded
            assert info.value.errno == errno.EIO
    finally:
        os.close(fd)
    assert (fs.mnt / "other").read_bytes() == other            # the daemon serves the rest
    write_new(fs.mnt / "new", b"still writable")
    assert (fs.mnt / "new").read_bytes() == b"still writable"
    stats = fs.stats()
    assert stats["faults_injected"][effect] >= 3, stats["faults_injected"]
    if effect == "flip":
        assert stats["corrupt_reads"] >= 3, stats                 # the checksum caught each one
    fs.set_faults([])                                           # the device heals: nothing stuck
    assert (fs.mnt / "victim").read_bytes() == victim


def test_stall_window_delays_reads_then_completes_them(kvfs_factory):
    fs = kvfs_factory(faults=[])
    fs.mkfs()
    fs.mount()
    victim, _, _ = two_files(fs)
    fs.umount()
    fs.mount()
    stall = 6.0
    fs.set_faults([{"op": "read", "range": [data_region(fs), os.path.getsize(fs.device)],
                    "effect": "stall", "seconds": stall}])
    result = {}

    def reader():
        try:
            result["data"] = (fs.mnt / "victim").read_bytes()
        except BaseException as exc:   # noqa: BLE001 - handed to the test below
            result["error"] = exc

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.5)
    assert "victim" in os.listdir(fs.mnt)        # metadata is served during the stall:
    assert (fs.mnt / "victim").stat().st_size == len(victim)
    # answered while the read was still held, so not held by the stall itself.
    assert thread.is_alive(), "the read did not wait for the stall window"
    thread.join(60)
    assert not thread.is_alive(), "the read never completed after the stall window"
    if "error" in result:
        raise result["error"]
    assert result["data"] == victim
    assert fs.stats()["faults_injected"]["stall"] >= 1       # the read's calls waited in the window


def test_a_reconnect_window_is_retried_and_a_longer_one_gives_eio(kvfs_factory):
    """An NVMe-oF controller reconnect that fails I/O fast: reads inside io_retry
    succeed once the path is back; a path loss longer than io_retry gives EIO,
    within a bound, and the daemon keeps serving."""
    fs = kvfs_factory(faults=[], mount_options=["io_retry=3"])
    fs.mkfs()
    fs.mount()
    victim, other, victim_range = two_files(fs)
    fs.umount()
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "eio", "seconds": 1.5}])
    fs.mount()
    assert (fs.mnt / "victim").read_bytes() == victim          # retried until the path came back
    stats = fs.stats()
    assert stats["device_io_retries"] > 0 and stats["faults_injected"]["eio"] > 0, stats
    fs.umount()
    fs.set_faults([{"op": "read", "range": victim_range, "effect": "eio", "seconds": 30}])
    fs.mount()
    with pytest.raises(OSError) as info:
        (fs.mnt / "victim").read_bytes()
    assert info.value.errno == errno.EIO
    # Retried within io_retry, then given up: a read error, not a hang (nor an error at once).
    stats = fs.stats()
    assert stats["device_io_retries"] >= 2 and stats["device_read_errors"] >= 1, stats
    assert (fs.mnt / "other").read_bytes() == other             # the rest is served meanwhile
    fs.set_faults([])
