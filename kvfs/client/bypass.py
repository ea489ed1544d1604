"""Read whole kvfs files into caller buffers, from the device itself when allowed.

    n = kvfs.client.read_into("/mnt/kvfs/chunk", buf)              # buf: bytearray, mmap, tensor
    ns = kvfs.client.read_many([("/mnt/kvfs/a", buf_a), ("/mnt/kvfs/b", buf_b)])

A buffer is anything writable with the buffer protocol (bytearray, memoryview,
mmap, a numpy array) or a contiguous CPU torch tensor (pinned or not). It must
hold the whole file (ValueError otherwise); the count returned is the file's
size, never less: a file that shrinks under a read through the mount raises
OSError(EIO) rather than leave stale bytes in the buffer's tail.

How a read goes (the bypass; docs/architecture.md, "Bypass reads"):

1. The file is named through the mount with an O_PATH descriptor, not opened: an
   open would have the daemon read the file for the opener too (its page fill and
   prefetch on open).
2. ``user.kvfs.blockmap`` of that file (the kernel checks read permission, as for
   an open) gives its block map under a lease
   (kvfs/fuse/blockmaps.py): where each block lies on the device, its key and
   salt, and the store's seed and secret. The daemon gives maps only to root
   and to the mount's ``bypass_group``, and only of files exactly on the device.
3. The blocks are read from the device (opened with O_DIRECT, one descriptor per
   device for the process) by the native read core, several runs in flight on
   threads of its own, and each is checked against its key; they land in the
   caller's buffer (in place when aligned), holes and tails as zeros.
4. ``user.kvfs.lease.end.<id>`` ends the lease and says whether the file is still
   what the map described. Only then do the bytes count.

Any failure on that way (no map, a device this process may not open, a block
that fails its key, a lease that ended stale) makes the file read through the
mount instead, with the same result. :func:`statistics` counts both ways.
``KVFS_CLIENT_BYPASS=off`` in the environment turns the bypass off (every read
through the mount), to compare the two or to rule the bypass out.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
from typing import Any, Optional, Sequence, Union

import msgpack


def _load_readcore():
    """The native read core (kvfs/device/_readcore.c), loaded from its file: importing the
    kvfs.device package would bring trio and the daemon's device layer into every engine."""
    loaded = sys.modules.get("kvfs.device._readcore")
    if loaded is not None:
        return loaded
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "device")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_readcore" + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("kvfs.device._readcore", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"kvfs's read core is not built (no _readcore extension in {folder})")


_readcore = _load_readcore()

__all__ = ["read_into", "read_many", "release_devices", "statistics", "BypassStatistics"]

PathLike = Union[str, os.PathLike]

BLOCKMAP_XATTR = b"user.kvfs.blockmap"
LEASE_END_PREFIX = b"user.kvfs.lease.end."
XATTR_SIZE_MAX = 65536            # one getxattr with the kernel's largest value: one request to the daemon
XATTR_NAME_MAX = 255
MAP_KEYS = {"lease", "seconds", "version", "size", "block_size", "device", "seed", "secret", "blocks"}
READ_THREADS = 8                  # device runs in flight per submission (the read core's threads)
BYPASS_ENV = "KVFS_CLIENT_BYPASS"  # "off": read through the mount only
DENIED_RETRY_S = 10.0             # a mount that refused a map is asked again after this long

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.getxattr.restype = ctypes.c_ssize_t


@dataclasses.dataclass(frozen=True)
class BypassStatistics:
    bypass_files: int             # files read from the device, verified, under a lease that ended valid
    bypass_bytes: int             # their bytes (what the device delivered to this process)
    fallback_files: int           # files read through the mount instead
    no_map: int                   # ... because the daemon gave no map (not allowed, dirty, not kvfs)
    device_unopenable: int        # ... because this process could not open the device
    verify_failures: int          # ... because a block failed its key (the mount then verifies again)
    read_errors: int              # ... because a device read failed
    stale_leases: int             # ... because the file changed (or the lease expired) during the read


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.devices: dict[str, tuple] = {}      # device path -> (O_DIRECT descriptor, st_dev, st_ino)
        self.denied: dict[int, float] = {}       # st_dev of a mount that refused a map -> when
        self.local = threading.local()
        self.s = dict.fromkeys((f.name for f in dataclasses.fields(BypassStatistics)), 0)

    def count(self, **inc: int) -> None:
        with self.lock:
            for name, n in inc.items():
                self.s[name] += n


_state = _State()


def statistics() -> BypassStatistics:
    """What this process's reads did, since it imported kvfs.client."""
    with _state.lock:
        return BypassStatistics(**_state.s)


# -- buffers and the plain read -------------------------------------------------------------------

def byte_view(buffer: Any) -> memoryview:
    """A writable, flat byte view of ``buffer`` (buffer protocol or a CPU torch tensor)."""
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):     # a torch tensor
        if getattr(buffer, "device", None) is not None and buffer.device.type != "cpu":
            raise ValueError(f"buffer is on {buffer.device}, not in CPU memory")
        if not buffer.is_contiguous():
            raise ValueError("tensor buffer is not contiguous")
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0:
            return memoryview(bytearray())
        return memoryview((ctypes.c_ubyte * nbytes).from_address(buffer.data_ptr())).cast("B")
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def plain_read(fd: int, view: memoryview, size: int, path) -> int:
    """Fill ``view[:size]`` from the open ``fd`` through the mount; EOF before ``size`` is EIO."""
    done = 0
    while done < size:
        n = os.preadv(fd, [view[done:size]], done)
        if n == 0:
            raise OSError(errno.EIO, f"{os.fspath(path)}: file ended at {done} of {size} bytes "
                          "during the read", os.fspath(path))
        done += n
    return done


# -- the bypass -----------------------------------------------------------------------------------

def _fgetxattr(fd: int, name: bytes) -> bytes:
    """getxattr of the file open at ``fd``, an O_PATH descriptor too (fgetxattr refuses
    those): through /proc/self/fd, which names that very inode, whatever became of
    its path since. ``user.`` attributes need read permission on the file, as an open
    for reading does."""
    buf = getattr(_state.local, "buf", None)
    if buf is None:
        buf = _state.local.buf = ctypes.create_string_buffer(XATTR_SIZE_MAX)
    n = _libc.getxattr(b"/proc/self/fd/%d" % fd, name, buf, XATTR_SIZE_MAX)
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.raw[:n]


def _block_map(fd: int, st_dev: int) -> Optional[dict]:
    """The file's block map under a lease, or None (refused, not kvfs, a mount that refused lately)."""
    refused = _state.denied.get(st_dev)
    if refused is not None and time.monotonic() - refused < DENIED_RETRY_S:
        return None
    try:
        found = msgpack.unpackb(_fgetxattr(fd, BLOCKMAP_XATTR), raw=False)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            _state.denied[st_dev] = time.monotonic()       # not for us (or not kvfs): don't ask each time
        return None
    except ValueError:
        return None
    if not isinstance(found, dict) or not MAP_KEYS <= found.keys():
        return None
    return found


def _device_fd(path: str) -> int:
    """This process's descriptor of the device at ``path`` (O_DIRECT where it can be), or -errno."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    with _state.lock:
        held = _state.devices.get(path)
        if held is not None:
            if held[1:] == (st.st_dev, st.st_ino):
                return held[0]
            os.close(held[0])                           # another file or device at that path now
            del _state.devices[path]
        try:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.EINVAL:           # a filesystem without O_DIRECT (tmpfs)
                    raise
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return -(exc.errno or errno.EIO)           # not kept: permissions may change
        opened = os.fstat(fd)
        _state.devices[path] = (fd, opened.st_dev, opened.st_ino)
        return fd


def release_devices() -> None:
    """Close the device descriptors this process keeps (the next bypass read opens them again):
    for a tool that detaches or removes a device the process has read."""
    with _state.lock:
        held, _state.devices = list(_state.devices.values()), {}
    for fd, *_ in held:
        os.close(fd)


def _end_leases(fd: int, ids: list[int]) -> list[bool]:
    """End the leases ``ids`` (any open kvfs file of the mount will do); per id: still valid."""
    valid, start = [], 0
    while start < len(ids):
        name, end = LEASE_END_PREFIX, start
        while end < len(ids):
            part = (b"." if end > start else b"") + b"%x" % ids[end]
            if len(name) + len(part) > XATTR_NAME_MAX:
                break
            name += part
            end += 1
        try:
            answer = _fgetxattr(fd, name)
        except OSError:
            answer = b""
        batch = ids[start:end]
        valid += [i < len(answer) and answer[i:i + 1] == b"1" for i in range(len(batch))]
        start = end
    return valid


class _File:
    __slots__ = ("path", "view", "fd", "size", "map", "first", "count", "ok", "st_dev")

    def __init__(self, path, view, fd, size):
        self.path, self.view, self.fd, self.size = path, view, fd, size
        self.map, self.first, self.count, self.ok, self.st_dev = None, 0, 0, False, 0


def _plan(f: _File, blocks: list, dest: int) -> None:
    """Add ``f``'s blocks to ``blocks`` for the read core; zero its holes in the buffer now."""
    m = f.map
    bs, size = m["block_size"], f.size
    f.first = len(blocks)
    for i, b in enumerate(m["blocks"]):
        start = i * bs
        want = min(bs, size - start)
        if want <= 0:
            break
        if b is None:
            f.view[start:start + want] = bytes(want)
        else:
            off, length, key, salt = b
            blocks.append((off, length, key, salt, dest, start, want))
    covered = len(m["blocks"]) * bs
    if covered < size:
        f.view[covered:size] = bytes(size - covered)     # holes past the list
    f.count = len(blocks) - f.first


def _bypass(files: list[_File]) -> None:
    """Read what can be read from the device into the files' buffers; sets ``ok`` on those."""
    if os.environ.get(BYPASS_ENV, "on") == "off":
        return
    for f in files:
        if f.size:
            f.st_dev = os.fstat(f.fd).st_dev
            m = _block_map(f.fd, f.st_dev)
            if m is not None and m.get("size") != f.size:
                _end_leases(f.fd, [m["lease"]])          # changed since the open: read it plainly
                m = None
            f.map = m
    mapped = [f for f in files if f.map is not None]
    if not mapped:
        return
    try:
        _read_mapped(mapped)
    except (KeyError, IndexError, TypeError, ValueError):     # a map this client cannot use
        for f in mapped:
            f.ok = False
        _state.count(read_errors=len(mapped))
    finally:
        by_mount: dict[int, list[_File]] = {}          # lease ids are the daemon's: end each on its mount
        for f in mapped:
            by_mount.setdefault(f.st_dev, []).append(f)
        for group in by_mount.values():
            valid = _end_leases(group[0].fd, [f.map["lease"] for f in group])
            for f, still in zip(group, valid):
                if f.ok and not still:
                    f.ok = False
                    _state.count(stale_leases=1)


def _read_mapped(mapped: list[_File]) -> None:
    groups: dict[tuple, list[_File]] = {}
    for f in mapped:
        groups.setdefault((f.map["device"], f.map["seed"], bytes(f.map["secret"])), []).append(f)
    for (device, seed, secret), group in groups.items():
        dev_fd = _device_fd(device)
        if dev_fd < 0:
            _state.count(device_unopenable=len(group))
            continue
        blocks: list = []
        for dest, f in enumerate(group):
            _plan(f, blocks, dest)
        try:
            bad = _readcore.read_into(dev_fd, seed, blocks, [f.view for f in group], secret,
                                      threads=READ_THREADS)
        except OSError:
            _state.count(read_errors=len(group))
            continue
        bad = set(bad)
        for f in group:
            f.ok = not any(i in bad for i in range(f.first, f.first + f.count))
            if not f.ok:
                _state.count(verify_failures=1)


def _read_files(files: list[_File]) -> list[int]:
    _bypass(files)
    sizes = []
    for f in files:
        if f.ok:
            _state.count(bypass_files=1, bypass_bytes=f.size)
        else:
            if f.size and f.map is None:
                _state.count(no_map=1)
            if f.size:
                _state.count(fallback_files=1)
            _plain_read_buffered(f)
        sizes.append(f.size)
    _state.local.ways = [f.ok for f in files]
    return sizes


def _open_for_map(path: PathLike) -> int:
    """An O_PATH descriptor of ``path``: it names the file (a LOOKUP at most) without opening it.

    An open would have kvfs start reading the file for the opener: a buffered
    read-only open of a cold file fills the kernel's page cache from the device
    (page_fill), and every read-only open prefetches the file's blocks into
    kvfs's own cache; a reader that then reads the device itself paid twice.
    Measured on a loop device over tmpfs, read_many of 8 cold 32 MiB chunks: 1.3-2.0
    GB/s through O_DIRECT opens (the daemon read every block as well), 4.0-4.9 GB/s
    by O_PATH. The block map's getxattr checks read permission like an open."""
    return os.open(path, os.O_PATH | os.O_CLOEXEC)


def _plain_read_buffered(f: _File) -> int:
    """The read through the mount, on a descriptor of its own opened for reading:
    /proc/self/fd opens the file ``f.fd`` names again (it may be O_PATH, or O_DIRECT,
    which the caller's buffer may not suit), even if its name was renamed over since."""
    flags = fcntl.fcntl(f.fd, fcntl.F_GETFL)
    if not flags & (os.O_DIRECT | os.O_PATH):
        return plain_read(f.fd, f.view, f.size, f.path)
    fd = reopen(f.fd, f.path)
    try:
        return plain_read(fd, f.view, f.size, f.path)
    finally:
        os.close(fd)


def reopen(fd: int, path: PathLike) -> int:
    """Open the file ``fd`` names (an O_PATH descriptor) for reading.

    kvfs answers ESTALE for a file evicted since it was named (nothing held it open,
    so eviction could take it); through /proc/self/fd the kernel cannot look the name
    up again, so that is a file that is gone: FileNotFoundError, as for an unlink."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ESTALE:
            raise FileNotFoundError(errno.ENOENT, "evicted during the read", os.fspath(path)) from None
        raise


def last_ways() -> list[bool]:
    """Per file of this thread's last read_into/read_many: whether the device served it (else the mount)."""
    return list(getattr(_state.local, "ways", ()))


def bypass_open_file(fd: int, view: memoryview, size: int, path: PathLike) -> bool:
    """Try to read the first ``size`` bytes of the file ``fd`` names (an O_PATH descriptor
    will do) into ``view`` from the device; False (nothing promised of ``view``) if the
    caller must read it through the mount (kvfs.torch.load then reads it its own way)."""
    f = _File(path, view, fd, size)
    _bypass([f])
    if f.ok:
        _state.count(bypass_files=1, bypass_bytes=size)
    elif size:
        _state.count(fallback_files=1, no_map=int(f.map is None))
    return f.ok


def read_into(path: PathLike, buffer: Any) -> int:
    """Read the whole file at ``path`` into the start of ``buffer``; returns its size."""
    return read_many([(path, buffer)])[0]


def read_many(items: Sequence[tuple[PathLike, Any]]) -> list[int]:
    """Read each ``(path, buffer)`` pair like :func:`read_into`, the device reads of all of
    them in one submission; returns the sizes in order."""
    files: list[_File] = []
    try:
        for path, buffer in items:
            view = byte_view(buffer)
            fd = _open_for_map(path)
            size = os.fstat(fd).st_size
            files.append(_File(path, view, fd, size))
            if size > view.nbytes:
                raise ValueError(f"{os.fspath(path)}: buffer holds {view.nbytes} bytes, the file has {size}")
        return _read_files(files)
    finally:
        for f in files:
            os.close(f.fd)
