"""The ground floor: sector size, alignment arithmetic and page-aligned buffers.

Every layer may use these; they depend on nothing in kvfs.
"""
from __future__ import annotations

import mmap
from typing import Union

SECTOR = 4096          # alignment of every device transfer, metadata write and allocation unit

# For annotations: the bytes that move between the layers.
Buffer = Union[bytes, bytearray, memoryview, mmap.mmap]     # anything bytes-like: what a write takes
WritableBuffer = Union[bytearray, memoryview, mmap.mmap]    # what a read fills in place


def align_up(n: int, a: int = SECTOR) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int = SECTOR) -> int:
    return n // a * a


def new_buffer(size: int, populate: bool = True) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer, its pages faulted in by one mmap call.

    Page aligned, so the device can transfer into or out of it with O_DIRECT.
    MAP_POPULATE makes the kernel fill the pages up front instead of taking a
    fault per 4 KiB on first touch (in the event loop, holding the GIL). With
    ``populate`` False the pages come on first touch, and only those touched
    take memory: for a buffer that will be mostly unused.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)
