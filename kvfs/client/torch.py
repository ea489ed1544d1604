"""torch client for kvfs: load and save tensors the way inference engines do.

Install with ``pip install kvfs[torch]``. Works on any directory; on kvfs it is
faster because ``load`` keeps many reads in flight, and kvfs turns concurrent
reads of one file into concurrent device reads.

    t = kvfs.torch.load("/mnt/kvfs/chunk.pt", dtype=torch.bfloat16, shape=(2, 32, 256, 1024))
    kvfs.torch.save(t, "/mnt/kvfs/chunk.pt")
    k = kvfs.torch.key("/mnt/kvfs/chunk.pt")         # content key, hex
    same = kvfs.torch.load(kvfs.torch.by_hash_path("/mnt/kvfs", k), ...)
"""
from __future__ import annotations

import ctypes
import errno
import math
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from .bypass import bypass_open_file, reopen

__all__ = ["load", "save", "key", "by_hash_path", "NotOnKvfsError"]

PathLike = Union[str, os.PathLike]

KEY_XATTR = "user.kvfs.key"
MIN_RANGE = 1 << 20   # one FUSE request (kvfs negotiates 1 MiB): no point going smaller
MAX_RANGE = 8 << 20   # above this, fewer ranges than threads for a typical 32 MiB chunk
THREADS = 16          # reads in flight per load; networked flash wants a deep queue

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


class NotOnKvfsError(OSError):
    """The file has no kvfs content key (not on a kvfs mount)."""


# -- raw memory -------------------------------------------------------------

def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (any dtype).

    Goes through ctypes rather than numpy so fp8 and bf16 work and numpy is not
    needed; the caller keeps ``tensor`` alive while the view is in use.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    buf = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(buf).cast("B")


def _executor() -> ThreadPoolExecutor:
    # One shared pool: creating threads per load would cost more than a small read.
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="kvfs-load")
        return _pool


# -- load -------------------------------------------------------------------

def _ranges(size: int) -> list[tuple[int, int]]:
    """Split [0, size) into 1..8 MiB pieces, about two per thread."""
    step = min(MAX_RANGE, max(MIN_RANGE, size // (2 * THREADS)))
    step = (step // MIN_RANGE) * MIN_RANGE  # whole FUSE requests, aligned
    return [(off, min(off + step, size)) for off in range(0, size, step)]


def _pread_full(fd: int, view: memoryview, offset: int, path) -> None:
    """Fill ``view`` from ``offset``; a short read is retried, EOF is an error.

    A silently short read would hand back a tensor with stale bytes in its tail,
    the exact failure engines cannot detect (they never check counts).
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"{path}: file ended at byte {offset + done}, "
                           f"expected {offset + len(view)}")
        done += n


def _new_tensor(size: int, dtype, shape, pin_memory: bool) -> torch.Tensor:
    dtype = dtype or torch.uint8
    itemsize = torch.empty((), dtype=dtype).element_size()
    if size % itemsize:
        raise ValueError(f"file size {size} is not a multiple of {dtype} ({itemsize} bytes)")
    shape = tuple(shape) if shape is not None else (size // itemsize,)
    if math.prod(shape) * itemsize != size:
        raise ValueError(f"shape {shape} of {dtype} is {math.prod(shape) * itemsize} bytes, "
                         f"file is {size}")
    # pin_memory=True raises on a machine without an accelerator: we let it,
    # since a caller who asked for pinned memory should not silently get pageable.
    return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)


def _check_out(out: torch.Tensor, size: int, dtype, shape) -> None:
    if out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("out must be a contiguous CPU tensor")
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype}, asked for {dtype}")
    if shape is not None and tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, asked for {tuple(shape)}")
    if out.numel() * out.element_size() != size:
        raise ValueError(f"out holds {out.numel() * out.element_size()} bytes, file is {size}")


def load(path: PathLike, *, out: Optional[torch.Tensor] = None, pin_memory: bool = False,
         dtype: Optional[torch.dtype] = None,
         shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Read a whole file of raw tensor bytes into a new tensor, or into ``out``.

    Without ``out`` the tensor has ``dtype`` (default uint8) and ``shape``
    (default 1-D); ``pin_memory`` pins it for fast host-to-device copies. The file
    is read with concurrent preads straight into the tensor's memory, so there is
    no staging copy; where this process may read the store's device itself (root,
    or the mount's ``bypass_group``), straight from the device, every block
    verified (kvfs/client/bypass.py). Raises ValueError if sizes disagree, EOFError if the file
    shrinks while being read.
    """
    # Named with O_PATH first: an open would have kvfs read the file for this process
    # too (prefetch, page fill), which the bypass does not need (kvfs/client/bypass.py).
    named = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        size = os.fstat(named).st_size
        if out is None:
            out = _new_tensor(size, dtype, shape, pin_memory)
        else:
            _check_out(out, size, dtype, shape)
        view = _bytes_of(out)
        if size and bypass_open_file(named, view, size, path):
            return out          # read from the device and verified (kvfs/client/bypass.py)
        fd = reopen(named, path)        # the same file, for reads through the mount
        try:
            _read_through(fd, view, size, path)
        finally:
            os.close(fd)
        return out
    finally:
        os.close(named)


def _read_through(fd: int, view: memoryview, size: int, path: PathLike) -> None:
    """Concurrent preads of the whole file into ``view``."""
    pieces = _ranges(size)
    if len(pieces) <= 1:
        _pread_full(fd, view, 0, path)
        return
    futures = [_executor().submit(_pread_full, fd, view[a:b], a, path) for a, b in pieces]
    for f in futures:  # wait for all before closing fd; re-raise the first error
        f.exception()
    for f in futures:
        f.result()


# -- save -------------------------------------------------------------------

def _write_full(fd: int, view: memoryview) -> None:
    # Linux caps one write at ~2 GiB and FUSE may accept less: loop until done.
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def save(tensor: torch.Tensor, path: PathLike, *, fsync: bool = False) -> None:
    """Write a tensor's raw bytes (no header) to ``path`` atomically.

    Like LMCache's fs connector and SGLang: a temp file in the same directory,
    one sequential write of the whole buffer, then ``os.replace``. Readers see the
    old file or the new one, never a torn one, and the content key kvfs computes
    is that of the bytes alone. ``fsync`` makes it durable before the rename.
    """
    data = tensor.detach().contiguous().cpu()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_full(fd, _bytes_of(data))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# -- content keys -----------------------------------------------------------

def key(path: PathLike) -> str:
    """The kvfs content key of a file, as a hex string.

    Files with equal keys have equal bytes; ``by_hash_path(mount, key)`` opens
    the content by key. Raises NotOnKvfsError off kvfs.
    """
    try:
        raw = os.getxattr(path, KEY_XATTR)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise NotOnKvfsError(e.errno, f"{path} has no {KEY_XATTR} attribute: "
                                 "not a file on a kvfs mount", str(path)) from None
        raise
    # kvfs stores the key as ASCII hex; accept raw digest bytes too.
    try:
        text = raw.decode("ascii")
        int(text, 16)
        return text.lower()
    except (UnicodeDecodeError, ValueError):
        return raw.hex()


def by_hash_path(mount: PathLike, content_key: str) -> Path:
    """Path of a file's content in the mount's by-hash view."""
    return Path(mount) / ".kvfs" / "by-hash" / content_key
