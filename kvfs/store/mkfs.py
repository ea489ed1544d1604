"""Making a new store: create the file if asked, check what is there, write an empty kvfs."""
from __future__ import annotations

import os
import stat
import time
from typing import Optional

import msgpack

from .. import schema
from ..device import Device
from ..device.port import DevicePort
from ..errors import InvalidArgument, NotFound


def make_filesystem(path: str | os.PathLike, size: Optional[int] = None,
                    block_size: int = schema.DEFAULT_BLOCK_SIZE, force: bool = False) -> schema.Superblock:
    """Create (if needed) and format ``path``. Returns the new superblock.

    Every argument is checked before anything on disk changes. If formatting
    still fails, a file that this call created is removed again; an existing
    file or device is never removed.
    """
    schema.check_block_size(block_size)
    if size is not None:
        schema.check_device_size(size)
    exists = os.path.exists(path)
    if exists:
        st = os.stat(path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise InvalidArgument(f"{path}: not a regular file or block device")
        resize = stat.S_ISREG(st.st_mode) and size is not None and st.st_size != size
        if resize and st.st_size and not force:
            raise InvalidArgument(f"{path} exists with size {st.st_size}; use --force to resize it")
        if not resize and stat.S_ISREG(st.st_mode):
            schema.check_device_size(st.st_size)
        if resize:
            os.truncate(path, size)
        return _format(path, block_size, check_existing=not force)
    if size is None:
        raise NotFound(f"{path} does not exist: give --size to create it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise NotFound(f"{parent}: no such directory")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    created = os.fstat(fd)
    try:
        try:
            os.ftruncate(fd, size)            # sparse: no space used until data lands
        finally:
            os.close(fd)
        return _format(path, block_size, check_existing=False)
    except BaseException:
        _remove_if_ours(path, created)
        raise


def _format(path, block_size, check_existing):
    if stat.S_ISREG(os.stat(path).st_mode):
        # The superblock holds the content-key secret, and the data is every
        # tenant's: only root (the owner) may read a store file (docs/reliability.md).
        os.chmod(path, 0o600)
    device = Device.open(path)
    try:
        if check_existing:
            head = device.pread_sync(0, min(device.size, 128 << 10))
            found = schema.identify_existing_data(head)
            if found:
                raise InvalidArgument(f"{path} already holds {found}; refusing to overwrite it without --force")
        return format_device(device, block_size, time.time_ns())
    finally:
        device.close()


def _remove_if_ours(path, created):
    """Remove ``path`` only if it is still the very file mkfs created (same inode)."""
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == (created.st_dev, created.st_ino):
            os.unlink(path)
    except OSError:
        pass


def format_device(device: DevicePort, block_size: int, now_ns: int) -> schema.Superblock:
    """Write a fresh, empty filesystem (mkfs). Returns the superblock."""
    sb = schema.Superblock.create(device.size, block_size, now_ns)
    empty = msgpack.packb({})
    zero = b"\0" * schema.SECTOR
    for off in (sb.checkpoint_b_off, sb.journal_off) + ((sb.mmp_off,) if sb.has_mmp else ()):
        device.pwrite_sync(off, zero)
    device.pwrite_sync(sb.checkpoint_a_off, schema.encode_checkpoint_header(1, empty, sb.hash_seed) + empty)
    device.sync_sync()
    # Superblocks last: until they are written the device is not a kvfs.
    device.pwrite_sync(0, sb.encode() + sb.encode())
    device.sync_sync()
    device.discard_sync(sb.data_off, sb.data_len)
    reserve_metadata_space(device, sb)
    return sb


def reserve_metadata_space(device: DevicePort, sb: schema.Superblock) -> None:
    """Back the checkpoint slots and the journal with real host space (file-backed stores)."""
    device.preallocate_sync(sb.checkpoint_a_off, sb.data_off - sb.checkpoint_a_off)
