"""Device: aligned transfers, bounds, locking, statistics, error mapping.

The slow-device test hook (write_delay) is gone from Device; a delay is now a
fault plan, tested in test_faults.py (test_delay_slows_matching_calls_in_a_worker_thread).
"""
import errno
import os

import pytest

from kvfs.device import Device
from kvfs.errors import (Busy, DeviceError, DeviceFull, InternalError, NoSpace, NotADevice, NotFound,
                         device_error)

from .helpers import DEV_SIZE, assert_fsck_clean, mkfs, pattern, peek

S = 4096


def test_unaligned_reads_and_padded_writes(tmp_path):
    path = mkfs(tmp_path)
    dev = Device.open(str(path))
    try:
        off = DEV_SIZE - 16 * S                   # the tail of the data region, unused
        data = pattern(1, 3 * S + 100)
        dev.pwrite_sync(off, data)
        assert peek(path, off, len(data)) == data
        assert peek(path, off + len(data), S - 100) == bytes(S - 100)   # zero padded to a sector
        assert dev.pread_sync(off + 5, 7000) == data[5:7005]           # unaligned span
        assert dev.pread_sync(off, 0) == b""
        st = dev.statistics()
        assert st.bytes_written == 4 * S and st.writes == 1
        assert st.reads == 1 and st.bytes_read == 2 * S
        dev.sync_sync()
        assert dev.statistics().syncs == 1
    finally:
        dev.close()
    assert_fsck_clean(path)


def test_bounds_and_alignment_are_checked(tmp_path):
    path = mkfs(tmp_path)
    dev = Device.open(str(path))
    try:
        with pytest.raises(DeviceError, match="outside the device"):
            dev.pread_sync(DEV_SIZE - 10, 11)
        with pytest.raises(DeviceError, match="outside the device"):
            dev.pread_sync(-1, 1)
        # A misplaced write is a bug in the layer above (the allocator never hands
        # out such an extent): EIO, never ENOSPC, which would pass for a full disk.
        with pytest.raises(InternalError, match="unaligned") as info:
            dev.pwrite_sync(DEV_SIZE - 2 * S + 1, b"x")
        assert info.value.errno == errno.EIO
        with pytest.raises(InternalError, match="unaligned block read"):
            dev.read_block_sync(S + 1, S)
        with pytest.raises(InternalError, match="outside the device") as info:
            dev.pwrite_sync(DEV_SIZE - S, bytes(S + 1))
        assert info.value.errno == errno.EIO
        assert not isinstance(info.value, NoSpace)
        assert dev.statistics().writes == 0
    finally:
        dev.close()
    assert_fsck_clean(path)


def test_open_errors_and_exclusive_lock(tmp_path):
    # The errno comes with the error's class (issue 8, item 5).
    with pytest.raises(NotFound) as info:
        Device.open(str(tmp_path / "missing"))
    assert info.value.errno == errno.ENOENT
    with pytest.raises(NotADevice) as info:
        Device.open(str(tmp_path))
    assert info.value.errno == errno.ENODEV
    path = mkfs(tmp_path)
    dev = Device.open(str(path))
    try:
        with pytest.raises(Busy, match="in use") as info:
            Device.open(str(path))
        assert info.value.errno == errno.EBUSY
        Device.open(str(path), lock=False).close()
    finally:
        dev.close()
    Device.open(str(path)).close()                 # the lock went with the close
    assert_fsck_clean(path)


def test_failed_write_is_a_device_error(tmp_path):
    path = mkfs(tmp_path)
    dev = Device.open(str(path), readonly=True)     # every write fails with EBADF
    try:
        with pytest.raises(DeviceError, match="device write at .* Bad file descriptor") as info:
            dev.pwrite_sync(DEV_SIZE - S, b"x")
        # The class sets the errno: a failed transfer is EIO (the cause is in the message).
        assert info.value.errno == errno.EIO
        assert not isinstance(info.value, DeviceFull)
        assert dev.statistics().writes == 0
    finally:
        dev.close()
    assert_fsck_clean(path)


@pytest.mark.parametrize("os_errno, cls, want", [(errno.ENOSPC, DeviceFull, errno.ENOSPC),
                                                 (errno.EDQUOT, DeviceFull, errno.ENOSPC),
                                                 (errno.EIO, DeviceError, errno.EIO),
                                                 (errno.EBADF, DeviceError, errno.EIO)])
def test_device_syscall_errors_map_to_classes(os_errno, cls, want):
    """Only a full host filesystem below the store is ENOSPC; every other failure is EIO."""
    err = device_error(OSError(os_errno, os.strerror(os_errno)), "device write at 0 failed")
    assert type(err) is cls
    assert err.errno == want
    assert str(err) == "device write at 0 failed"


def _rchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_small_reads_transfer_only_the_sectors_asked_for(tmp_path):
    path = mkfs(tmp_path)
    dev = Device.open(str(path))
    try:
        off = DEV_SIZE - 64 * S
        dev.pwrite_sync(off, pattern(2, S))
        assert dev.pread_sync(off, 100) == pattern(2, S)[:100]      # the thread buffer now exists
        before = _rchar()
        assert dev.pread_sync(off, 100) == pattern(2, S)[:100]
        moved = _rchar() - before
        assert dev.statistics().bytes_read == 2 * S                 # what the device layer reports ...
        assert moved <= 2 * S, f"a 100-byte read moved {moved} bytes"   # ... and what it really read
    finally:
        dev.close()
    assert_fsck_clean(path)


def test_block_reads_into_a_recycled_buffer_transfer_only_the_block(tmp_path):
    import mmap
    path = mkfs(tmp_path)
    dev = Device.open(str(path))
    try:
        off = DEV_SIZE - 64 * S
        dev.pwrite_sync(off, pattern(3, 100))
        recycled = mmap.mmap(-1, 1 << 20)                 # a block buffer the cache hands back
        before = _rchar()
        view = dev.read_block_sync(off, 100, recycled)
        moved = _rchar() - before
        assert bytes(view) == pattern(3, 100)
        assert moved <= 2 * S, f"a 100-byte block read moved {moved} bytes"
    finally:
        dev.close()
    assert_fsck_clean(path)
