"""Pack a sparse kvfs store file into a small image file, and unpack it again.

A store made by ``mkfs.kvfs --size 64M`` is a 64 MiB sparse file of which only
a few hundred KiB are ever written. The image keeps just its non-zero 4 KiB
sectors, as runs of consecutive sectors, in one lzma (xz) stream:

    header  b"KVFSIMG\\0", u32 image version (1), u64 store size, u32 sector size, u32 run count
    run     u64 byte offset, u32 sector count, then count * sector bytes of content

All integers are little-endian. Everything not in a run is zero. The store
size is a whole number of sectors (mkfs makes it so).
"""
import lzma
import struct

MAGIC = b"KVFSIMG\0"
IMAGE_VERSION = 1
SECTOR = 4096
_HEADER = struct.Struct("<8sIQII")
_RUN = struct.Struct("<QI")


def pack(store_bytes: bytes) -> bytes:
    """The compressed image of a store file's bytes."""
    size = len(store_bytes)
    assert size % SECTOR == 0, f"store size {size} is not a whole number of {SECTOR}-byte sectors"
    view = memoryview(store_bytes)
    zero = bytes(SECTOR)
    runs, start = [], None
    for off in range(0, size + SECTOR, SECTOR):
        nonzero = off < size and view[off:off + SECTOR] != zero
        if nonzero and start is None:
            start = off
        elif not nonzero and start is not None:
            runs.append((start, off))
            start = None
    out = [_HEADER.pack(MAGIC, IMAGE_VERSION, size, SECTOR, len(runs))]
    for begin, end in runs:
        out.append(_RUN.pack(begin, (end - begin) // SECTOR))
        out.append(view[begin:end].tobytes())
    return lzma.compress(b"".join(out), preset=9 | lzma.PRESET_EXTREME)


def unpack_to(image: bytes, path) -> int:
    """Write the store described by ``image`` to ``path`` as a sparse file; returns its size."""
    raw = memoryview(lzma.decompress(image))
    magic, version, size, sector, nruns = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != IMAGE_VERSION or sector != SECTOR:
        raise ValueError(f"not a kvfs store image of version {IMAGE_VERSION}: {magic!r} v{version}")
    pos = _HEADER.size
    with open(path, "wb") as f:
        f.truncate(size)                            # sparse: the holes read as zeros
        for _ in range(nruns):
            off, count = _RUN.unpack_from(raw, pos)
            pos += _RUN.size
            f.seek(off)
            f.write(raw[pos:pos + count * sector])
            pos += count * sector
    if pos != len(raw):
        raise ValueError(f"image has {len(raw) - pos} bytes after its last run")
    return size
