"""kvfs-admin: statistics and control of a mounted kvfs.

It talks to the daemon through two extended attributes on the mount root:
reading ``user.kvfs.stats`` returns JSON statistics, and writing a command to
``user.kvfs.control`` (root only) runs it and returns when it is done.
"""
import errno
import json
import os
import sys
import time

from .. import metrics
from ..errors import KvfsError
from . import Parser, tool

STATS_XATTR = "user.kvfs.stats"
CONTROL_XATTR = "user.kvfs.control"


def _not_kvfs(mountpoint, exc):
    if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
        return KvfsError(f"{mountpoint} is not a mounted kvfs", errno.EINVAL)
    return KvfsError(f"{mountpoint}: {exc.strerror}", exc.errno)


def read_stats(mountpoint):
    if not os.path.isdir(mountpoint):
        raise KvfsError(f"{mountpoint}: no such directory", errno.ENOENT)
    try:
        return json.loads(os.getxattr(mountpoint, STATS_XATTR))
    except OSError as exc:
        if exc.errno == errno.EACCES:
            raise KvfsError(f"{mountpoint}: statistics are readable only by root and the mount's owner",
                            exc.errno) from None
        raise _not_kvfs(mountpoint, exc) from None


def send(mountpoint, command):
    read_stats(mountpoint)                          # a clear error if this is not kvfs
    try:
        os.setxattr(mountpoint, CONTROL_XATTR, command.encode())
    except OSError as exc:
        raise _not_kvfs(mountpoint, exc) from None


def process_exited(pid):
    """True once ``pid`` has exited, a zombie awaiting its reaper included."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def wait_exited(pid, timeout):
    """Wait up to ``timeout`` seconds for ``pid`` to exit; return whether it did."""
    deadline = time.monotonic() + timeout
    while not process_exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def umount(mountpoint, timeout=600):
    """Flush, unmount, and wait until the daemon process has exited."""
    pid = read_stats(mountpoint)["pid"]
    send(mountpoint, "umount")
    deadline = time.monotonic() + timeout
    if wait_exited(pid, timeout):
        # The daemon unmounts before it exits; give the kernel a moment to agree.
        while os.path.ismount(mountpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.ismount(mountpoint):
            return
    raise KvfsError(f"daemon {pid} did not exit within {timeout} s", errno.ETIMEDOUT)


def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def print_stats(stats):
    width = max(map(len, stats))
    for name in sorted(stats):
        value = stats[name]
        shown = f"{value}  ({_human(value)})" if name.endswith("bytes") and isinstance(value, int) else value
        print(f"{name:<{width}}  {shown}")


@tool("kvfs-admin")
def main(argv):
    p = Parser(prog="kvfs-admin", description="Inspect and control a mounted kvfs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    s = sub.add_parser("stats", help="print statistics", description="Print the statistics of a mounted kvfs.")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("mountpoint")
    m = sub.add_parser("metrics", help="print the Prometheus text exposition",
                       description="Print the statistics of a mounted kvfs in the Prometheus text format "
                                   "(what the metrics_port= mount option serves at /metrics).")
    m.add_argument("--json", action="store_true", help="print the metric families as JSON")
    m.add_argument("mountpoint")
    for name, text in (("flush", "make all written data and metadata durable"),
                       ("drop-caches", "empty kvfs's clean block cache (makes the next reads cold)"),
                       ("checkpoint", "flush, then write a checkpoint and empty the journal"),
                       ("umount", "flush, unmount and wait for the daemon to exit")):
        sp = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        sp.add_argument("mountpoint")
    args = p.parse_args(argv)
    mnt = os.path.abspath(args.mountpoint)
    if args.command == "stats":
        stats = read_stats(mnt)
        if args.json:
            print(json.dumps(stats, indent=2, sort_keys=True))
        else:
            print_stats(stats)
    elif args.command == "metrics":
        stats = read_stats(mnt)
        if args.json:
            print(json.dumps(metrics.as_json(stats), indent=2))
        else:
            sys.stdout.write(metrics.exposition(stats))
    elif args.command == "umount":
        umount(mnt)
    else:
        send(mnt, args.command)


if __name__ == "__main__":
    sys.exit(main())
