"""kvfs-admin: statistics and control of a mounted kvfs, and NVMe-oF attach.

It talks to the daemon through extended attributes: reading ``user.kvfs.stats``
on the mount root returns JSON statistics (root and the mount's owner only), and
writing a command to ``user.kvfs.control`` on ``/.kvfs`` (or on the root) runs it
and returns when it is done (the daemon refuses other callers with EPERM).

This module must import with only the standard library (tests run it under
the system Python as an unprivileged user): no trio, no pyfuse3.
"""
import argparse
import errno
import json
import os
import shlex
import sys
import time

from ..errors import AccessDenied, InvalidArgument, KvfsError, NotFound, NotPermitted, TimedOut, os_error
from ..server import metrics
from . import nvmeof
from . import Parser, evict, progress, tool
from .views import TopScreen, human, print_all, summary, watch

STATS_XATTR = "user.kvfs.stats"
CONTROL_XATTR = "user.kvfs.control"
CONF_DIR = "/etc/kvfs"
CONTROL_COMMANDS = {
    "flush": "make all written data and metadata durable",
    "drop-caches": "empty kvfs's clean block cache (makes the next reads cold)",
    "checkpoint": "flush, then write a checkpoint and empty the journal",
    "count-frozen": "run a full garbage collection (its survivors are frozen), then recount the "
                    "objects frozen out of collection (stats' gc_frozen_objects; a walk of all of them)",
    "umount": "flush, unmount and wait for the daemon to exit",
}


def _not_kvfs(mountpoint, exc):
    if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
        return InvalidArgument(f"{mountpoint} is not a mounted kvfs")
    return os_error(exc, f"{mountpoint}: {exc.strerror}")


def read_stats(mountpoint):
    try:
        return json.loads(os.getxattr(mountpoint, STATS_XATTR))
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise NotFound(f"{mountpoint}: no such directory") from None
        if exc.errno == errno.EACCES:       # the daemon refused, or the kernel did (no allow_other)
            raise AccessDenied(f"{mountpoint}: statistics are readable only by root and the mount's owner") from None
        raise _not_kvfs(mountpoint, exc) from None


def _refused(command, mountpoint):
    command = command.split()[0]                    # the name, not its JSON arguments
    return NotPermitted(f"{command} {mountpoint}: permission denied: changing a mounted kvfs needs root "
                     f"or the mount's owner")


def send(mountpoint, command):
    try:
        read_stats(mountpoint)                      # a clear error if this is not kvfs
    except AccessDenied:                            # it is kvfs, and this caller may not touch it
        raise _refused(command, mountpoint) from None
    # To /.kvfs, not to the root: setxattr holds the kernel's lock of the inode
    # it names until the command is done (a flush or a checkpoint can take
    # seconds), and on the root that stalled every lookup and create in it,
    # where engines keep their chunk files. /.kvfs is root's (mode 0555): the
    # kernel refuses others with EACCES before the daemon sees the command, and
    # a daemon older than this answers ENOTSUP; neither ran it, so the root is
    # tried then.
    try:
        os.setxattr(os.path.join(mountpoint, ".kvfs"), CONTROL_XATTR, command.encode())
        return
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP):
            if exc.errno == errno.EPERM:
                raise _refused(command, mountpoint) from None
            raise _not_kvfs(mountpoint, exc) from None
    try:
        os.setxattr(mountpoint, CONTROL_XATTR, command.encode())
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise _refused(command, mountpoint) from None
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
    try:
        pid = read_stats(mountpoint)["pid"]
    except KvfsError as exc:
        if exc.errno == errno.EACCES:
            raise _refused("umount", mountpoint) from None
        raise
    send(mountpoint, "umount")
    deadline = time.monotonic() + timeout
    if wait_exited(pid, timeout):
        # The daemon unmounts before it exits; give the kernel a moment to agree.
        while os.path.ismount(mountpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.ismount(mountpoint):
            return
    raise TimedOut(f"daemon {pid} did not exit within {timeout} s")


# -- human units -----------------------------------------------------------------
def _json(obj):
    print(json.dumps(obj, sort_keys=True), flush=True)


# -- nvmeof ---------------------------------------------------------------------
def _nvmeof_config(args):
    if args.config:
        values = nvmeof.read_env_files(args.config)
    elif args.instance:
        files = [os.path.join(CONF_DIR, "kvfs.conf"), os.path.join(CONF_DIR, f"{args.instance}.conf")]
        values = nvmeof.read_env_files([f for f in files if os.path.exists(f)])
    else:
        values = dict(os.environ)
    return values


def nvmeof_command(args):
    values = _nvmeof_config(args)
    if not nvmeof.configured(values):
        if getattr(args, "if_configured", False):
            return 0
        where = ", ".join(args.config) if args.config else (
            f"{CONF_DIR}/kvfs.conf, {CONF_DIR}/{args.instance}.conf" if args.instance else "the environment")
        raise InvalidArgument(f"no NVMe-oF settings (NVMEOF_*) in {where}")
    config = nvmeof.Config.from_mapping(values)
    if args.action == "command":
        cmd = config.connect_command()
        _json(cmd) if args.json else print(shlex.join(cmd))
        return 0
    if args.action == "status":
        st = nvmeof.status(config, sysfs=args.sysfs, dev=args.dev_root)
        if args.json:
            _json(st)
        else:
            print(f"subsystem   {st['subnqn']}  ({'connected: ' + ', '.join(st['subsystems']) if st['connected'] else 'not connected'})")
            for c in st["controllers"]:
                print(f"controller  {c['name']}  {c['state'] or '?'}  {c['transport'] or '?'}  {c['address'] or ''}")
            print(f"namespace   {st['namespace_wanted']}: "
                  + (f"{st['device']} (nsid {st['nsid']}{', uuid ' + st['uuid'] if st['uuid'] else ''})"
                     if st["device"] else "not found"))
            print(f"state       {'attached' if st['attached'] else 'not attached'}"
                  + (f": {st['problem']}" if st["problem"] else ""))
            print(f"connect     {st['connect_command']}")
        return 0 if st["attached"] else 3
    # attach
    if args.link and "DEVICE" in os.environ and os.path.abspath(os.environ["DEVICE"] or "-") != args.link:
        raise InvalidArgument(f"NVMe-oF is configured, so set DEVICE={args.link} (the attached namespace), "
                        f"not DEVICE={os.environ['DEVICE']!r}")
    ns, connected = nvmeof.attach(config, sysfs=args.sysfs, dev=args.dev_root, link=args.link,
                                  timeout=args.timeout)
    result = {"device": ns.device, "nsid": ns.nsid, "uuid": ns.uuid, "subsystem": ns.subsystem,
              "connected_now": connected, "link": args.link}
    if args.json:
        _json(result)
    else:
        print(f"{'connected' if connected else 'already connected'}: {config.subnqn} namespace "
              f"{ns.nsid} is {ns.device}{f' (linked as {args.link})' if args.link else ''}")
    return 0


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def build_parser():
    p = Parser(prog="kvfs-admin", description="Inspect and control a mounted kvfs; attach its NVMe-oF namespace.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    s = sub.add_parser("stats", help="grouped statistics of a mount (--all: every counter)",
                       description="Print a short, grouped summary of a mounted kvfs: space, files, cache, "
                                   "I/O, errors, uptime. Root and the mount's owner only.")
    s.add_argument("--json", action="store_true", help="print every statistic as JSON (one object per line "
                                                        "with --watch)")
    s.add_argument("--all", action="store_true", help="print every statistic, one per line")
    s.add_argument("--watch", type=_positive_float, metavar="SECS",
                   help="print again every SECS seconds, with the bandwidth over that interval")
    s.add_argument("--count", type=_positive_int, metavar="N", help="with --watch: stop after N reports")
    s.add_argument("mountpoint")

    t = sub.add_parser("top", help="live view of rates, hit rate, prefetch depth and flush backlog",
                       description="A live, refreshing view of a mounted kvfs (in the spirit of juicefs stats): "
                                   "read and write rates of files and of the device, requests per second, "
                                   "RAM hit rate, dedup hits, prefetch reads in flight, dirty data and flush "
                                   "backlog. Redraws in place on a terminal; prints one row per interval "
                                   "otherwise. Ctrl-C quits.")
    t.add_argument("--interval", type=_positive_float, default=1.0, metavar="SECS", help="refresh period (1 s)")
    t.add_argument("--count", type=_positive_int, metavar="N", help="stop after N refreshes")
    t.add_argument("--json", action="store_true", help="print one JSON object of rates per interval")
    t.add_argument("mountpoint")

    m = sub.add_parser("metrics", help="print the Prometheus text exposition",
                       description="Print the statistics of a mounted kvfs in the Prometheus text format "
                                   "(what the metrics_port= mount option serves at /metrics).")
    m.add_argument("--json", action="store_true", help="print the metric families as JSON")
    m.add_argument("mountpoint")

    for name, text in CONTROL_COMMANDS.items():
        sp = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] +
                            ". Needs root or the mount's owner.")
        sp.add_argument("--json", action="store_true", help="print the result as JSON")
        sp.add_argument("mountpoint")

    n = sub.add_parser("nvmeof", help="NVMe-oF: connect the namespace, show its state",
                       description="Attach the NVMe-oF namespace kvfs runs on. Settings (NVMEOF_TRANSPORT, "
                                   "NVMEOF_TRADDR, NVMEOF_TRSVCID, NVMEOF_SUBNQN, NVMEOF_HOSTNQN, optional "
                                   "NVMEOF_NSID or NVMEOF_NSUUID) come from --config files, from "
                                   f"{CONF_DIR}/kvfs.conf and {CONF_DIR}/INSTANCE.conf with --instance, or "
                                   "else from the environment (as systemd passes them).")
    nsub = n.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=Parser)
    for action, text in (("status", "show whether the namespace is connected, and its block device "
                                    "(exit 0: attached, 3: not attached)"),
                         ("attach", "run nvme connect unless connected, wait for the namespace's block device"),
                         ("command", "print the nvme connect command line that attach runs")):
        a = nsub.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        a.add_argument("--config", action="append", metavar="FILE", help="settings file (repeatable; "
                                                                          "later ones win)")
        a.add_argument("--instance", metavar="NAME", help="read the settings of service kvfs@NAME")
        a.add_argument("--json", action="store_true", help="print JSON")
        a.add_argument("--sysfs", default=nvmeof.SYSFS, help=argparse.SUPPRESS)
        a.add_argument("--dev-root", default=nvmeof.DEV, help=argparse.SUPPRESS)
        if action == "attach":
            a.add_argument("--if-configured", action="store_true",
                           help="do nothing (exit 0) when no NVMEOF_* setting is present")
            a.add_argument("--link", metavar="PATH", help="make PATH a symlink to the namespace's block device")
            a.add_argument("--timeout", type=_positive_float, default=30.0, metavar="SECS",
                           help="how long to wait for the block device (30 s)")
    evict.add_commands(sub)
    return p


@tool("kvfs-admin")
def main(argv):
    args = build_parser().parse_args(argv)
    if args.command in ("evict", "pin", "unpin"):
        return evict.run(args, send, read_stats, human)
    if args.command == "nvmeof":
        if getattr(args, "link", None):
            args.link = os.path.abspath(args.link)
        return nvmeof_command(args)
    mnt = os.path.abspath(args.mountpoint)
    if args.command == "stats":
        if args.watch is None:
            stats = read_stats(mnt)
            if args.json:
                print(json.dumps(stats, indent=2, sort_keys=True))
            elif args.all:
                print_all(stats)
            else:
                print("\n".join(summary(stats)))
            return 0

        def show(stats, r):
            if args.json:
                _json({**stats, "interval": r})
            elif args.all:
                print_all(stats)
                print(flush=True)
            else:
                print("\n".join(summary(stats, {"read": r["device_read"], "write": r["device_write"],
                                               "app_read": r["read"], "app_write": r["write"],
                                               "window_s": r["window_s"]})) + "\n", flush=True)
        watch(lambda: read_stats(mnt), args.watch, args.count, show)
    elif args.command == "top":
        if args.json:
            watch(lambda: read_stats(mnt), args.interval, args.count,
                  lambda stats, r: _json({"time": time.time(), **r,
                                          "prefetch_inflight": stats.get("prefetch_inflight"),
                                          "dirty_bytes": stats.get("dirty_bytes"),
                                          "flush_backlog_bytes": stats.get("flush_backlog_bytes")}))
        else:
            screen = TopScreen(sys.stdout, mnt, sys.stdout.isatty())
            watch(lambda: read_stats(mnt), args.interval, args.count, screen.show)
    elif args.command == "metrics":
        stats = read_stats(mnt)
        if args.json:
            print(json.dumps(metrics.as_json(stats), indent=2))
        else:
            sys.stdout.write(metrics.exposition(stats))
    else:
        began = time.monotonic()
        if args.command in ("flush", "checkpoint", "umount"):
            # A large dirty pool takes a while: show what is left to write on a terminal.
            try:
                total = read_stats(mnt)["dirty_bytes"]
            except AccessDenied:
                raise _refused(args.command, mnt) from None
            with progress.while_running("flushing", lambda: total - read_stats(mnt)["dirty_bytes"],
                                        total=total or None):
                umount(mnt) if args.command == "umount" else send(mnt, args.command)
        else:
            send(mnt, args.command)
        if args.json:
            _json({"command": args.command, "mountpoint": mnt, "ok": True,
                   "seconds": round(time.monotonic() - began, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
