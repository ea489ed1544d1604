"""The device: a regular file or block device, read and written in aligned units.

All transfers are whole 4 KiB sectors at 4 KiB-aligned offsets, so the same code
works with O_DIRECT (used whenever the device accepts it) and without it (tmpfs
and some network filesystems refuse O_DIRECT; we fall back to buffered I/O and
rely on fdatasync for durability).

Blocking calls run in worker threads through one CapacityLimiter; os.preadv,
os.pwrite and xxhash release the GIL, so these threads really run in parallel.
"""
import bisect
import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
from typing import Any, Callable, Optional, Sequence

import trio

from ..base.aligned import SECTOR, Buffer, WritableBuffer, align_up, new_buffer
from .calls import CallTracker, asked, counts_errors, each_outcome
from ..errors import (Busy, DeviceError, Fenced, InternalError, InvalidArgument, KvfsError, NotADevice,
                     NotFound, device_error, os_error)

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
BLKDISCARD = 0x1277
# What I/O on a lost path returns: retried within the device's retry window.
RETRIED_ERRNOS = {errno.EIO, errno.ENOLINK, errno.ENOTCONN, errno.ETIMEDOUT, errno.ENXIO,
                  errno.EREMOTEIO, errno.ENODEV}
BLKGETSIZE64 = 0x80081272
# Upper bounds (seconds) of the device read latency histogram (Prometheus "le").
READ_LATENCY_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclasses.dataclass(frozen=True)
class DeviceStatistics:
    path: str
    size: int
    direct_io: bool
    bytes_read: int
    bytes_written: int
    reads: int
    writes: int
    syncs: int
    discards: int
    reads_in_flight: int
    reads_in_flight_max: int
    read_latency_counts: tuple[int, ...] = ()  # reads per READ_LATENCY_BOUNDS bucket (not cumulative), then the rest
    read_latency_sum: float = 0.0       # seconds spent in all reads
    retries: int = 0                    # transfers retried within the retry window
    read_errors: int = 0                # calls that ended in an error (after any retries), by kind
    write_errors: int = 0
    sync_errors: int = 0
    discard_errors: int = 0
    short_transfers: int = 0            # system calls that moved fewer bytes than asked (absorbed or not)
    timeouts: int = 0                   # calls whose callers gave up after io_timeout (EIO)
    late_calls: int = 0                 # of those, still running in their threads


class Device:
    """An open kvfs device. Use :meth:`open`; close with :meth:`close`."""

    def __init__(self, path: str | os.PathLike, fd: int, size: int, direct_io: bool, is_block: bool, *,
                 io_threads: int = 64, retry_window: float = 0.0, timeout: Optional[float] = 60.0) -> None:
        self.path = str(path)
        self.fd = fd
        self.size = size
        self.direct_io = direct_io
        self.is_block = is_block
        self.limiter = trio.CapacityLimiter(io_threads)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._bytes_read = self._bytes_written = 0
        self._reads = self._writes = self._syncs = self._discards = 0
        self._inflight = self._inflight_max = 0
        self._latency = [0] * (len(READ_LATENCY_BOUNDS) + 1)
        self._latency_sum = 0.0
        self.discard_supported = True
        # Seconds a failing transfer is retried before it becomes an error: an
        # NVMe-oF controller reconnect fails I/O for a while, then recovers.
        self.retry_window = retry_window
        self._retries = 0
        self._errors = dict.fromkeys(("read", "write", "sync", "discard"), 0)
        self._short = 0
        if timeout is not None and not timeout > retry_window:
            raise InvalidArgument(f"io_timeout ({timeout:g} s) must be longer than io_retry ({retry_window:g} s)")
        # Every async call waits at most ``timeout`` seconds (io_timeout): see kvfs/device/calls.py.
        self.calls = CallTracker(self.limiter, timeout, name=self.path)
        self.fenced: Optional[str] = None     # why writes are refused (multi-mount protection), or None
        self.fence_error: type[Exception] = Fenced    # what a refused write raises

    @classmethod
    def open(cls, path: str | os.PathLike, *, readonly: bool = False, lock: bool = True, **kw: Any) -> "Device":
        """Open ``path``; take an exclusive advisory lock so two daemons cannot share it."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise NotFound(f"{path}: no such device or file") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise NotADevice(f"{path}: not a regular file or block device")
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC
        fd, direct = _open_direct(path, flags)
        try:
            if lock:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise Busy(f"{path}: device is in use (mounted or being checked)") from None
            size = _block_device_size(fd) if stat.S_ISBLK(st.st_mode) else st.st_size
            return cls(path, fd, size, direct, stat.S_ISBLK(st.st_mode), **kw)
        except BaseException:
            os.close(fd)
            raise

    def fence(self, reason: str, error: type[Exception] = Fenced) -> None:
        """Refuse every later write, flush, discard and preallocation (reads still work).

        Multi-mount protection calls this when another host may own the store
        (``error`` Fenced, EROFS); the store, when a metadata write went unanswered
        (DeviceFailed, EIO). From here on nothing this process does can change the device.
        """
        self.fenced, self.fence_error = reason, error

    def _check_fence(self):
        if self.fenced:
            raise self.fence_error(f"{self.path}: writes are stopped: {self.fenced}")

    @property
    def timeout(self) -> Optional[float]:
        return self.calls.timeout

    def after_abandoned(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once no abandoned call can still write to the device (see CallTracker)."""
        self.calls.after_abandoned(callback)

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.calls.late_calls():
            # An abandoned call may still make its system call on this descriptor: keep
            # the number taken, on /dev/null, so it can never reach a file opened later
            # under the same number (the lock goes with the store's open file).
            log.warning("%s: closed with %d device call(s) still unanswered", self.path, self.calls.late_calls())
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, self.fd)
            os.close(null)
        else:
            os.close(self.fd)
        self.fd = -1

    def _buffer(self, span):
        """A page-aligned buffer of at least ``span`` bytes, private to this thread.

        Reused across calls: a fresh mmap per request costs a page fault per
        4 KiB, taken while holding the GIL, which starved the event loop.
        """
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < span:
            if buf is not None:
                buf.close()
            buf = self._local.buf = new_buffer(align_up(span, 1 << 20))
        return buf

    # -- synchronous primitives (called in worker threads or by offline tools) --
    @counts_errors("read")
    def pread_sync(self, off: int, length: int) -> bytes:
        """Read exactly ``length`` bytes at ``off``; a short read is an error."""
        if off < 0 or off + length > self.size:
            raise DeviceError(f"read [{off}, +{length}) is outside the device ({self.size} bytes)")
        if length == 0:
            return b""
        start = off - off % SECTOR
        span = align_up(off + length) - start
        buf = self._buffer(span)
        self._read_span(buf, start, span, need=off - start + length)
        return buf[off - start:off - start + length]

    def _read_span(self, buf, start, span, need):
        """preadv ``span`` bytes at ``start`` into ``buf``; fewer than ``need`` is an error."""
        with self._lock:
            self._inflight += 1
            self._inflight_max = max(self._inflight_max, self._inflight)
        began = time.monotonic()
        try:
            done = 0
            with memoryview(buf) as view:
                while done < span:
                    n = self._retrying(self._sys_preadv, view[done:span], start + done, progress=True)
                    if n == 0:
                        break
                    done += n
        except OSError as exc:
            raise device_error(exc, f"device read at {start} failed: {exc.strerror}") from None
        finally:
            with self._lock:
                self._inflight -= 1
        if done < need:
            raise DeviceError(f"short device read at {start}: got {done} of {need} bytes")
        took = time.monotonic() - began
        with self._lock:
            self._bytes_read += span
            self._reads += 1
            self._latency[bisect.bisect_left(READ_LATENCY_BOUNDS, took)] += 1
            self._latency_sum += took

    @counts_errors("read")
    def read_block_sync(self, off: int, length: int, buf: Optional[WritableBuffer] = None) -> memoryview:
        """Read ``length`` bytes at a sector-aligned ``off`` into a page-aligned buffer.

        ``buf`` is a recycled mmap to fill (a new one is made if it is missing or
        too small). Returns a read-only memoryview of exactly ``length`` bytes.
        The device fills the buffer directly (O_DIRECT DMA); nobody copies it
        afterwards: the cache keeps the view and FUSE replies are sent from it.
        """
        if off % SECTOR:
            raise InternalError(f"unaligned block read at {off}")
        if off < 0 or off + length > self.size:
            raise DeviceError(f"read [{off}, +{length}) is outside the device ({self.size} bytes)")
        span = align_up(max(length, 1))
        if buf is None or len(buf) < span:
            buf = new_buffer(span)
        self._read_span(buf, off, span, need=length)
        return memoryview(buf).toreadonly()[:length]

    @counts_errors("read")
    def read_blocks_sync(self, off: int, lengths: Sequence[int],
                         bufs: Sequence[Optional[WritableBuffer]]) -> list[memoryview]:
        """Read contiguous blocks at a sector-aligned ``off`` into ``bufs`` with one preadv.

        Block ``i`` has ``lengths[i]`` bytes and occupies ``align_up(lengths[i])``
        bytes of the device, right after block ``i - 1``. Returns one read-only
        memoryview per block (like read_block_sync). One system call, one hand-off
        from the event loop, for a whole run; the kernel still splits it into
        many device requests, so a run keeps the device's queue full.
        """
        if off % SECTOR:
            raise InternalError(f"unaligned block read at {off}")
        spans = [align_up(max(n, 1)) for n in lengths]
        total = sum(spans)
        if off < 0 or off + total > self.size:
            raise DeviceError(f"read [{off}, +{total}) is outside the device ({self.size} bytes)")
        bufs = [b if b is not None and len(b) >= s else new_buffer(s) for b, s in zip(bufs, spans)]
        with self._lock:
            self._inflight += len(bufs)
            self._inflight_max = max(self._inflight_max, self._inflight)
        began = time.monotonic()
        views = [memoryview(b)[:s] for b, s in zip(bufs, spans)]
        try:
            done = self._retrying(self._sys_preadv_many, views, off, progress=True)
            if done < total:
                # Rare (a signal, a device boundary): finish block by block.
                pos = 0
                for view, span in zip(views, spans):
                    if pos + span > done:
                        got = max(0, done - pos)
                        while got < span:
                            n = self._retrying(self._sys_preadv, view[got:span], off + pos + got,
                                               progress=True)
                            if n == 0:
                                break
                            got += n
                        if got < span:
                            raise DeviceError(f"short device read at {off + pos}: got {got} of {span} bytes")
                    pos += span
        except OSError as exc:
            raise device_error(exc, f"device read at {off} failed: {exc.strerror}") from None
        finally:
            for view in views:
                view.release()
            with self._lock:
                self._inflight -= len(bufs)
        took = time.monotonic() - began
        with self._lock:
            self._bytes_read += total
            self._reads += 1
            self._latency[bisect.bisect_left(READ_LATENCY_BOUNDS, took)] += 1
            self._latency_sum += took
        return [memoryview(b).toreadonly()[:n] for b, n in zip(bufs, lengths)]

    @counts_errors("write")
    def pwrite_sync(self, off: int, data: Buffer, source: Optional[Buffer] = None) -> None:
        """Write ``data`` at a sector-aligned ``off``, zero-padded to whole sectors.

        ``source``: an optional page-aligned buffer holding ``data`` at its start
        and zeros after it; it is written as is, saving a copy.
        """
        if off % SECTOR:
            raise InternalError(f"unaligned device write at {off}")
        self._check_fence()
        span = align_up(len(data))
        if off < 0 or off + span > self.size:
            # The allocator never hands out such an extent: this is a bug, not a full disk.
            raise InternalError(f"write [{off}, +{span}) is outside the device ({self.size} bytes)")
        if source is not None and len(source) >= span:
            buf = source
        else:
            buf = self._buffer(span)
            # Copied a slice at a time: one copy of a checkpoint (hundreds of MB at
            # a million files) holds the GIL throughout, stopping the event loop.
            with memoryview(data) as src:
                for start in range(0, len(src), COPY_SLICE):
                    end = min(start + COPY_SLICE, len(src))
                    buf[start:end] = src[start:end]
            buf[len(data):span] = bytes(span - len(data))
        try:
            done = 0
            while done < span:
                with memoryview(buf) as view:
                    n = self._retrying(self._sys_pwrite, view[done:span], off + done, fenceable=True,
                                       progress=True)
                if n == 0:
                    raise DeviceError(f"device write at {off} made no progress")
                done += n
        except OSError as exc:
            raise device_error(exc, f"device write at {off} failed: {exc.strerror}") from None
        with self._lock:
            self._bytes_written += span
            self._writes += 1

    @counts_errors("sync")
    def sync_sync(self) -> None:
        self._check_fence()
        try:
            # Only with O_DIRECT is a retried flush honest: with buffered I/O a
            # failed fdatasync may already have dropped the dirty pages it failed
            # to write, and a second call would report success for lost data.
            if self.direct_io:
                self._retrying(self._sys_fdatasync, fenceable=True)
            else:
                self._sys_fdatasync()
        except OSError as exc:
            raise device_error(exc, f"device flush failed: {exc.strerror}") from None
        with self._lock:
            self._syncs += 1

    def preallocate_sync(self, off: int, length: int) -> None:
        """Give a file-backed store real host space for [off, off+length) (no-op on a block device).

        A sparse store file gets host blocks only when written. Metadata must
        never be the write that finds the host filesystem full: frees become
        reusable only after a journal commit, so a journal that cannot be
        written could never make room again.
        """
        if self.is_block or length <= 0:
            return
        self._check_fence()
        try:
            os.posix_fallocate(self.fd, off, length)
        except OSError as exc:
            raise device_error(exc, f"cannot reserve host space for kvfs metadata: {exc.strerror}") from None

    @counts_errors("discard")
    def discard_sync(self, off: int, length: int) -> None:
        """Tell the device a range is unused (TRIM / hole punch). Best effort."""
        if not self.discard_supported or length <= 0:
            return
        self._check_fence()
        try:
            self._sys_discard(off, length)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                self.discard_supported = False
                return
            raise device_error(exc, f"discard at {off} failed: {exc.strerror}") from None
        with self._lock:
            self._discards += 1

    def _retrying(self, call, *args, fenceable=False, progress=False):
        """``call(*args)``, retried with backoff for up to ``retry_window`` seconds on the
        errors a lost path gives (then the last error stands). Runs in a worker thread.
        A ``fenceable`` call (a write or flush) is not retried once the device is fenced:
        a write waiting out a path loss must not land after another host took over.

        ``progress``: the call is a transfer inside the device, so moving nothing
        (0 bytes, where the device has more) is a failed transfer too, a short
        transfer of zero bytes, and is retried in the same window; once the
        window is over the 0 stands and the caller reports the short transfer."""
        deadline, pause = None, 0.05
        while True:
            if fenceable:
                self._check_fence()
            try:
                moved = call(*args)
                if moved is not None and moved < asked(args[0]):
                    with self._lock:
                        self._short += 1
                if not progress or moved != 0:
                    return moved
                failed = None
            except OSError as exc:
                if exc.errno not in RETRIED_ERRNOS:
                    raise
                failed = exc
            now = time.monotonic()
            if self.retry_window > 0:
                deadline = deadline or now + self.retry_window
            if deadline is None or now >= deadline:
                if failed is not None:
                    raise failed
                return 0
            with self._lock:
                self._retries += 1
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 1.0)

    # -- the system calls: every transfer above goes through exactly these ----
    # One call each, no checks: the callers handle short transfers and errors.
    # kvfs.device.testfaults interposes here to inject device faults under the real code.
    def _sys_preadv(self, view, off):
        return os.preadv(self.fd, [view], off)

    def _sys_preadv_many(self, views, off):
        return os.preadv(self.fd, views, off)

    def _sys_pwrite(self, view, off):
        return os.pwrite(self.fd, view, off)

    def _sys_fdatasync(self):
        os.fdatasync(self.fd)

    def _sys_discard(self, off, length):
        if self.is_block:
            fcntl.ioctl(self.fd, BLKDISCARD, off.to_bytes(8, "little") + length.to_bytes(8, "little"))
        elif _libc.fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

    # -- async wrappers: never block the trio loop --------------------------
    async def run(self, fn: Callable[..., Any], *args: Any, on_abandon: Optional[Callable[[], None]] = None,
                  writes: bool = True) -> Any:
        """Run a blocking device function in a worker thread; DeviceTimeout (EIO) after io_timeout.

        ``on_abandon``, ``writes``: see :meth:`kvfs.device.calls.CallTracker.run`.
        """
        return await self.calls.run(fn, *args, on_abandon=on_abandon, writes=writes)

    async def pread(self, off: int, length: int) -> bytes:
        return await self.run(self.pread_sync, off, length, writes=False)

    async def pwrite(self, off: int, data: Buffer, source: Optional[Buffer] = None) -> None:
        return await self.run(self.pwrite_sync, off, data, source)

    async def pwrite_each(self, writes: Sequence[tuple]) -> list[Optional[KvfsError]]:
        """:meth:`pwrite_sync` of each (off, data, source) in one worker call (see each_outcome)."""
        return await self.run(each_outcome, self.pwrite_sync, writes)

    async def sync(self) -> None:
        return await self.run(self.sync_sync)

    async def discard(self, off: int, length: int) -> None:
        return await self.run(self.discard_sync, off, length)

    def statistics(self) -> DeviceStatistics:
        with self._lock:
            return DeviceStatistics(self.path, self.size, self.direct_io, self._bytes_read,
                                    self._bytes_written, self._reads, self._writes, self._syncs,
                                    self._discards, self._inflight, self._inflight_max,
                                    tuple(self._latency), self._latency_sum, self._retries,
                                    *self._errors.values(), self._short, self.calls.timeouts,
                                    self.calls.late_calls())


COPY_SLICE = 4 << 20             # bytes copied per GIL hold in pwrite_sync


def _open_direct(path, flags):
    """Open with O_DIRECT if the device accepts aligned direct reads, else buffered."""
    try:
        fd = os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise os_error(exc, f"{path}: cannot open: {exc.strerror}") from None
    else:
        try:
            probe = mmap.mmap(-1, SECTOR)
            os.preadv(fd, [probe], 0)
            return fd, True
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.EINVAL:
                raise os_error(exc, f"{path}: cannot read: {exc.strerror}") from None
    try:
        return os.open(path, flags), False
    except OSError as exc:
        raise os_error(exc, f"{path}: cannot open: {exc.strerror}") from None


def _block_device_size(fd):
    return int.from_bytes(fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8), "little")
