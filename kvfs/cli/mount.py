"""mount.kvfs: mount a kvfs device; also the mount(8) helper for ``-t kvfs``."""
import argparse
import errno
import logging
import os
import shutil
import sys

import trio

from ..daemon import Daemon, Filesystem, MountOptions
from ..errors import KvfsError
from . import Parser, parse_size, setup_logging, tool
from .mkfs import make_filesystem

DEFAULT_STORE = "/var/lib/kvfs/default.kvfs"
LOG_DIR = "/var/log/kvfs"

# Generic mount(8)/fstab options that mean nothing to kvfs but must be accepted.
IGNORED_OPTIONS = {"rw", "defaults", "auto", "noauto", "nouser", "user", "users", "dev", "nodev",
                   "suid", "nosuid", "exec", "noexec", "atime", "noatime", "relatime", "_netdev",
                   "nofail", "async", "default_permissions"}
SIZE_OPTIONS = {"cache_size", "dirty_limit"}
INT_OPTIONS = {"read_depth", "flush_workers", "max_tasks", "read_ahead_kb"}
FLOAT_OPTIONS = {"commit_interval"}


def parse_options(text):
    """Turn '-o a,b=c' into MountOptions plus the log path; unknown options are errors."""
    opts = MountOptions.defaults()
    log_path = None
    dirty_given = False
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        try:
            if name in IGNORED_OPTIONS or name.startswith("x-") or name.startswith("comment="):
                continue
            if name == "allow_other":
                opts.allow_other = True
            elif name in SIZE_OPTIONS:
                setattr(opts, name, parse_size(value))
                dirty_given |= name == "dirty_limit"
            elif name in INT_OPTIONS:
                setattr(opts, name, int(value))
                if int(value) <= 0:
                    raise ValueError
            elif name in FLOAT_OPTIONS:
                setattr(opts, name, float(value))
            elif name == "by_hash":
                if value not in ("root", "owner"):
                    raise ValueError
                opts.by_hash = value
            elif name == "write_delay_ms":
                opts.write_delay = float(value) / 1000
            elif name == "log":
                log_path = value
            elif name == "ro":
                raise KvfsError("read-only mounts are not supported (option 'ro')", errno.EINVAL)
            else:
                raise KvfsError(f"unknown mount option {name!r}", errno.EINVAL)
        except (ValueError, argparse.ArgumentTypeError):
            raise KvfsError(f"bad value for mount option {name!r}: {value!r}", errno.EINVAL) from None
    if not dirty_given:
        opts.dirty_limit = opts.cache_size // 2
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
        raise KvfsError(f"mountpoint {path} does not exist or is not a directory", errno.ENOENT)
    if os.path.ismount(path):
        raise KvfsError(f"mountpoint {path} is busy: something is already mounted there", errno.EBUSY)


def run_daemon(device, mountpoint, options, ready):
    fs = Filesystem.open(device, options)
    try:
        logging.getLogger(__name__).info("mounted %s at %s (journal replay: %s)",
                                         device, mountpoint, fs.replayed)
        trio.run(Daemon(fs, mountpoint, options).serve, ready)
    finally:
        fs.close()


def daemonize(work):
    """Fork; the child runs ``work(ready)`` detached, the parent waits for ready or an error."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as pipe:
            message = pipe.read().decode(errors="replace")
        if message == "ok":
            return 0
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
    except KvfsError as exc:
        _report(wfd, str(exc))
        code = 1
    except BaseException as exc:  # noqa: BLE001 - the parent must hear about any failure
        logging.getLogger(__name__).exception("daemon failed")
        _report(wfd, f"{type(exc).__name__}: {exc}")
        code = 1
    os._exit(code)


def _report(wfd, message):
    try:
        os.write(wfd, message.encode())
        os.close(wfd)
    except OSError:
        pass


@tool
def main(argv):
    p = Parser(prog="mount.kvfs",
               description="Mount kvfs. With only MOUNTPOINT, mounts the embedded default store "
                           f"({DEFAULT_STORE}, created and formatted on first use).",
               epilog="options: allow_other, cache_size=SIZE, dirty_limit=SIZE, read_depth=N, "
                      "flush_workers=N, commit_interval=SECONDS, read_ahead_kb=N, log=PATH, "
                      "plus generic mount(8) options (rw, defaults, noauto, _netdev, x-*, ...)")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground, log to stderr")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="mount options (see below)")
    p.add_argument("-n", "-s", "-v", dest="ignored", action="count", help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="+", metavar="[DEVICE] MOUNTPOINT")
    args = p.parse_intermixed_args(argv)
    if len(args.paths) > 2:
        p.error("expected [DEVICE] MOUNTPOINT")
    options, log_path = parse_options(",".join(args.options))
    mountpoint = os.path.abspath(args.paths[-1])
    check_mountpoint(mountpoint)
    device = args.paths[0] if len(args.paths) == 2 else ensure_default_store()
    if not os.path.exists(device):
        raise KvfsError(f"{device}: no such device or file (create it with mkfs.kvfs)", errno.ENOENT)
    tag = f"kvfs[{mountpoint}]"
    if args.foreground:
        setup_logging(path=log_path, tag=tag)
        run_daemon(device, mountpoint, options, lambda: None)
        return 0
    # Validate the device before forking so most errors come straight back.
    Filesystem.open(device, options, readonly=True).close()
    if log_path is None:
        os.makedirs(LOG_DIR, exist_ok=True)
        log_path = os.path.join(LOG_DIR, "kvfs.log")
    setup_logging(path=log_path, tag=tag)
    return daemonize(lambda ready: run_daemon(device, mountpoint, options, ready))


if __name__ == "__main__":
    sys.exit(main())
