"""mkfs.kvfs: format a block device or (sparse) regular file as kvfs."""
import sys

from .. import schema
from ..store.mkfs import make_filesystem
from . import Parser, parse_size, tool


@tool("mkfs.kvfs")
def main(argv):
    p = Parser(prog="mkfs.kvfs", description="Create a kvfs filesystem on DEVICE (a block device "
               "or a regular file; a missing file is created sparse at --size).")
    p.add_argument("--size", type=parse_size, help="size of a new or resized store file (K/M/G/T suffixes)")
    p.add_argument("--block-size", type=parse_size, default=schema.DEFAULT_BLOCK_SIZE,
                   help="content block size (default 1M: one FUSE request, 32 blocks per 32 MiB KV chunk)")
    p.add_argument("--force", action="store_true", help="overwrite existing kvfs or other data")
    p.add_argument("device", help="block device or store file")
    args = p.parse_args(argv)
    sb = make_filesystem(args.device, args.size, args.block_size, args.force)
    print(f"kvfs created on {args.device}: {sb.data_len / (1 << 30):.2f} GiB for data, "
          f"block size {sb.block_size >> 10} KiB, uuid {sb.uuid.hex()}")


if __name__ == "__main__":
    sys.exit(main())
