"""Fuzzed decoding of the on-disk format (issue 12, "Hostile and damaged input").

Four targets, each with hypothesis (profiles and counting: tests/unit/fuzzing.py):

(a) superblock sectors: random bytes, and mkfs's sector with fields set to random
    values and re-encoded (so the checksum passes and the layout checks run);
(b) journal frames: random headers, mkfs+stack frames with mutated headers and
    payloads, and correctly checksummed frames whose payload is msgpack of random
    structures or of well-typed but hostile records (replay is reached);
(c) checkpoints: random headers, and correctly checksummed payloads that are random
    maps or the real state with hostile edits (wrong types, negative and huge numbers,
    overlapping extents, dangling entries, cycles, duplicate inode numbers);
(d) whole images: a store made by the real mkfs and written through the real stack,
    with random bytes and regions of its metadata (and data) damaged.

Every case must end in a clean load or a KvfsError with a one-line message, within a
deadline; whatever loads is walked, and a file that kept its name reads back its
original bytes or fails with an EIO-class error. Base images are made by mkfs and
the real stack, never by hand, and fields are found by name (schema.field_layout),
so the fuzzers follow format changes.

The base image is the ``image`` fixture (tests/unit/conftest.py); the hostile
checkpoint states and their writes are in tests/unit/helpers.py, shared with
tests/unit/test_child_check.py.

CI runs the short profile; the long run is
``KVFS_FUZZ=long KVFS_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q -s tests/unit/test_fuzz_format.py``.
"""
import struct

import msgpack
import pytest
import trio
import xxhash
from hypothesis import example, given, strategies as st

from kvfs import schema
from kvfs.server import fsck
from kvfs.device import Device
from kvfs.errors import FormatError
from kvfs.namespace import ROOT_INO
from kvfs.server.stack import load_tree

from .fuzzing import FUZZ, attempt, check_everything, count_case
from .helpers import (BS, KEYS, S, hostile_state, hostile_writes, loaded_state, lookup_path, modes, msgpack_values,
                      open_fs, read_all, real_wire, running, write_checkpoint)

SB_LAYOUT = schema.field_layout(schema.SUPERBLOCK, schema.Superblock.FIELDS)
FRAME_LAYOUT = schema.field_layout(schema.JOURNAL_FRAME, schema.JOURNAL_FRAME_FIELDS)
# Damaged blocks are reported as they are found: that is the behaviour under test.
pytestmark = pytest.mark.expect_errors(r"kvfs\.blockindex: block \w+ at device offset \d+ fails its checksum",
                                       r"names blocks missing from the index")
CKPT_LAYOUT = schema.field_layout(schema.CHECKPOINT_HEADER, schema.CHECKPOINT_HEADER_FIELDS)


# -- (a) superblock -------------------------------------------------------------------

def _sb_invariants(sb):
    assert sb.version in schema.READABLE_VERSIONS and sb.sector == S
    regions = [(sb.checkpoint_a_off, sb.checkpoint_len), (sb.checkpoint_b_off, sb.checkpoint_len),
               (sb.journal_off, sb.journal_len), (sb.data_off, sb.data_len)]
    end = 2 * S
    for off, n in regions:
        assert off >= end and off % S == 0 and n % S == 0
        end = off + n
    assert end <= sb.device_size


def decode_superblock(sector):
    sb = schema.Superblock.decode(sector)
    _sb_invariants(sb)
    return sb


@FUZZ
@given(st.binary(max_size=2 * S))
@example(b"")
@example(schema.MAGIC_SUPERBLOCK + bytes(S - 8))
def test_superblock_random_bytes(data):
    count_case("superblock-bytes")
    attempt("superblock-bytes", "decode", decode_superblock, data)


def _int_values(size):
    top = (1 << (8 * size)) - 1
    return st.one_of(st.integers(0, top), st.sampled_from([0, 1, S - 1, S, S + 1, 64 << 20, top, top // 2]))


def _field_value(size, name):
    if name in ("magic", "uuid"):
        return st.binary(min_size=size, max_size=size)
    return _int_values(size)


def reencoded_superblock(base, changes):
    """mkfs's superblock with fields replaced, re-encoded by the schema (checksum included)."""
    values = dict(zip(schema.Superblock.FIELDS, schema.SUPERBLOCK.unpack_from(base)))
    values.update(changes)
    return schema.Superblock(**values).encode()


@st.composite
def superblock_changes(draw):
    picked = draw(st.lists(st.sampled_from(SB_LAYOUT), min_size=1, max_size=4, unique=True))
    return {name: draw(_field_value(size, name)) for _, size, name in picked}


@FUZZ
@given(superblock_changes())
@example({"version": schema.FORMAT_VERSION + 1})
@example({"checkpoint_len": S})             # a slot that cannot hold its own header
@example({"journal_len": 0})
@example({"data_len": 0, "device_size": (1 << 64) - 1})
@example({"block_size": 2 * BS})           # found: files read with the wrong block boundaries
def test_superblock_field_mutations(image, changes):
    """Valid-checksum superblocks with hostile fields: decode, then the whole loader and fsck."""
    count_case("superblock-fields")
    base = image.read(0, S)
    try:
        sector = reencoded_superblock(base, changes)
    except struct.error:
        return
    sb = attempt("superblock-fields", "decode", decode_superblock, sector)
    if sb is None:
        return
    with image.damaged([(0, sector + sector)]):
        check_everything("superblock-fields", image)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, schema.SUPERBLOCK.size - 1), st.integers(0, 255)),
                min_size=1, max_size=8))
def test_superblock_byte_mutations_rechecksummed(image, pokes):
    count_case("superblock-bytes-rechecksummed")
    body = bytearray(image.read(0, S))
    for off, value in pokes:
        body[off] = value
    sector = reencoded_superblock(bytes(body), {})
    sb = attempt("superblock-bytes-rechecksummed", "decode", decode_superblock, sector)
    if sb is not None:
        with image.damaged([(0, sector)]):
            check_everything("superblock-bytes-rechecksummed", image)


# -- (b) journal frames ------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=2 * S), st.integers(0, (1 << 64) - 1))
def test_journal_header_random_bytes(data, seed):
    count_case("journal-header-bytes")
    got = attempt("journal-header-bytes", "decode", schema.decode_journal_header, data, seed)
    assert got is None or (len(got) == 4 and all(isinstance(v, int) for v in got))


def rehashed(header, layout, seed):
    """Recompute the header_hash field (the last one, over every byte before it)."""
    off, size, name = layout[-1]
    assert name == "header_hash"
    head = bytes(header[:off])
    return head + xxhash.xxh64_intdigest(head, seed).to_bytes(size, "little") + bytes(header[off + size:])


def frame_at(img, cursor):
    head = img.read(img.sb.journal_off + cursor, S)
    return schema.decode_journal_header(head, img.sb.hash_seed)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 2 * S - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.booleans(), st.sampled_from(["first", "last"]))
def test_journal_frame_mutations(image, pokes, rehash, which):
    """A committed frame of the image with bytes changed (header re-hashed or not)."""
    count_case("journal-frames")
    state = loaded_state(image)
    cursor = 0 if which == "first" else state.journal_cursor - schema.frame_size(
        _last_frame_len(image, state))
    frame = bytearray(image.read(image.sb.journal_off + cursor, 2 * S))
    for off, value in pokes:
        frame[off] = value
    if rehash:
        frame = bytearray(rehashed(frame, FRAME_LAYOUT, image.sb.hash_seed))
    with image.damaged([(image.sb.journal_off + cursor, bytes(frame))]):
        check_everything("journal-frames", image)


def _last_frame_len(img, state):
    cursor, length = 0, 0
    for _ in range(state.frame_seq):
        length = frame_at(img, cursor)[2]
        cursor += schema.frame_size(length)
    return length


def small_ints():
    return st.one_of(st.integers(0, 40), st.sampled_from([-1, 1 << 63, (1 << 64) - 1, ROOT_INO]))


names = st.one_of(st.sampled_from([b"a", b"sub", b".", b"..", b"", b"x/y", b"n\0", b"n" * 256, b"new"]),
                  st.binary(max_size=8))


@st.composite
def hostile_record(draw):
    """A record of a real tag, with fields of the right count and mostly the right types."""
    cls = draw(st.sampled_from(schema.RECORD_TYPES))
    fields = []
    for f in schema.records.dataclasses.fields(cls):
        if f.name == "blocks":
            blocks = draw(st.lists(st.none() | st.tuples(st.binary(min_size=16, max_size=16) | msgpack_values,
                                                         small_ints() | st.integers(0, 1 << 40),
                                                         small_ints() | st.just(BS)).map(list), max_size=4))
            fields.append(blocks)
        elif "name" in f.name:
            fields.append(draw(names))
        elif f.name == "mode":
            fields.append(draw(modes))
        elif f.name == "target":
            fields.append(draw(st.none() | st.binary(max_size=10)))
        else:
            fields.append(draw(small_ints() | msgpack_values))
    return [cls.TAG, *fields]


journal_payloads = st.one_of(
    msgpack_values,
    st.lists(st.one_of(hostile_record(), msgpack_values), max_size=6),
    st.lists(hostile_record(), min_size=1, max_size=8))


@FUZZ
@given(journal_payloads, st.booleans())
@example(["not", "a", "record"], True)
@example([["mv", ROOT_INO, b"sub", 17, b"x", 0]], True)          # a directory into itself
@example([["ln", ROOT_INO, ROOT_INO, b"rootlink", 0]], True)     # a hard link to the root
@example([["mk", ROOT_INO, b"n", ROOT_INO, 0o100644, 0, 0, 0, 0, None]], True)   # re-make the root
@example([["mk", 0, b"a", 1, 0o120777, 0, 0, 0, 0, b""]], False)   # found: replaced the root by a symlink
@example([[["unhashable"], 1]], True)                               # found: TypeError on the tag lookup
@example({"not": "a list"}, True)
def test_journal_payload_structures(image, payload, append):
    """Correctly checksummed frames (right generation and sequence) of random msgpack."""
    count_case("journal-payloads")
    state = loaded_state(image)
    try:
        data = msgpack.packb(payload)
    except (OverflowError, ValueError, TypeError):
        return
    cursor, seq = (state.journal_cursor, state.frame_seq) if append else (0, 0)
    frame = schema.encode_journal_frame(state.generation, seq, data, image.sb.hash_seed)
    if cursor + len(frame) + S > image.sb.journal_len:
        return
    with image.damaged([(image.sb.journal_off + cursor, frame + bytes(S))]):
        image_files, image.files = image.files, {}      # crafted records may change any file
        try:
            check_everything("journal-payloads", image)
        finally:
            image.files = image_files


# -- (c) checkpoints ---------------------------------------------------------------------

@FUZZ
@given(st.binary(min_size=S, max_size=S), st.integers(0, (1 << 64) - 1), st.integers(0, 1 << 40))
def test_checkpoint_header_random_bytes(data, seed, slot_len):
    count_case("checkpoint-header-bytes")
    got = attempt("checkpoint-header-bytes", "decode", schema.decode_checkpoint_header, data, slot_len, seed)
    assert got is None or (got[1] <= slot_len - S)


def run_checkpoint_case(img, target, wire):
    count_case(target)
    writes = hostile_writes(img, wire)
    if writes is None:
        return
    attempt(target, "from_wire", schema.CheckpointState.from_wire, wire, 16)
    with img.damaged(writes):
        image_files, img.files = img.files, {}
        try:
            attempt(target, "load_tree", _load_tree, img)
            check_everything(target, img)
        finally:
            img.files = image_files


def _load_tree(img):
    device = Device.open(img.path, readonly=True)
    try:
        load_tree(device, salvage=True)
    finally:
        device.close()


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), msgpack_values, max_size=7))
@example({"inodes": [[1]]})
@example({"inodes": [[1, 0o40755, 0, 0, 2, 0, 0, 0, 0, None]]})
@example({"free": [[-4096, 8192]]})
@example({"next_ino": "x"})
def test_checkpoint_random_maps(image, wire):
    run_checkpoint_case(image, "checkpoint-maps", wire)


@pytest.fixture(scope="module")
def base_wire(image):
    return real_wire(image)


@FUZZ
@given(data=st.data())
def test_checkpoint_hostile_states(image, base_wire, data):
    wire = data.draw(hostile_state(base_wire))
    run_checkpoint_case(image, "checkpoint-states", wire)


# -- (d) whole images --------------------------------------------------------------------

@st.composite
def damage(draw, img):
    """Writes that damage the metadata area (mostly where bytes are), or sometimes data blocks."""
    sb = img.sb
    used = loaded_state(img)
    hot = [(0, 2 * S), (sb.checkpoint_a_off, 2 * S), (sb.checkpoint_b_off, 2 * S),
           (sb.journal_off, max(S, used.journal_cursor))]
    writes = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "bytes", "zero-sector", "data"]))
        base, span = draw(st.sampled_from(hot))
        if kind == "data":
            base, span = sb.data_off, 8 * BS
        off = base + draw(st.integers(0, span - 1))
        if kind == "flip":
            writes.append((off, bytes([img.read(off, 1)[0] ^ (1 << draw(st.integers(0, 7)))])))
        elif kind == "bytes":
            writes.append((off, draw(st.binary(min_size=1, max_size=64))))
        else:
            off -= off % S
            writes.append((off, bytes(S * draw(st.integers(1, 3)))))
    return writes


@FUZZ
@given(data=st.data())
def test_damaged_images(image, data):
    count_case("images")
    writes = data.draw(damage(image))
    with image.damaged(writes):
        check_everything("images", image)


def test_base_image_is_sound(image):
    """The images the fuzzers damage load and check clean, with every file as written."""
    report = fsck.check(image.path)
    assert report.clean, report.problems
    fs = open_fs(image.path, readonly=True)
    try:
        trio.run(_assert_files, fs, image.files)
    finally:
        fs.close()
    with pytest.raises(FormatError):
        decode_superblock(bytes(S))


async def _assert_files(fs, files):
    async with running(fs, persist=False):
        for path, data in files.items():
            ino = lookup_path(fs.ns, path.decode())
            assert ino is not None, path
            assert await read_all(fs.ns, ino) == data, path


# -- regressions: what the fuzzers found, as plain tests ------------------------------------

def _state_with(img, edit):
    wire = real_wire(img)
    edit(wire)
    return wire


def test_directory_cycle_is_refused_at_mount_not_a_hang(image):
    """Found: a directory whose parent chain loops made rename's ancestor walk spin forever."""
    def cycle(wire):
        sub = next(r for r in wire["inodes"] if r[0] != ROOT_INO and r[1] & 0o170000 == 0o040000)
        sub[9][1].append([b"loop", ROOT_INO])
    state = loaded_state(image)
    with image.damaged(write_checkpoint(image, state, _state_with(image, cycle))):
        with pytest.raises(FormatError, match="namespace is inconsistent.*run fsck.kvfs --repair"):
            open_fs(image.path, readonly=True).close()
        report = fsck.check(image.path)
        assert not report.clean


def test_overlapping_block_extents_are_refused_at_mount(image):
    def overlap(wire):
        wire["blocks"][1][1] = wire["blocks"][0][1]
    state = loaded_state(image)
    with image.damaged(write_checkpoint(image, state, _state_with(image, overlap))):
        with pytest.raises(FormatError, match="overlaps"):
            open_fs(image.path, readonly=True).close()


def test_record_of_a_wrong_type_is_a_format_error():
    with pytest.raises(FormatError, match="name is invalid"):
        schema.decode_record(["mk", ROOT_INO, b"..", 16, 0o100644, 0, 0, 0, 0, None])
    with pytest.raises(FormatError, match="unknown journal record"):
        schema.decode_record([[1], 2])
    with pytest.raises(FormatError, match="block length is invalid"):
        schema.decode_record(["ct", 16, 1, 0, 0, [[bytes(16), 0, -5]]])


def test_superblock_with_an_empty_journal_is_refused_by_the_loader(image):
    sector = reencoded_superblock(image.read(0, S), {"journal_len": 0})
    schema.Superblock.decode(sector)                   # the decoder's own checks pass
    with image.damaged([(0, sector + sector)]):
        with pytest.raises(FormatError, match="regions are too small"):
            open_fs(image.path, readonly=True).close()


def test_a_changed_block_size_is_refused_not_served_with_wrong_boundaries(image):
    """Found by the long fuzz run: a re-checksummed superblock saying 128 KiB blocks (the
    store has 64 KiB ones) loaded, and multi-block files read back shifted bytes."""
    sector = reencoded_superblock(image.read(0, S), {"block_size": 2 * BS})
    with image.damaged([(0, sector + sector)]):
        with pytest.raises(FormatError, match="names 4 blocks, more than its 196731 bytes fill"):
            open_fs(image.path, readonly=True).close()


def test_missing_committed_journal_frame_is_refused(image):
    """Found by tests/test_damaged_device.py: a zeroed first frame header silently dropped the
    frames after it (fsynced files). The loader looks for a committed successor and refuses."""
    state = loaded_state(image)
    assert state.frame_seq >= 2, "the base image needs two frames after its checkpoint"
    with image.damaged([(image.sb.journal_off, bytes(S))]):
        with pytest.raises(FormatError, match="journal frame 0 of generation .* is gone"):
            open_fs(image.path, readonly=True).close()
        report = fsck.check(image.path)
        assert any("is gone" in p for p in report.problems), report.problems
