"""msgpack encoding of a checkpoint in small pieces, so a worker thread encoding it lets go of the GIL.

``msgpack.packb`` of a whole checkpoint is one C call that holds the GIL from
start to end: the event loop, waiting for the GIL, stopped for all of it (issue
10: about 0.3 s at 50,000 files, growing with the namespace). Packing the
top-level map's long lists item by item gives the same bytes (msgpack has one
encoding per value here) and lets the interpreter switch threads between items.

The pieces are then copied one by one into a page-aligned buffer that the
device writes as it is. ``b"".join`` of them was one C call again (46 ms for
the 100,000 pieces of 100,000 files), and so was the device's copy of the
joined bytes into its own aligned buffer, made with MAP_POPULATE (the mmap
call holds the GIL while the kernel faults the pages in: 177 ms for 300 MiB).
"""
import msgpack

from ..aligned import align_up, new_buffer
from ..gcpolicy import release_in_pieces

SPLIT_LISTS_LONGER_THAN = 64


def packb_in_pieces(wire):
    """``msgpack.packb(wire)``, byte for byte, for a dict (a checkpoint's to_wire()).

    Returns a read-only memoryview of exactly those bytes over a page-aligned
    buffer (``.obj``) that is zero after them, for ``Device.pwrite_sync``'s
    ``source``. It consumes ``wire``: the long lists are empty afterwards."""
    packer = msgpack.Packer()          # packb's defaults: use_bin_type, autoreset
    out = [packer.pack_map_header(len(wire))]
    for key, value in wire.items():
        out.append(packer.pack(key))
        if isinstance(value, list) and len(value) > SPLIT_LISTS_LONGER_THAN:
            out.append(packer.pack_array_header(len(value)))
            pack = packer.pack
            for item in value:      # a Python loop: the interpreter may switch threads between items
                out.append(pack(item))
            release_in_pieces(value)        # the rows die here, in pieces (see kvfs/gcpolicy.py)
        else:
            out.append(packer.pack(value))
    total = sum(len(piece) for piece in out)
    # Not populated: its pages are faulted in a piece at a time by the copies.
    buf = new_buffer(align_up(max(total, 1)), populate=False)
    pos = 0
    for piece in out:             # a Python loop again, and each copy is small
        end = pos + len(piece)
        buf[pos:end] = piece
        pos = end
    release_in_pieces(out)
    return memoryview(buf).toreadonly()[:total]
