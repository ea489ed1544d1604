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
    """Create (if needed) and format ``path``. Returns the new superblock."""
    exists = os.path.exists(path)
    if exists:
        st = os.stat(path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise KvfsError(f"{path}: not a regular file or block device")
        if stat.S_ISREG(st.st_mode) and size is not None and st.st_size != size:
            if st.st_size and not force:
                raise KvfsError(f"{path} exists with size {st.st_size}; use --force to resize it")
            os.truncate(path, size)
    else:
        if size is None:
            raise KvfsError(f"{path} does not exist: give --size to create it")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise KvfsError(f"{parent}: no such directory")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)            # sparse: no space used until data lands
        finally:
            os.close(fd)
    device = Device.open(path)
    try:
        if exists and not force:
            head = device.pread_sync(0, min(device.size, 128 << 10))
            found = fmt.identify_existing_data(head)
            if found:
                raise KvfsError(f"{path} already holds {found}; refusing to overwrite it without --force")
        return format_device(device, block_size, time.time_ns())
    finally:
        device.close()


@tool
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
