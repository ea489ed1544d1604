"""msgpack encoding of a checkpoint in small pieces, so a worker thread encoding it lets go of the GIL.

``msgpack.packb`` of a whole checkpoint is one C call that holds the GIL from
start to end: the event loop, waiting for the GIL, stopped for all of it (issue
10: about 0.3 s at 50,000 files, growing with the namespace). Packing the
top-level map's long lists item by item gives the same bytes (msgpack has one
encoding per value here) and lets the interpreter switch threads between items.
"""
import msgpack

from ..gcpolicy import release_in_pieces

SPLIT_LISTS_LONGER_THAN = 64


def packb_in_pieces(wire):
    """``msgpack.packb(wire)``, byte for byte, for a dict (a checkpoint's to_wire()).

    It consumes ``wire``: the long lists are empty afterwards."""
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
    return b"".join(out)
