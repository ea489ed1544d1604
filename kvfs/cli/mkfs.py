"""mkfs.kvfs: format a block device or (sparse) regular file as kvfs."""
import os
import stat
import sys
import time

from .. import format as fmt
from ..device import Device
from ..errors import KvfsError
from ..extents import format_device
from . import Parser, parse_size, tool


def make_filesystem(path, size=None, block_size=fmt.DEFAULT_BLOCK_SIZE, force=False):
    """Create (if needed) and format ``path``. Returns the new superblock.

    Every argument is checked before anything on disk changes. If formatting
    still fails, a file that this call created is removed again; an existing
    file or device is never removed.
    """
    fmt.check_block_size(block_size)
    if size is not None:
        fmt.check_device_size(size)
    exists = os.path.exists(path)
    if exists:
        st = os.stat(path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise KvfsError(f"{path}: not a regular file or block device")
        resize = stat.S_ISREG(st.st_mode) and size is not None and st.st_size != size
        if resize and st.st_size and not force:
            raise KvfsError(f"{path} exists with size {st.st_size}; use --force to resize it")
        if not resize and stat.S_ISREG(st.st_mode):
            fmt.check_device_size(st.st_size)
        if resize:
            os.truncate(path, size)
        return _format(path, block_size, check_existing=not force)
    if size is None:
        raise KvfsError(f"{path} does not exist: give --size to create it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise KvfsError(f"{parent}: no such directory")
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
    device = Device.open(path)
    try:
        if check_existing:
            head = device.pread_sync(0, min(device.size, 128 << 10))
            found = fmt.identify_existing_data(head)
            if found:
                raise KvfsError(f"{path} already holds {found}; refusing to overwrite it without --force")
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


@tool("mkfs.kvfs")
def main(argv):
    p = Parser(prog="mkfs.kvfs", description="Create a kvfs filesystem on DEVICE (a block device "
               "or a regular file; a missing file is created sparse at --size).")
    p.add_argument("--size", type=parse_size, help="size of a new or resized store file (K/M/G/T suffixes)")
    p.add_argument("--block-size", type=parse_size, default=fmt.DEFAULT_BLOCK_SIZE,
                   help="content block size (default 1M: one FUSE request, 32 blocks per 32 MiB KV chunk)")
    p.add_argument("--force", action="store_true", help="overwrite existing kvfs or other data")
    p.add_argument("device", help="block device or store file")
    args = p.parse_args(argv)
    sb = make_filesystem(args.device, args.size, args.block_size, args.force)
    print(f"kvfs created on {args.device}: {sb.data_len / (1 << 30):.2f} GiB for data, "
          f"block size {sb.block_size >> 10} KiB, uuid {sb.uuid.hex()}")


if __name__ == "__main__":
    sys.exit(main())
