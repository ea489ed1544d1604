"""The native read plane, Python side: kvfs mounts itself and puts a C front end on /dev/fuse.

Part of the FUSE layer; kvfs/server/daemon.py uses it when ``native_reads`` is
on (``auto``, the default, turns it on for a daemon running as root). The front
end (kvfs/fuse/readplane.c) reads every request from the kernel on several
threads, answers READs of published files itself (device read, key check,
reply) and hands everything else to pyfuse3, which is given one end of a
SOCK_SEQPACKET socketpair as its device ("/dev/fd/N": libfuse then uses that
descriptor and mounts nothing).

What Python owns here:

* the mount: open /dev/fuse, mount(2) with ``fd=N``, and at the end a lazy
  unmount (what libfuse does for root) before the threads stop;
* publication: :meth:`NativeReads.publish` hands over a sealed file's extents
  (from the namespace, :meth:`Namespace.native_extents`) when it is opened for
  reading; :meth:`NativeReads.withdraw` takes them back on any change to the
  file and at its last close, always before that change is answered;
* pins: each version's blocks are pinned in the namespace from its publication
  until the front end has freed it. A withdrawn version stays for the READs
  handed out before the withdrawal, and its blocks must not be reused under
  them: a rewrite that freed them and wrote new blocks there would fail their
  key check, and the READ would go to pyfuse3 late, out of the kernel's order.
  :meth:`NativeReads.collect` lets go of what the front end has freed; it runs
  at every publication, soon after a withdrawal and once a second;
* the end: when the kernel ends the connection (umount, abort) the front end
  makes ``ended_fd`` readable, and :meth:`NativeReads.wait_ended` returns.

The module must load: a store mounted with native reads on and no native
module is refused (see :func:`load`), never served slowly in silence.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import itertools
import logging
import os
import socket
from typing import Any, Iterable, Optional, Protocol, Sequence

import trio

from ..base import crashpoints
from ..errors import InvalidArgument, KvfsError

log = logging.getLogger(__name__)

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2
# Both ends of the socket hold whole requests and replies (up to 1 MiB and
# some): a SEQPACKET message must fit the sender's buffer.
SOCKET_BUFFER = 32 << 20
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
DEFAULT_THREADS = 4
DEFAULT_MAX_BACKGROUND = 128

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class NativeModuleMissing(KvfsError):
    errno = errno.ENOSYS


def load() -> Any:
    """The compiled front end; a clear error if the install did not build it."""
    try:
        from . import _readplane
    except ImportError as exc:
        raise NativeModuleMissing(
            f"kvfs's native read plane is not built ({exc}); reinstall kvfs (tools/setup) "
            "or mount with native_reads=off") from None
    return _readplane


@dataclasses.dataclass(frozen=True)
class NativeReadStatistics:
    native_reads: int               # READs answered by the front end
    native_read_bytes: int
    native_device_bytes: int        # what those READs read from the device (whole sectors)
    native_forwarded_reads: int     # READs that went to pyfuse3 (not published, or in doubt)
    native_unpublished_reads: int   # of those, READs of files not published
    native_verify_failures: int     # READs sent to pyfuse3 because a block failed its key
    native_device_errors: int       # READs sent to pyfuse3 because the device read failed
    native_forwarded_requests: int  # every request handed to pyfuse3
    native_forwards_queued: int     # of those, how many waited for room in the socket
    native_published_files: int
    native_publications: int
    native_withdrawals: int
    native_kept_versions: int       # withdrawn versions kept (their blocks pinned) for READs in hand
    native_threads: int


class BlockPins(Protocol):
    """What the plane needs of the namespace (kvfs.namespace.Namespace implements it)."""
    def hold_blocks(self, keys: Sequence[bytes]) -> None: ...
    def let_go_blocks(self, keys: Sequence[bytes]) -> None: ...


def mount_data(options: Iterable[str], dev_fd: int) -> tuple[str, str, int, str]:
    """pyfuse3-style mount options -> (source, fstype, flags, data) for mount(2).

    These are the options kvfs passes (see Daemon.serve); any other is refused
    rather than dropped.
    """
    source, fstype, flags = "kvfs", "fuse", MS_NOSUID | MS_NODEV
    data = [f"fd={dev_fd}", "rootmode=40000", f"user_id={os.geteuid()}", f"group_id={os.getegid()}"]
    for opt in sorted(options):
        name, _, value = opt.partition("=")
        if name == "fsname":
            source = value
        elif name == "subtype":
            fstype = f"fuse.{value}"
        elif name in ("default_permissions", "allow_other"):
            data.append(name)
        elif name == "ro":
            flags |= MS_RDONLY
        else:
            raise InvalidArgument(f"mount option {opt!r} is not supported with native_reads=on")
    return source, fstype, flags, ",".join(data)


class NativeReads:
    """One mount served by the native front end and pyfuse3 together."""

    COLLECT_EVERY = 1.0                 # seconds: versions freed after their last READ are let go

    def __init__(self, mountpoint: str, options: Iterable[str], *, device_fd: int, seed: int, secret: bytes,
                 pins: BlockPins, threads: int = DEFAULT_THREADS,
                 max_background: int = DEFAULT_MAX_BACKGROUND) -> None:
        self._module = load()
        self._pins = pins
        self._pinned: dict[int, list[bytes]] = {}    # version token -> the keys pinned for it
        self._tokens = itertools.count(1)
        self.mountpoint = mountpoint
        self._options = set(options)
        self._threads = threads
        self._max_background = max_background
        self._seed = seed
        self._secret = secret                # the store's key secret: hashed before every block
        self._device_fd = device_fd          # ours: a dup of the store's device descriptor
        self.dev_fd = -1                     # /dev/fuse, the kernel's side
        self.session_fd = -1                 # pyfuse3's side of the socketpair
        self._front_fd = -1                  # the front end's side
        self._plane: Optional[Any] = None
        self._mounted = False

    @property
    def session_path(self) -> str:
        """What pyfuse3.init takes as its mount point."""
        return f"/dev/fd/{self.session_fd}"

    def mount(self) -> None:
        """Mount the filesystem on our own /dev/fuse descriptor and set up the socketpair."""
        self.dev_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            front, session = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            for sock in (front, session):
                sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, SOCKET_BUFFER)
            self._front_fd, self.session_fd = front.detach(), session.detach()
            os.set_inheritable(self.session_fd, False)
            source, fstype, flags, data = mount_data(self._options, self.dev_fd)
            if _libc.mount(source.encode(), self.mountpoint.encode(), fstype.encode(), flags, data.encode()):
                err = ctypes.get_errno()
                raise OSError(err, f"mount {self.mountpoint}: {os.strerror(err)}")
            self._mounted = True
            self._plane = self._module.ReadPlane(self.dev_fd, self._front_fd, self._device_fd, self._seed,
                                                 self._secret, self._threads, self._max_background,
                                                 crashpoints.take_stall("native_read"))
        except BaseException:
            self._close_fds()
            raise

    def start(self) -> None:
        """Start the threads: the kernel's INIT is already queued, pyfuse3 answers it once it runs."""
        assert self._plane is not None
        self._plane.start()

    async def wait_ended(self) -> None:
        """Return once the kernel has ended the connection (unmounted from outside, aborted)."""
        assert self._plane is not None
        await trio.lowlevel.wait_readable(self._plane.ended_fd)

    def publish(self, ino: int, generation: int, size: int, block_size: int,
                blocks: Sequence[Optional[tuple[int, int, bytes, bytes]]]) -> None:
        """Serve the file's READs natively; its blocks stay pinned while any READ may use them."""
        if self._plane is None:
            return
        keys = [block[2] for block in blocks if block is not None]
        token = next(self._tokens)
        self._pins.hold_blocks(keys)
        try:
            new = self._plane.publish(ino, generation, size, block_size, blocks, token)
        except BaseException:
            self._pins.let_go_blocks(keys)
            raise
        if new:
            self._pinned[token] = keys
        else:                                   # this generation was published already
            self._pins.let_go_blocks(keys)
        self.collect()

    def withdraw(self, ino: int) -> None:
        """Its READs go to pyfuse3 from now on. Called inside a content change: the pins
        of what that frees are let go on the next turn of the event loop, not in it."""
        if self._plane is not None and self._plane.withdraw(ino):
            trio.lowlevel.current_trio_token().run_sync_soon(self.collect)

    def collect(self) -> None:
        """Let go of the pins of every version the front end has freed."""
        if self._plane is None:
            return
        for token in self._plane.collect():
            self._pins.let_go_blocks(self._pinned.pop(token))

    async def keep_collecting(self) -> None:
        """Once a second, collect: a version kept for a READ in hand is freed after it."""
        while True:
            await trio.sleep(self.COLLECT_EVERY)
            if self._pinned:
                self.collect()

    def unmount(self) -> None:
        """Lazily unmount (if still mounted), stop the threads, close the descriptors.

        Closing the last /dev/fuse descriptor aborts the connection: a process
        that still has a file open gets ENOTCONN, as after pyfuse3's own unmount.
        """
        if self._mounted:
            self._mounted = False
            if _libc.umount2(self.mountpoint.encode(), MNT_DETACH):
                err = ctypes.get_errno()
                if err not in (errno.EINVAL, errno.ENOENT):     # EINVAL: already unmounted
                    log.warning("lazy unmount of %s failed: %s", self.mountpoint, os.strerror(err))
        if self._plane is not None:
            self._plane.stop()
            self.collect()
            for keys in self._pinned.values():      # no READ is served any more
                self._pins.let_go_blocks(keys)
            self._pinned.clear()
        self._close_fds()

    def _close_fds(self) -> None:
        for name in ("dev_fd", "_front_fd", "_device_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        # session_fd belongs to libfuse once pyfuse3.init has it (fuse_session_destroy closes it)

    def raw_statistics(self) -> dict[str, int]:
        return {} if self._plane is None else self._plane.statistics()

    # NativeReadStatistics field -> the front end's counter (readplane.c's statistics()).
    _COUNTERS = {"native_reads": "native_reads", "native_read_bytes": "native_bytes",
                 "native_device_bytes": "native_device_bytes", "native_forwarded_reads": "forwarded_reads",
                 "native_unpublished_reads": "unpublished_reads",
                 "native_verify_failures": "native_verify_failures",
                 "native_device_errors": "native_device_errors",
                 "native_forwarded_requests": "forwarded_requests", "native_forwards_queued": "forwards_queued",
                 "native_published_files": "published_files", "native_publications": "publications",
                 "native_withdrawals": "withdrawals", "native_kept_versions": "kept_versions",
                 "native_threads": "threads"}

    def statistics(self) -> NativeReadStatistics:
        s = self.raw_statistics()
        return NativeReadStatistics(**{field: s.get(name, 0) for field, name in self._COUNTERS.items()})
