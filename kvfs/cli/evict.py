"""kvfs-admin evict, pin and unpin: make room now, or keep files from ever being evicted.

They run in the daemon through the control channel: the command goes to
``user.kvfs.control`` with JSON arguments, and its answer comes back from
``user.kvfs.result``. Paths are turned into inode numbers here, so the daemon
acts on exactly the files named, whatever their names are.
"""
import argparse
import glob
import json
import os
import re

from ..errors import InvalidArgument, NotFound
from . import parse_size, progress

RESULT_XATTR = "user.kvfs.result"
_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text):
    """'90', '90s', '10m', '2h', '1d' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (use e.g. 90s, 10m, 2h, 1d)")
    return float(m.group(1)) * _DURATION[m.group(2) or "s"]


def parse_percent(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%?\s*", text)
    if not m or not 0 <= float(m.group(1)) <= 100:
        raise argparse.ArgumentTypeError(f"invalid percentage {text!r} (0 to 100)")
    return float(m.group(1)) / 100


def add_commands(sub):
    e = sub.add_parser("evict", help="evict sealed files now, in the eviction policy's order",
                       description="Evict sealed, closed, unpinned files of a mounted kvfs and report what "
                                   "was freed. Give exactly one of --to-used, --free, --older-than or paths.")
    e.add_argument("mountpoint")
    e.add_argument("paths", nargs="*", metavar="PATH|GLOB", help="evict these files")
    e.add_argument("--to-used", type=parse_percent, metavar="PCT", help="evict until used space is PCT%%")
    e.add_argument("--free", type=parse_size, metavar="BYTES", help="evict about this much (K/M/G/T)")
    e.add_argument("--older-than", type=parse_duration, metavar="DURATION",
                   help="evict files neither read nor written for this long (90s, 10m, 2h, 1d)")
    e.add_argument("--dry-run", action="store_true", help="only report what would be evicted")
    e.add_argument("--json", action="store_true", help="print JSON")
    for name, text in (("pin", "never evict these files automatically (survives remounts)"),
                       ("unpin", "let eviction consider these files again")):
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("paths", nargs="+", metavar="PATH")
        p.add_argument("--json", action="store_true", help="print JSON")


def mount_of(path):
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def inodes_of(paths, mountpoint=None):
    """(mountpoint, [inode numbers]) of regular files named by paths or globs, all on one mount."""
    files = []
    for pattern in paths:
        matches = glob.glob(pattern) or ([pattern] if os.path.exists(pattern) else [])
        if not matches:
            raise NotFound(f"{pattern}: no such file")
        files.extend(matches)
    mnt = mountpoint or mount_of(files[0])
    if not os.path.ismount(mnt):
        raise InvalidArgument(f"{mnt} is not a mount point")
    dev = os.stat(mnt).st_dev
    inos = []
    for path in files:
        st = os.stat(path)
        if st.st_dev != dev:
            raise InvalidArgument(f"{path} is not on the kvfs mounted at {mnt}")
        if not os.path.isfile(path):
            raise InvalidArgument(f"{path} is not a regular file")
        inos.append(st.st_ino)
    return mnt, inos


def request(send, mountpoint, command, args):
    """Run a control command that answers; returns its answer."""
    send(mountpoint, f"{command} {json.dumps(args)}")
    return json.loads(os.getxattr(mountpoint, RESULT_XATTR))


def run(args, send, read_stats, human):
    if args.command == "evict":
        mnt = os.path.abspath(args.mountpoint)
        ways = [w for w in ("to_used", "free", "older_than") if getattr(args, w) is not None]
        if len(ways) + bool(args.paths) != 1:
            raise InvalidArgument("evict: give exactly one of --to-used, --free, --older-than or paths")
        if args.paths:
            _, inos = inodes_of(args.paths, mnt)
            query = {"inos": inos}
        else:
            query = ({"to_used": args.to_used} if args.to_used is not None else
                     {"free_bytes": args.free} if args.free is not None else
                     {"older_than_s": args.older_than})
        def evicted():
            return read_stats(mnt)["evicted_bytes"]

        start = evicted() if progress.Progress("evicting").enabled else 0
        with progress.while_running("evicting", lambda: evicted() - start):
            answer = request(send, mnt, "evict", {**query, "dry_run": args.dry_run})
        if args.json:
            print(json.dumps(answer, indent=2))
        else:
            verb = "would evict" if answer["dry_run"] else "evicted"
            print(f"{verb} {answer['files']} file(s), {human(answer['bytes'])}; "
                  f"used now {answer['used_fraction']:.1%}")
    else:
        mnt, inos = inodes_of(args.paths)
        answer = request(send, mnt, args.command, {"inos": inos})
        if args.json:
            print(json.dumps(answer, indent=2))
        else:
            print(f"{args.command}ned {len(inos)} file(s); {answer['pinned_files']} pinned, "
                  f"{human(answer['pinned_bytes'])}")
