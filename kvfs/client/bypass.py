"""Read whole kvfs files into caller buffers: ``read_into`` and ``read_many``.

    n = kvfs.client.read_into("/mnt/kvfs/chunk", buf)              # buf: bytearray, mmap, ...
    ns = kvfs.client.read_many([("/mnt/kvfs/a", buf_a), ("/mnt/kvfs/b", buf_b)])

A buffer is anything writable with the buffer protocol (bytearray, memoryview,
mmap, a numpy array) or a contiguous CPU torch tensor. It must hold the whole
file (ValueError otherwise); the count returned is the file's size, never less:
a file that shrinks under the read raises OSError(EIO) rather than leave stale
bytes in the buffer's tail.
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Any, Sequence, Union

__all__ = ["read_into", "read_many"]

PathLike = Union[str, os.PathLike]


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


def _open_sized(path: PathLike, view: memoryview) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size > view.nbytes:
            raise ValueError(f"{os.fspath(path)}: buffer holds {view.nbytes} bytes, "
                             f"the file has {size}")
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def read_into(path: PathLike, buffer: Any) -> int:
    """Read the whole file at ``path`` into the start of ``buffer``; returns its size."""
    return read_many([(path, buffer)])[0]


def read_many(items: Sequence[tuple[PathLike, Any]]) -> list[int]:
    """Read each ``(path, buffer)`` pair like :func:`read_into`; returns the sizes in order."""
    sizes = []
    for path, buffer in items:
        view = byte_view(buffer)
        fd, size = _open_sized(path, view)
        try:
            sizes.append(plain_read(fd, view, size, path))
        finally:
            os.close(fd)
    return sizes
