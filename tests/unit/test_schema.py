"""kvfs.schema.records: the journal records and the checkpoint state as named types.

Every record type round-trips through its wire form (and through msgpack, as on
the device); ``decode_record`` refuses what is not a record; the checkpoint
state round-trips, with and without a free map; and docs/format.md's "Journal
records" table names exactly the fields, in exactly the order, that the code
writes (issue 8: the format doc is checked against the code).
"""
import dataclasses
import pathlib
import re
import stat

import msgpack
import pytest

from kvfs import schema
from kvfs.errors import FormatError
from kvfs.schema import (RECORD_TYPES, Attrs, BlockRef, BlockRow, CheckpointState, Content, InodeRow, Link,
                         Make, Move, Remove, decode_record)
from kvfs.store.loader import FIRST_INO

FORMAT_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "format.md"

KEY_A, KEY_B = bytes(range(16)), bytes(range(16, 32))
T = 1_700_000_000_123_456_789

# One record of each type, every field distinct from its neighbours so a swap shows.
SAMPLES = {
    "mk-file": Make(parent=1, name=b"chunk-0001.kv", ino=17, mode=stat.S_IFREG | 0o640, uid=1000, gid=1001,
                    rdev=0, ns=T, target=None),
    "mk-symlink": Make(parent=16, name=b"latest", ino=18, mode=stat.S_IFLNK | 0o777, uid=0, gid=0, rdev=0,
                       ns=T + 1, target=b"chunk-0001.kv"),
    "mk-chardev": Make(parent=1, name=b"null", ino=19, mode=stat.S_IFCHR | 0o666, uid=0, gid=0,
                       rdev=(1 << 8) | 3, ns=T + 2, target=None),
    "ln": Link(ino=17, parent=16, name=b"alias", ns=T + 3),
    "rm": Remove(parent=16, name=b"alias", ns=T + 4),
    "mv": Move(old_parent=1, old_name=b"tmp.123", new_parent=16, new_name=b"final", ns=T + 5),
    "at": Attrs(ino=17, mode=stat.S_IFREG | 0o600, uid=2000, gid=2001, atime=T + 6, mtime=T + 7, ctime=T + 8),
    "ct": Content(ino=17, size=3 * 65536 + 5, mtime=T + 9, ctime=T + 10,
                  blocks=(BlockRef(KEY_A, 1 << 20, 65536), None,
                          BlockRef(KEY_B, (1 << 20) + 65536, 65536), BlockRef(KEY_A, 1 << 20, 65536))),
    "ct-empty": Content(ino=20, size=0, mtime=T + 11, ctime=T + 12, blocks=()),
}


def _wire_value(value):
    """What a field value looks like on the wire (a block list: lists of [key, off, length] or nil)."""
    if isinstance(value, tuple):
        return [None if b is None else [b.key, b.off, b.length] for b in value]
    return value


def test_every_record_type_has_a_sample_and_a_unique_tag():
    assert {type(r) for r in SAMPLES.values()} == set(RECORD_TYPES)
    tags = [cls.TAG for cls in RECORD_TYPES]
    assert len(set(tags)) == len(tags) == 6


@pytest.mark.parametrize("record", SAMPLES.values(), ids=SAMPLES.keys())
def test_record_round_trips_through_its_wire_form(record):
    wire = record.to_wire()
    assert isinstance(wire, list) and wire[0] == type(record).TAG
    assert len(wire) == 1 + len(dataclasses.fields(record))
    back = decode_record(wire)
    assert type(back) is type(record) and back == record


@pytest.mark.parametrize("record", SAMPLES.values(), ids=SAMPLES.keys())
def test_record_round_trips_through_msgpack(record):
    """As in a journal frame: a list of records, packed and unpacked the way the store and loader do."""
    payload = msgpack.packb([record.to_wire(), record.to_wire()])
    back = [decode_record(w) for w in msgpack.unpackb(payload, strict_map_key=False)]
    assert back == [record, record]
    assert all(type(b) is type(record) for b in back)
    if isinstance(record, Content):
        assert isinstance(back[0].blocks, tuple)
        assert all(b is None or isinstance(b, BlockRef) for b in back[0].blocks)


def test_records_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLES["ln"].ino = 99


@pytest.mark.parametrize("wire", [["zz", 1, 2], ["MK", 1, b"x", 17, 0o100644, 0, 0, 0, T, None], [None], [17]],
                         ids=["unknown", "wrong-case", "nil-tag", "int-tag"])
def test_decode_record_rejects_an_unknown_tag(wire):
    with pytest.raises(FormatError, match="unknown journal record"):
        decode_record(wire)


@pytest.mark.parametrize("record", SAMPLES.values(), ids=SAMPLES.keys())
def test_decode_record_rejects_a_wrong_field_count(record):
    wire = record.to_wire()
    n = len(dataclasses.fields(record))
    with pytest.raises(FormatError, match=f"has {n - 1} fields, expected {n}"):
        decode_record(wire[:-1])
    with pytest.raises(FormatError, match=f"has {n + 1} fields, expected {n}"):
        decode_record(wire + [0])
    with pytest.raises(FormatError, match=f"has 0 fields, expected {n}"):
        decode_record(wire[:1])


@pytest.mark.parametrize("wire", [{"mk": 1}, 17, b"mk", "mk", None, [], ()],
                         ids=["map", "int", "bytes", "str", "nil", "empty-list", "empty-tuple"])
def test_decode_record_rejects_a_non_list(wire):
    with pytest.raises(FormatError, match="not a list"):
        decode_record(wire)


@pytest.mark.parametrize("blocks", [5, [[KEY_A, 0]], [[KEY_A, 0, 1, 2, 3]], [7]], ids=["int", "short-ref", "long-ref",
                                                                                  "int-ref"])
def test_decode_record_rejects_a_malformed_block_list(blocks):
    with pytest.raises(FormatError, match="malformed"):
        decode_record(["ct", 17, 5, T, T, blocks])


# -- docs/format.md's "Journal records" table --------------------------------------

def journal_table():
    """(header, rows) of the table under "### Journal records"; cells split as GitHub
    markdown splits them: at every pipe not escaped as ``\\|``, code spans included."""
    text = FORMAT_MD.read_text()
    section = text.split("### Journal records", 1)[1]
    section = re.split(r"\n#{1,3} ", section, maxsplit=1)[0]
    header, rows = None, []
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):      # not the |---|---| line
            rows.append(cells)
    assert header is not None and header == ["Record", "Fields", "Effect"], header
    return header, rows


def documented_records():
    """{tag: (field names, the rest of the row's text)}."""
    _, rows = journal_table()
    out = {}
    for cells in rows:
        tag = cells[0].strip("`")
        fields = [f.strip() for f in cells[1].strip("`").split(",")]
        out[tag] = (fields, " | ".join(cells[2:]))
    return out


def test_the_doc_table_lists_every_record_type_and_nothing_else():
    assert sorted(documented_records()) == sorted(cls.TAG for cls in RECORD_TYPES)


@pytest.mark.parametrize("cls", RECORD_TYPES, ids=[c.TAG for c in RECORD_TYPES])
def test_the_doc_table_names_each_records_fields_in_wire_order(cls):
    fields, _ = documented_records()[cls.TAG]
    assert fields == [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("record", SAMPLES.values(), ids=SAMPLES.keys())
def test_wire_form_is_the_documented_positional_list(record):
    """A record on the wire is [tag, then the documented fields in the documented order]."""
    fields, _ = documented_records()[type(record).TAG]
    expected = [type(record).TAG, *(_wire_value(getattr(record, name)) for name in fields)]
    assert record.to_wire() == expected
    # And what a reader of the doc would decode from such a list is the record itself.
    assert decode_record(msgpack.unpackb(msgpack.packb(expected))) == record


def test_every_doc_table_row_has_exactly_the_headers_cells():
    header, rows = journal_table()
    for cells in rows:
        assert len(cells) == len(header), cells


def test_the_doc_describes_a_content_block_as_key_off_length():
    _, effect = documented_records()[Content.TAG]
    found = re.search(r"\[\[([a-z_, ]+)\] \| nil", effect)
    assert found, effect
    assert [f.strip() for f in found.group(1).split(",")] == [f.name for f in dataclasses.fields(BlockRef)]


# -- the checkpoint state -------------------------------------------------------------

def sample_state():
    """A state like one the store writes; payloads in their wire shapes (lists), as they load."""
    dir_mode, file_mode = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644
    return CheckpointState(
        next_ino=21,
        inodes=[
            InodeRow(1, dir_mode, 0, 0, 3, 0, T, T + 1, T + 2, [1, [[b"d", 16], [b"f", 17]]]),
            InodeRow(16, dir_mode, 1000, 1000, 2, 0, T + 3, T + 4, T + 5, [1, [[b"link", 18]]]),
            InodeRow(17, file_mode, 1000, 1000, 1, 0, T + 6, T + 7, T + 8, [3 * 65536 + 5, [KEY_A, None, KEY_B]]),
            InodeRow(18, stat.S_IFLNK | 0o777, 1000, 1000, 1, 0, T + 9, T + 9, T + 9, b"../f"),
            InodeRow(19, stat.S_IFIFO | 0o600, 0, 0, 1, 0, T, T, T, None),
            InodeRow(20, file_mode, 0, 0, 1, 0, T, T, T, [0, []]),
        ],
        blocks=[BlockRow(KEY_A, 1 << 20, 65536, 1), BlockRow(KEY_B, (1 << 20) + 65536, 5, 2)],
        free=[((1 << 20) + 2 * 65536, 1 << 20), (3 << 20, 4096)],
        provisional=[20],
        pinned=[17],
    )


def test_inode_row_accessors_name_the_payload_parts():
    rows = {row.ino: row for row in sample_state().inodes}
    assert rows[16].parent == 1 and rows[16].entries == [[b"link", 18]]
    assert rows[17].size == 3 * 65536 + 5 and rows[17].keys == [KEY_A, None, KEY_B]
    assert rows[18].payload == b"../f"


@pytest.mark.parametrize("through_msgpack", [False, True], ids=["direct", "msgpack"])
def test_checkpoint_state_round_trips(through_msgpack):
    state = sample_state()
    wire = state.to_wire()
    assert isinstance(wire, dict)
    assert set(wire) == {f.name for f in dataclasses.fields(CheckpointState)}
    if through_msgpack:
        wire = msgpack.unpackb(msgpack.packb(wire), strict_map_key=False)
    back = CheckpointState.from_wire(wire, FIRST_INO)
    assert back == state
    assert all(isinstance(row, InodeRow) for row in back.inodes)
    assert all(isinstance(row, BlockRow) for row in back.blocks)
    assert all(isinstance(e, tuple) for e in back.free)


def test_mkfs_empty_map_is_a_state_without_free():
    """mkfs writes ``{}``: every key takes its default, and no "free" means all of the data region."""
    state = CheckpointState.from_wire(msgpack.unpackb(msgpack.packb({})), FIRST_INO)
    assert state == CheckpointState(next_ino=FIRST_INO, inodes=[], blocks=[], free=None, provisional=[])


@pytest.mark.parametrize("state", [
    CheckpointState(next_ino=FIRST_INO, inodes=[], blocks=[], free=None, provisional=[]),
    dataclasses.replace(sample_state(), free=None),
], ids=["empty", "populated"])
def test_checkpoint_state_without_free_round_trips(state):
    wire = msgpack.unpackb(msgpack.packb(state.to_wire()), strict_map_key=False)
    assert "free" not in wire or wire["free"] is None          # absent (or nil): all of it is free
    back = CheckpointState.from_wire(wire, FIRST_INO)
    assert back == state and back.free is None


@pytest.mark.parametrize("wire", [[1, 2], b"{}", None, 5], ids=["list", "bytes", "nil", "int"])
def test_checkpoint_state_refuses_a_payload_that_is_not_a_map(wire):
    with pytest.raises(FormatError, match="not a map"):
        CheckpointState.from_wire(wire, FIRST_INO)


@pytest.mark.parametrize("key, bad", [
    ("inodes", [[1, 0o40755, 0, 0, 2]]),                          # a row too short
    ("inodes", [[1, 0o40755, 0, 0, 2, 0, T, T, T, None, "extra"]]),
    ("blocks", [[KEY_A, 0, 4096]]),
    ("inodes", [7]),
], ids=["short-inode", "long-inode", "short-block", "int-inode"])
def test_checkpoint_state_refuses_malformed_rows(key, bad):
    wire = sample_state().to_wire()
    wire[key] = bad
    with pytest.raises(FormatError, match="malformed"):
        CheckpointState.from_wire(wire, FIRST_INO)


def test_schema_exports_the_record_types_and_the_format_version():
    assert schema.FORMAT_VERSION == 2 and schema.READABLE_VERSIONS == (1, 2)
    assert schema.RECORD_TYPES == (Make, Link, Remove, Move, Attrs, Content)


# The mount's fast inode-row check must accept exactly what the field-by-field
# check (the one with the messages) accepts.
def _rows_to_judge():
    valid = [
        InodeRow(1, stat.S_IFDIR | 0o755, 0, 0, 3, 0, T, T, T, [1, [[b"d", 17], [b"f", 18]]]),
        InodeRow(17, stat.S_IFDIR | 0o700, 5, 6, 2, 0, T, T, T, [1, []]),
        InodeRow(18, stat.S_IFREG | 0o640, 1000, 1001, 1, 0, T, T + 1, T + 2, [4096, [KEY_A, None, KEY_B]]),
        InodeRow(19, stat.S_IFLNK | 0o777, 0, 0, 1, 0, -T, T, T, b"target"),
        InodeRow(20, stat.S_IFIFO | 0o600, 0, 0, 1, 0, T, T, T, None),
        InodeRow(21, stat.S_IFCHR | 0o600, 0, 0, 1, (1 << 64) - 1, T, T, T, None),
    ]
    bad_scalars = [None, -1, True, 1 << 64, b"1", "1", 1.0, [1]]
    fields = ["ino", "mode", "uid", "gid", "nlink", "rdev", "atime", "mtime", "ctime"]
    extra = {"ino": [0, 2, 15, 16], "mode": [0o177777 + 1, 0o170000 | 0o644, stat.S_IFREG | 0o644,
                                              stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777],
             "uid": [1 << 32, (1 << 32) - 1], "nlink": [1 << 32], "atime": [1 << 63, -(1 << 63)]}
    payloads = [None, b"", b"x", [], [1], [1, 2], [1, []], [1, [None]], [-1, []], [1 << 63, []],
                [(1 << 63) - 1, [KEY_A]], [4096, [b"short"]], [4096, [KEY_A + b"x"]], [4096, (KEY_A,)],
                [1, [[b"a", 17], [b"a", 18]]], [1, [[b"a/b", 17]]], [1, [[b".", 17]]], [1, [[b"..", 17]]],
                [1, [[b"a\0", 17]]], [1, [[b"x" * 256, 17]]], [1, [[b"x" * 255, 17]]], [1, [[b"a", 3]]],
                [1, [[b"a", 17, 1]]], [1, [b"a"]], [1, [["a", 17]]], [2, []], [16, []], [True, []],
                # several entries, one of them off (the directory check's C-level pass: validate.py)
                [1, [[b"a", 17], [b"b", 18], [b"c/d", 19]]], [1, [[b"a", 17], (b"b", 18)]],
                [1, [[b"a", 17], [b"b", 1]]], [1, [[b"a", 17], [b"b", True]]], [1, [[b"a", 17], [b"", 18]]],
                [1, [[b"a", 17], [b"b", 1 << 64]]], [1, [[b"a", 17], [b"b", 15]]], [1, [[b"a", 17], [b"a", 17]]],
                [1, [[b"a", 17], [b"..", 18]]], [1, [[b"a", 17], [b"b\0", 18]]], [1, [[b"a", 17], [b"b", 18]]],
                (1, ()), "target"]
    for row in valid:
        yield row
        for name in fields:
            for value in bad_scalars + extra.get(name, []):
                yield dataclasses.replace(row, **{name: value})
        for payload in payloads:
            yield dataclasses.replace(row, payload=payload)


def test_the_fast_inode_row_check_agrees_with_the_explaining_one():
    from kvfs.schema import validate
    judged = {True: 0, False: 0}
    for row in _rows_to_judge():
        try:
            validate._explain_inode_row(row)
            explained_ok = True
        except FormatError:
            explained_ok = False
        assert validate._inode_row_is_valid(row) is explained_ok, row
        judged[explained_ok] += 1
        if not explained_ok:
            with pytest.raises(FormatError, match="invalid"):
                validate._inode_row(row)
    assert judged[True] >= 20 and judged[False] >= 200, judged
