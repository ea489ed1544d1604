"""kvfs.schema.stream: a checkpoint whose inode rows decode as mount consumes them.

The streamed state must be the state ``from_wire`` gives for the same payload,
row for row, and refuse what it refuses; its rows can be read once only.
"""
import msgpack
import pytest

from kvfs import schema
from kvfs.errors import FormatError
from kvfs.schema.stream import InodeRowStream, decode_streaming

KEY = bytes(range(16))


def wire(rows=3):
    inodes = [[1, 0o040755, 0, 0, 2, 0, 5, 5, 5, [1, [[b"f%d" % i, 16 + i] for i in range(rows)]]]]
    inodes += [[16 + i, 0o100644, 1000, 1000, 1, 0, 7, 8, 8, [4096, [KEY]]] for i in range(rows)]
    return {"next_ino": 16 + rows, "inodes": inodes, "blocks": [[KEY, 1 << 20, 4096, rows]],
            "free": [[2 << 20, 4096]], "provisional": [], "pinned": [16]}


def whole(payload):
    return schema.CheckpointState.from_wire(msgpack.unpackb(payload, strict_map_key=False), 16)


def test_a_streamed_state_is_the_whole_decode_row_for_row():
    payload = msgpack.packb(wire())
    state = decode_streaming(payload, 16, block_size=4096)
    assert isinstance(state.inodes, InodeRowStream)
    expect = whole(payload)
    rows = list(state.inodes)
    assert rows == expect.inodes
    assert (state.next_ino, state.blocks, state.free, state.pinned) == \
        (expect.next_ino, expect.blocks, expect.free, expect.pinned)
    with pytest.raises(RuntimeError, match="only once"):
        list(state.inodes)


def test_key_order_does_not_matter():
    w = wire()
    reordered = {k: w[k] for k in ("blocks", "pinned", "inodes", "free", "next_ino", "provisional")}
    assert list(decode_streaming(msgpack.packb(reordered), 16).inodes) == whole(msgpack.packb(w)).inodes


@pytest.mark.parametrize("bad_row", [7, [16, 0o100644], [16, 0o100644, 0, 0, 1, 0, 7, 8, 8, [4096, [b"short"]]]],
                         ids=["not-a-row", "too-short", "bad-key"])
def test_a_bad_row_late_in_the_array_is_refused_when_reached(bad_row):
    w = wire(5)
    w["inodes"].append(bad_row)
    payload = msgpack.packb(w)
    with pytest.raises(FormatError):
        whole(payload)
    rows = _one_row_a_list(decode_streaming(payload, 16).inodes)
    for _ in range(6):
        next(rows)                                  # the good rows come first
    with pytest.raises(FormatError):
        next(rows)
    fields = decode_streaming(payload, 16).inodes.fields()
    assert next(fields)[0] == 1                     # the root: a directory comes alone
    with pytest.raises(FormatError):                # the files come in one list: refused with it
        next(fields)


def _one_row_a_list(stream):
    """The rows' fields, each list of the stream a row long, so a refusal comes when its row is reached."""
    return (fields for rows, _ in stream.batches(size=1) for fields in rows)


def test_what_is_not_a_plain_map_is_left_to_the_whole_decode():
    assert decode_streaming(msgpack.packb([1, 2]), 16) is None
    assert decode_streaming(b"", 16) is None
    w = wire()
    w["inodes"] = 5                                 # not an array: from_wire says what is wrong
    with pytest.raises(FormatError, match="malformed"):
        decode_streaming(msgpack.packb(w), 16)


def test_trailing_bytes_and_truncation_are_refused():
    payload = msgpack.packb(wire())
    with pytest.raises(FormatError, match="extra data"):
        decode_streaming(payload + b"\xc0", 16)
    with pytest.raises(FormatError, match="does not decode"):
        decode_streaming(payload[:-3], 16)


OTHER = bytes(range(1, 17))


@pytest.mark.parametrize("bad_block", [7, [KEY, 1 << 20], [b"short", 1 << 20, 4096, 1], [KEY, -1, 4096, 1],
                                       [bytes(16), 1 << 20, 4096, 1, 0, 9],
                                       # five fields (a dedup domain: every block of a format-2 store)
                                       # (a key the state does not hold already: that alone refuses)
                                       [OTHER, 1 << 20, 4096, 1, -5], [OTHER, 1 << 20, 4096, 1, "dom"],
                                       [OTHER, 1 << 20, 4096, 1, 1.5], [b"short", 1 << 20, 4096, 1, 7],
                                       [OTHER, 1 << 20, 0, 1, 7], [OTHER, 1 << 20, 4096, -1, 7]],
                         ids=["not-a-row", "too-short", "bad-key", "bad-offset", "too-long",
                              "negative-domain", "text-domain", "float-domain", "bad-key-with-domain",
                              "empty-with-domain", "negative-refs-with-domain"])
def test_block_rows_decoded_one_by_one_are_refused_as_the_whole_decode_refuses(bad_block):
    w = wire()
    w["blocks"].append(bad_block)
    payload = msgpack.packb(w)
    with pytest.raises(FormatError) as whole_error:
        whole(payload)
    with pytest.raises(FormatError) as streamed_error:
        decode_streaming(payload, 16)
    assert type(whole_error.value) is type(streamed_error.value)


def test_a_block_key_twice_is_refused_and_good_blocks_are_the_whole_decode():
    w = wire()
    w["blocks"].append([bytes(16), 3 << 20, 100, 1, 5])
    payload = msgpack.packb(w)
    state = decode_streaming(payload, 16)
    assert isinstance(state.blocks, list) and state.blocks == whole(payload).blocks
    assert state.blocks[1] == schema.BlockRow(bytes(16), 3 << 20, 100, 1, 5)
    w["blocks"].append(list(w["blocks"][0]))
    with pytest.raises(FormatError, match="twice"):
        decode_streaming(msgpack.packb(w), 16)


def test_the_field_lists_are_the_rows_in_wire_order():
    payload = msgpack.packb(wire())
    fields = list(decode_streaming(payload, 16).inodes.fields())
    assert [schema.InodeRow(*f) for f in fields] == whole(payload).inodes
    assert all(type(f) is list and len(f) == 10 for f in fields)


@pytest.mark.parametrize("size, keys, refused", [(0, [KEY], True), (4096, [KEY], False), (4097, [KEY, KEY], False),
                                                 (4096, [KEY, None], True), (0, [], False), (1, [KEY], False),
                                                 (0, [None], True), (8193, [KEY, None, KEY], False),
                                                 (8192, [KEY, None, KEY], True)])
def test_a_file_naming_more_blocks_than_its_size_fills_is_refused_when_reached(size, keys, refused):
    w = wire(2)
    w["inodes"][2][9] = [size, keys]
    rows = _one_row_a_list(decode_streaming(msgpack.packb(w), 16, block_size=4096).inodes)
    next(rows), next(rows)
    if refused:
        with pytest.raises(FormatError, match=f"inode 17 names {len(keys)} blocks, more than its {size} bytes"):
            next(rows)
    else:
        assert next(rows)[9] == [size, keys]
    assert list(decode_streaming(msgpack.packb(w), 16).inodes)[2].payload == [size, keys]   # no block size: not checked
