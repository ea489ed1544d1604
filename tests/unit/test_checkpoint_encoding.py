"""kvfs.store.encoding: a checkpoint packed in pieces is byte for byte msgpack.packb's, and decodes back."""
import mmap
import random

import msgpack

from kvfs.store.encoding import SPLIT_LISTS_LONGER_THAN, packb_in_pieces


def sample_wire(rng, inodes):
    return {
        "next_ino": 16 + inodes,
        "inodes": [[16 + i, 0o100644, 0, 0, 1, 0, rng.getrandbits(62), rng.getrandbits(62), rng.getrandbits(62),
                    rng.randrange(1 << 40), [[rng.randbytes(16), rng.randrange(1 << 40), 1 << 20]] * rng.randrange(3),
                    None, [[1, rng.randbytes(rng.randrange(1, 60))]]]
                   for i in range(inodes)],
        "blocks": [[rng.randbytes(16), rng.randrange(1 << 40), rng.randrange(1, 1 << 20), 1]
                   for _ in range(inodes // 2)],
        "free": [[rng.randrange(1 << 40), 4096]] * 3,
        "note": "text and bytes differ in msgpack",
        "blob": b"\x00\xff",
    }


def test_pieces_equal_packb_and_decode_back():
    rng = random.Random(7)
    for inodes in (0, 1, SPLIT_LISTS_LONGER_THAN, SPLIT_LISTS_LONGER_THAN + 1, 5000):
        wire = sample_wire(rng, inodes)
        whole = msgpack.packb(wire)
        packed = packb_in_pieces(wire)               # consumes wire's long lists
        assert packed == whole, inodes
        assert msgpack.unpackb(packed) == msgpack.unpackb(whole)
        assert all(len(v) <= SPLIT_LISTS_LONGER_THAN for v in wire.values() if isinstance(v, list))


def test_an_empty_checkpoint():
    assert packb_in_pieces({}) == msgpack.packb({})


def test_the_payload_lies_in_a_buffer_the_device_can_write_as_it_is():
    # Device.pwrite_sync's ``source``: page aligned (an mmap), the payload at
    # its start, zeros after it to the end of the last sector.
    packed = packb_in_pieces(sample_wire(random.Random(3), 300))
    buf = packed.obj
    assert isinstance(buf, mmap.mmap) and len(buf) % 4096 == 0 and len(buf) >= len(packed)
    assert bytes(buf[:len(packed)]) == bytes(packed)
    assert buf[len(packed):].count(0) == len(buf) - len(packed)
    assert packed.readonly
