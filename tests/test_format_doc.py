"""docs/format.md and the format's code agree: the header tables and the checkpoint state.

The journal records' table is checked in tests/unit/test_schema.py. A table row is
``| offset | size | `field` | meaning |``; rows without a field name (the checksum,
padding) are layout the struct does not name.
"""
import dataclasses
import re
from pathlib import Path

from kvfs import schema

DOC = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()


def section(heading):
    start = DOC.index(f"\n{heading}\n")
    rest = DOC[start + len(heading) + 2:]
    end = re.search(r"\n#{2,3} ", rest)
    return rest[:end.start()] if end else rest


def field_rows(text):
    """[(offset, size, name)] from the first Offset|Size|Field table of ``text``."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*`(\w+)`\s*\|", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), m.group(3)))
        elif rows and not line.startswith("|"):
            break
    return rows


def test_header_tables_match_the_structs():
    cases = [("## Superblock", schema.SUPERBLOCK, schema.Superblock.FIELDS),
             ("## Checkpoints", schema.CHECKPOINT_HEADER, schema.CHECKPOINT_HEADER_FIELDS),
             ("## Journal", schema.JOURNAL_FRAME, schema.JOURNAL_FRAME_FIELDS),
             ("## Multi-mount protection", schema.MMP_RECORD, schema.MMP_RECORD_FIELDS)]
    for heading, layout, names in cases:
        documented = field_rows(section(heading))
        assert documented == schema.field_layout(layout, names), heading


def test_checkpoint_state_keys_and_rows_match_the_schema():
    text = section("### Checkpoint payload")
    keys = re.findall(r"^\|\s*`(\w+)`\s*\|", text, re.MULTILINE)
    assert keys == [f.name for f in dataclasses.fields(schema.CheckpointState)]
    rows = re.search(r"`\[(ino, [^\]]*)\]`", text).group(1).split(", ")
    assert rows == [f.name for f in dataclasses.fields(schema.InodeRow)]
    blocks = re.search(r"`\[\[(key, off, [^\]]*)\], \.\.\.\]`", text).group(1).split(", ")
    assert blocks == [f.name for f in dataclasses.fields(schema.BlockRow)]
    # And the wire form really is those keys, in a map.
    state = schema.CheckpointState(next_ino=16, inodes=[], blocks=[], free=[], provisional=[])
    assert list(state.to_wire()) == keys


def test_format_version_is_documented():
    assert f"format version, `{schema.FORMAT_VERSION}`" in section("## Superblock")
