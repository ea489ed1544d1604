"""mount.kvfs: mount a kvfs device; also the mount(8) helper for ``-t kvfs``."""
import argparse
import grp
import ipaddress
import logging
import math
import os
import shutil
import subprocess
import sys

import trio

from ..base import crashpoints
from ..base.gcpolicy import frozen_when_loaded
from ..blockindex import DedupDomains
from ..errors import Busy, InvalidArgument, KvfsError, NotFound, NotSupported
from ..namespace.leases import check_lease_seconds
from ..namespace.policy import POLICIES
from ..server.daemon import Daemon, Filesystem, MountOptions
from ..server.stack import check_mountable
from ..store import MmpSettings, mmp
from ..store.mkfs import make_filesystem
from ..tier.options import TIER_OPTIONS, parse_tier_options
from . import Parser, describe, parse_size, root_cause, setup_logging, tool
from .admin import wait_exited

DEFAULT_STORE = "/var/lib/kvfs/default.kvfs"
LOG_DIR = "/var/log/kvfs"

# Generic mount(8)/fstab options that mean nothing to kvfs but must be accepted.
IGNORED_OPTIONS = {"rw", "defaults", "auto", "noauto", "nouser", "user", "users", "dev", "nodev",
                   "suid", "nosuid", "exec", "noexec", "atime", "noatime", "relatime", "_netdev",
                   "nofail", "async", "default_permissions"}
SIZE_OPTIONS = {"cache_size", "dirty_limit"}
INT_OPTIONS = {"read_depth", "flush_workers", "max_tasks", "read_ahead_kb", "native_threads"}
FLAG_OPTIONS = {"allow_other", "force"}
# The shortest commit interval: below it the commit loop would spin (0 was a busy
# loop at 89% CPU) and group commit stops grouping anything.
MIN_COMMIT_INTERVAL = 0.05
MAX_COMMIT_INTERVAL = 24 * 3600.0


def _number(kind, value):
    try:
        return kind(value)
    except ValueError:
        raise ValueError("is not a number" if kind is float else "is not a whole number") from None


def _positive_int(value):
    number = _number(int, value)
    if number <= 0:
        raise ValueError("must be a positive whole number")
    return number


def _group(value):
    """A group name or number: its gid (a name must exist now, so a typo fails the mount)."""
    if value.isdigit():
        return int(value)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError("is not a group on this host") from None


def _seconds(value):
    number = _number(float, value)
    if not (math.isfinite(number) and MIN_COMMIT_INTERVAL <= number <= MAX_COMMIT_INTERVAL):
        raise ValueError(f"must be from {MIN_COMMIT_INTERVAL} to {MAX_COMMIT_INTERVAL:g} seconds")
    return number


def _percent(value):
    """'90' or '90%' -> 0.9; from 1 to 100."""
    number = _number(float, value.rstrip("%"))
    if not (math.isfinite(number) and 1 <= number <= 100):
        raise ValueError("must be a percentage from 1 to 100")
    return number / 100


def _retry_seconds(value):
    number = _number(float, value)
    if not (math.isfinite(number) and 0 <= number <= 600):
        raise ValueError("must be from 0 to 600 seconds")
    return number


def _timeout_seconds(value):
    number = _number(float, value)
    if not (math.isfinite(number) and 0.1 <= number <= 3600):
        raise ValueError("must be from 0.1 to 3600 seconds")
    return number


def _mmp_seconds(value):
    number = _number(float, value)
    if not (math.isfinite(number) and mmp.MIN_INTERVAL <= number <= mmp.MAX_INTERVAL):
        raise ValueError(f"must be from {mmp.MIN_INTERVAL} to {mmp.MAX_INTERVAL:g} seconds")
    return number


def _port(value):
    number = _number(int, value)
    if not 1 <= number <= 65535:
        raise ValueError("must be a TCP port from 1 to 65535")
    return number


def _ip_address(value):
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError("is not an IPv4 or IPv6 address (e.g. 127.0.0.1, 0.0.0.0, ::1)") from None


def parse_options(text):
    """Turn '-o a,b=c' into MountOptions plus the log path.

    Every value is checked here, before anything is created or mounted; an
    unknown option or a bad value is a KvfsError (EINVAL) with a one-line message.
    """
    opts = MountOptions.defaults()
    log_path = None
    given, tier_items = set(), []
    for item in filter(None, (text or "").split(",")):
        name, has_value, value = item.partition("=")
        if name in TIER_OPTIONS:        # the shared tier's own (kvfs/tier/options.py)
            tier_items.append((name, value))
            continue
        if name in IGNORED_OPTIONS or name.startswith("x-") or name == "comment":
            continue
        if name == "ro":
            raise NotSupported("read-only mounts are not supported (option 'ro')")
        if name in FLAG_OPTIONS:
            if has_value:
                raise InvalidArgument(f"mount option {name!r} takes no value")
            setattr(opts, name, True)
            continue
        known = SIZE_OPTIONS | INT_OPTIONS | {"commit_interval", "log", "by_hash", "high_watermark",
                                              "low_watermark", "eviction_policy", "metrics_port",
                                              "metrics_addr", "io_retry", "io_timeout", "dedup_groups", "dedup_verify",
                                              "mmp_interval", "page_fill", "request_poll", "native_reads",
                                              "native_direct_io", "lease_seconds", "bypass_group"}
        if name not in known:
            raise InvalidArgument(f"unknown mount option {name!r}")
        if not value:
            raise InvalidArgument(f"mount option {name!r} needs a value ({name}=...)")
        try:
            if name in SIZE_OPTIONS:
                setattr(opts, name, parse_size(value))
            elif name in INT_OPTIONS:
                setattr(opts, name, _positive_int(value))
            elif name == "commit_interval":
                opts.commit_interval = _seconds(value)
            elif name == "by_hash":
                if value not in ("root", "owner"):
                    raise ValueError("(use root or owner)")
                opts.by_hash = value
            elif name in ("high_watermark", "low_watermark"):
                setattr(opts, name, _percent(value))
            elif name == "eviction_policy":
                if value not in POLICIES:
                    raise ValueError(f"(use {' or '.join(sorted(POLICIES))})")
                opts.eviction_policy = value
            elif name == "io_retry":
                opts.io_retry = _retry_seconds(value)
            elif name == "io_timeout":
                opts.io_timeout = _timeout_seconds(value)
            elif name == "mmp_interval":
                opts.mmp_interval = _mmp_seconds(value)
            elif name == "metrics_port":
                opts.metrics_port = _port(value)
            elif name == "metrics_addr":
                opts.metrics_addr = _ip_address(value)
            elif name == "dedup_groups":
                opts.dedup_groups = DedupDomains.parse(value)
            elif name == "dedup_verify":
                if value not in ("off", "bytes"):
                    raise ValueError("(use off or bytes)")
                opts.dedup_verify = value == "bytes"
            elif name == "lease_seconds":
                opts.lease_seconds = check_lease_seconds(value)
            elif name == "bypass_group":
                opts.bypass_group = _group(value)
            elif name == "native_reads":
                if value not in ("on", "off", "auto"):
                    raise ValueError("(use on, off or auto)")
                opts.native_reads = None if value == "auto" else value == "on"
            elif name in ("page_fill", "request_poll", "native_direct_io"):
                if value not in ("on", "off"):
                    raise ValueError("(use on or off)")
                setattr(opts, name, value == "on")
            else:
                log_path = os.path.abspath(value)
        except argparse.ArgumentTypeError as exc:          # parse_size names the value itself
            raise InvalidArgument(f"bad value for mount option {name!r}: {exc}") from None
        except ValueError as exc:
            raise InvalidArgument(f"bad value for mount option {name!r}: {value!r} {exc}") from None
        given.add(name)
    if not opts.low_watermark < opts.high_watermark:
        raise InvalidArgument(f"watermarks out of order: low_watermark ({opts.low_watermark:.0%}) must be "
                              f"below high_watermark ({opts.high_watermark:.0%})")
    if "io_timeout" not in given:
        opts.io_timeout = max(opts.io_timeout, 2 * opts.io_retry)     # a long io_retry raises the default
    elif not opts.io_timeout > opts.io_retry:
        raise InvalidArgument(f"mount option 'io_timeout' ({opts.io_timeout:g} s) must be longer than "
                              f"'io_retry' ({opts.io_retry:g} s): a device call is retried within its time bound")
    if "dirty_limit" not in given:
        opts.dirty_limit = opts.cache_size // 2
    elif opts.dirty_limit > opts.cache_size:
        raise InvalidArgument(f"mount option 'dirty_limit' ({opts.dirty_limit} bytes) exceeds "
                              f"'cache_size' ({opts.cache_size} bytes)")
    if "metrics_addr" in given and "metrics_port" not in given:
        raise InvalidArgument("mount option 'metrics_addr' needs 'metrics_port' too")
    opts.tier = parse_tier_options(tier_items)
    if log_path is not None and not os.path.isdir(os.path.dirname(log_path)):
        raise NotFound(f"log file directory {os.path.dirname(log_path)} does not exist")
    return opts, log_path


def default_store_size(directory):
    """A quarter of the free space, between 1 GiB and 256 GiB, in whole GiB."""
    free = shutil.disk_usage(directory).free
    return min(max(free // 4, 1 << 30), 256 << 30) // (1 << 30) * (1 << 30)


def ensure_default_store(path=DEFAULT_STORE):
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    make_filesystem(path, default_store_size(os.path.dirname(path)))
    return path


def check_mountpoint(path):
    if not os.path.isdir(path):
        raise NotFound(f"mountpoint {path} does not exist or is not a directory")
    if os.path.ismount(path):
        raise Busy(f"mountpoint {path} is busy: something is already mounted there")


def mmp_settings(options):
    """What the mount claims the store's multi-mount protection record with."""
    interval = options.mmp_interval or mmp.interval_for(options.io_retry)
    return MmpSettings(interval=interval, force=options.force, program="mount.kvfs")


def run_daemon(device, mountpoint, options, ready, settings=None):
    with frozen_when_loaded():          # see kvfs/base/gcpolicy.py
        fs = Filesystem.open(device, options, mmp=settings or mmp_settings(options))
    try:
        logging.getLogger(__name__).info("mounted %s at %s (journal replay: %s)",
                                         device, mountpoint, fs.replayed)
        trio.run(Daemon(fs, mountpoint, options).serve, ready)
    finally:
        fs.close()


def _remove_dead_mount(mountpoint):
    """A daemon that died after the kernel mounted but before the mount was live leaves
    a dead FUSE mount (every access ENOTCONN): take it away, so the mountpoint can be
    used again without fusermount3 -uz."""
    try:
        with open("/proc/self/mounts") as f:
            ours = any(line.split()[1:3] == [mountpoint, "fuse.kvfs"] for line in f)
    except OSError:
        return
    if ours:
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True, timeout=30)


def daemonize(work, mountpoint=None):
    """Fork; the child runs ``work(ready)`` detached, the parent waits for ready or an error."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as pipe:
            message = pipe.read().decode(errors="replace")
        if message == "ok":
            return 0
        wait_exited(pid, 10)                  # the daemon is going: nothing will serve the mount
        if mountpoint is not None:
            _remove_dead_mount(mountpoint)
        raise KvfsError(message.strip() or "the kvfs daemon exited before the mount was live")
    os.close(rfd)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)

    def ready():
        os.write(wfd, b"ok")
        os.close(wfd)
        os.dup2(null, 2)

    code = 0
    try:
        work(ready)
    except BaseException as exc:  # noqa: BLE001 - the parent must hear about any failure
        # The parent prints one line; the log keeps it too (after ready() nobody
        # else hears), with the traceback only for an unexpected error.
        cause = root_cause(exc)
        expected = isinstance(cause, (KvfsError, OSError))
        logging.getLogger(__name__).error("daemon failed: %s", describe(cause),
                                          exc_info=None if expected else exc)
        _report(wfd, describe(cause))
        code = 1
    os._exit(code)


def _report(wfd, message):
    try:
        os.write(wfd, message.encode())
        os.close(wfd)
    except OSError:
        pass


@tool("mount.kvfs")
def main(argv):
    p = Parser(prog="mount.kvfs",
               description="Mount kvfs. With only MOUNTPOINT, mounts the embedded default store "
                           f"({DEFAULT_STORE}, created and formatted on first use).",
               epilog="options: allow_other, cache_size=SIZE, dirty_limit=SIZE, read_depth=N, "
                      "flush_workers=N, commit_interval=SECONDS, read_ahead_kb=N, log=PATH, "
                      "by_hash=root|owner, dedup_groups=all|UID+UID:UID+UID (default: each uid its own dedup "
                      "domain), dedup_verify=off|bytes, page_fill=on|off (default on), request_poll=on|off (default on), native_reads=on|off|auto (default auto: on as root), native_threads=N, native_direct_io=on|off (default off), lease_seconds=S (default 5), bypass_group=GROUP, "
                      "high_watermark=PCT (default 90), low_watermark=PCT "
                      "(default 80), eviction_policy=s3fifo|lru|none, io_retry=SECONDS (default 10), "
                      "io_timeout=SECONDS (default 60, longer than io_retry), "
                      "metrics_port=PORT, metrics_addr=IP (default 127.0.0.1), "
                      "mmp_interval=SECONDS (default io_retry/4, at least 1), force, "
                      "the shared tier: tier=rados, ceph_conf=PATH, ceph_id=USER, ceph_pool=POOL, tenant=ID, "
                      "tenant_key=PATH (root-only file), tier_deadline=SECONDS (default 2), tier_queue=N "
                      "(default 256), tier_concurrency=N (default 16), tier_miss_ttl=SECONDS (default 0.5), "
                      "tier_capacity=SIZE (this host runs the janitor), tier_janitor_interval=SECONDS, "
                      "plus generic mount(8) options (rw, defaults, noauto, _netdev, x-*, ...)")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground, log to stderr")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="mount options (see below)")
    p.add_argument("--force", action="store_true",
                   help="take over a store whose multi-mount protection record names another owner, "
                        "without waiting for its heartbeat to stop (only when that owner is surely down)")
    p.add_argument("-n", "-s", "-v", dest="ignored", action="count", help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="+", metavar="[DEVICE] MOUNTPOINT")
    args = p.parse_intermixed_args(argv)
    if len(args.paths) > 2:
        p.error("expected [DEVICE] MOUNTPOINT")
    options, log_path = parse_options(",".join(args.options))
    crashpoints.arm_from_environment()          # a test hook: refuses a bad $KVFS_TEST_CRASH
    crashpoints.arm_stall_from_environment()    # another: refuses a bad $KVFS_TEST_STALL
    options.force = options.force or args.force
    settings = mmp_settings(options)
    mountpoint = os.path.abspath(args.paths[-1])
    check_mountpoint(mountpoint)
    device = os.path.abspath(args.paths[0]) if len(args.paths) == 2 else ensure_default_store()
    if not os.path.exists(device):
        raise NotFound(f"{device}: no such device or file (create it with mkfs.kvfs)")
    tag = f"kvfs[{mountpoint}]"
    if args.foreground:
        setup_logging(path=log_path, tag=tag)
        run_daemon(device, mountpoint, options, lambda: None, settings)
        return 0
    # Validate the device before forking so most errors come straight back; a
    # live owner in the MMP record, too (the daemon inherits what this saw).
    check_mountable(device, options, settings)
    if log_path is None:
        os.makedirs(LOG_DIR, exist_ok=True)
        log_path = os.path.join(LOG_DIR, "kvfs.log")
    setup_logging(path=log_path, tag=tag)
    return daemonize(lambda ready: run_daemon(device, mountpoint, options, ready, settings), mountpoint)


if __name__ == "__main__":
    sys.exit(main())
