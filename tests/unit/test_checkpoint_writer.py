"""kvfs.schema.writer: a checkpoint written row by row decodes to the state it was given,
lies in a buffer the device writes as it is, reports what did not fit, and never
holds the rows of a checkpoint all at once."""
import os
import random
import tracemalloc

import msgpack
import pytest
import trio

from kvfs import schema
from kvfs.errors import InternalError, NoSpace
from kvfs.namespace import ROOT_INO
from kvfs.schema.stream import decode_streaming

from .helpers import DIR_MODE, FILE_MODE, close_and_check, fill_files, mkfs, open_fs, running

FIRST_INO = 16


def sample_state(rng, inodes, free=True):
    rows = [schema.InodeRow(FIRST_INO, DIR_MODE, 0, 0, 2, 0, 1, 2, 3,
                            [FIRST_INO, [[b"f%d" % i, FIRST_INO + 1 + i] for i in range(inodes)]])]
    for i in range(inodes):
        keys = [rng.randbytes(16) for _ in range(rng.randrange(3))]
        rows.append(schema.InodeRow(FIRST_INO + 1 + i, FILE_MODE, rng.randrange(2000), 0, 1, 0,
                                    rng.getrandbits(62), rng.getrandbits(62), rng.getrandbits(62),
                                    [rng.randrange(1 << 40), keys]))
    blocks = [schema.BlockRow(rng.randbytes(16), rng.randrange(1 << 40), rng.randrange(1, 1 << 20), 1,
                              rng.choice([0, 0, 7])) for _ in range(inodes // 2)]
    return schema.CheckpointState(next_ino=FIRST_INO + inodes + 1, inodes=rows, blocks=blocks,
                                  free=[(rng.randrange(1 << 40), 4096)] * 3 if free else None,
                                  provisional=[FIRST_INO + 1] if inodes else [], pinned=[FIRST_INO])


def written(state, capacity=64 << 20):
    writer = schema.CheckpointWriter(capacity)
    schema.write_state(writer, state)
    if state.free is not None:
        writer.put("free", [list(e) for e in state.free])
    return writer


@pytest.mark.parametrize("inodes", [0, 1, 64, 5000])
def test_a_written_checkpoint_decodes_to_its_state(inodes):
    state = sample_state(random.Random(inodes), inodes, free=inodes != 1)
    payload = written(state).finish()
    # Whole, as fsck and older readers decode it: the same map as to_wire(), key for key.
    assert msgpack.unpackb(payload) == msgpack.unpackb(msgpack.packb(state.to_wire()))
    # Streamed, as mount decodes it.
    streamed = decode_streaming(bytes(payload), FIRST_INO)
    assert [r.to_wire() for r in streamed.inodes] == [r.to_wire() for r in state.inodes]
    assert [b.to_wire() for b in streamed.blocks] == [b.to_wire() for b in state.blocks]
    assert (streamed.next_ino, streamed.provisional, streamed.pinned, streamed.free) == \
        (state.next_ino, state.provisional, state.pinned, state.free)


def test_row_arrays_have_five_byte_headers_and_every_other_value_packb_bytes():
    state = sample_state(random.Random(5), 3)
    payload = bytes(written(state).finish())
    assert payload[0] == 0x80 | 6
    for key, rows in (("inodes", state.inodes), ("blocks", state.blocks)):
        at = payload.index(msgpack.packb(key)) + len(msgpack.packb(key))
        assert payload[at:at + 5] == b"\xdd" + len(rows).to_bytes(4, "big")
        packed_rows = b"".join(msgpack.packb(r.to_wire()) for r in rows)
        assert payload[at + 5:at + 5 + len(packed_rows)] == packed_rows
    for key in ("next_ino", "provisional", "pinned"):
        assert msgpack.packb(key) + msgpack.packb(getattr(state, key)) in payload


def test_the_payload_lies_in_a_buffer_the_device_can_write_as_it_is():
    # Device.pwrite_sync's ``source``: page aligned (an mmap), the payload at its
    # start, zeros after it to the end of the last page; read-only for everyone else.
    payload = written(sample_state(random.Random(3), 300)).finish()
    buf = payload.obj
    assert len(buf) % 4096 == 0 and len(buf) >= len(payload) and payload.readonly
    end = -(-len(payload) // 4096) * 4096
    assert buf[len(payload):end].count(0) == end - len(payload)


def test_what_does_not_fit_is_counted_to_its_end_and_never_finished():
    state = sample_state(random.Random(9), 2000)
    whole = written(state).size
    small = written(state, capacity=whole // 3)
    assert small.overflowed and small.size == whole
    with pytest.raises(InternalError, match="overflowed"):
        small.finish()
    exact = written(state, capacity=whole)
    assert not exact.overflowed and len(exact.finish()) == whole


def test_keys_out_of_order_and_stray_rows_are_bugs():
    writer = schema.CheckpointWriter(1 << 20)
    writer.put("next_ino", 17)
    writer.start_rows("inodes")
    writer.put("blocks", [])            # skipping ahead is fine: blocks may be put whole
    with pytest.raises(InternalError, match="out of order"):
        writer.put("pinned", [])
    with pytest.raises(InternalError, match="not a row array"):
        writer.start_rows("free")
    fresh = schema.CheckpointWriter(1 << 20)
    with pytest.raises(InternalError, match="outside a row array"):
        fresh.add_row(schema.BlockRow(b"k" * 16, 0, 1, 1))


def test_a_checkpoint_too_big_for_its_slot_is_no_space_and_the_last_one_stands(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)

    async def main():
        async with running(fs):
            ns = fs.ns
            for i in range(5):
                ino = ns.make(ROOT_INO, b"kept-%d" % i, FILE_MODE, 0, 0)
                fh, _, _ = ns.open(ino, os.O_WRONLY)
                await ns.write(fh, 0, b"x" * 100)
                await ns.release(fh)
        generation = fs.store.generation
        # Far more rows than the slot holds (as a runaway namespace would have).
        capacity = fs.store.checkpoint_capacity()
        huge = sample_state(random.Random(1), capacity // 60, free=False)
        with pytest.raises(NoSpace, match=r"metadata \(\d+ bytes\) exceeds the checkpoint slot"):
            await fs.store.checkpoint(huge)
        assert fs.store.generation == generation

    trio.run(main)
    fs.close()
    fs = open_fs(path)
    names = sorted(fs.ns.tree.inodes[ROOT_INO].entries.names())
    assert names == [b"kept-%d" % i for i in range(5)]
    close_and_check(fs)


FILES = 3000


def test_a_checkpoint_never_holds_its_rows_all_at_once(tmp_path):
    """Python memory a checkpoint takes at its peak, per file: the cuts' table copies,
    not a row object, its wire list and its packed bytes for every file. Measured:
    214 bytes a file, against 911 before kvfs/schema/writer.py."""
    fs = open_fs(mkfs(tmp_path))

    async def main():
        async with running(fs):
            ns = fs.ns
            await fill_files(ns, FILES)
            await ns.flush_all()
            await ns.checkpoint()           # everything sealed and recorded: the next one is all rows
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                await ns.checkpoint()
                peak = tracemalloc.get_traced_memory()[1] - before
            finally:
                tracemalloc.stop()
            return peak

    peak = trio.run(main)
    assert len(fs.index.entries) >= FILES
    assert peak < 400 * FILES, f"a checkpoint of {FILES} files took {peak} bytes at its peak"
    close_and_check(fs)
