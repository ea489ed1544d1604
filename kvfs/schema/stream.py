"""A checkpoint payload whose inode rows are decoded one at a time, as mount consumes them.

``msgpack.unpackb`` of a checkpoint makes every row's objects at once: a list
per row, the payload lists, then an InodeRow per row (about 1 KB a file at
a million files). Most of it dies once the namespace is built, but it dies
interleaved with what survives (names, keys, timestamps), so the allocator
cannot give its pools back: the daemon's memory after a mount was the
decode's peak, about twice what the loaded namespace holds.

:func:`decode_streaming` decodes everything but the ``inodes`` array as
before (it skips over that array without making objects), and returns a
CheckpointState whose ``inodes`` is an :class:`InodeRowStream`: iterated
once, it decodes, validates and yields one InodeRow at a time, so each row's
garbage is reused by the next. The payload bytes stay alive until then.

The ``blocks`` array is decoded whole, as the loader and the index need it
(extents are checked before anything is built), but row by row into
BlockRows: ``unpackb`` made every row's list first, each next to the key
that outlives it, and a million freed lists left 64 MB of half-empty pools.

Refused exactly as :meth:`CheckpointState.from_wire` refuses, with FormatError:
a row that is not a row, a row that fails validation (checked as it is
reached, so a bad row late in the array fails the mount after earlier rows
were built; mount then builds nothing). The same inode twice is left to the
consumer (the namespace checks it as it adds rows). Payloads that are not a
map of the expected shape go through ``from_wire`` whole, for its messages.
"""
import dataclasses
import io
from stat import S_IFREG

import msgpack

from ..errors import FormatError
from .records import BlockRow, CheckpointState, InodeRow
from .validate import (_inode_row, block_fields_are_valid, check_block_count, check_block_rows,
                       inode_fields_are_valid)

BATCH_ROWS = 256        # inode rows handed over at once: small enough to stay in the CPU's cache
_ARRAY_TYPES = frozenset(range(0x90, 0xa0)) | {0xdc, 0xdd}      # fixarray, array 16, array 32


def _unpacker(payload, start=0):
    stream = io.BytesIO(payload)            # shares the bytes: no copy
    stream.seek(start)
    return msgpack.Unpacker(stream, strict_map_key=False, max_buffer_size=max(len(payload), 1 << 20))


def decode_streaming(payload, first_ino, block_size=None, *, checked=True):
    """CheckpointState of ``payload`` with its inode rows left to decode lazily (see module doc).

    ``block_size`` (the superblock's): a regular file naming more blocks than
    its size fills at that block size is refused as its row is reached
    (:func:`check_block_count`). Returns None when the payload is not a plain
    map: the caller then decodes it whole (``from_wire`` explains what is wrong).

    Without ``checked`` the block and inode rows are decoded but not checked:
    only for a caller that has the same payload checked elsewhere and waits
    for that verdict before it uses anything built from them (a mount's child
    check, kvfs/store/childcheck.py). Rows that are not rows may then raise
    anything, not FormatError."""
    if not payload or payload[0] not in range(0x80, 0x90) and payload[0] not in (0xde, 0xdf):
        return None
    unpacker = _unpacker(payload)
    wire, rows_at, blocks = {}, None, None
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            at = unpacker.tell()
            if key == "inodes" and at < len(payload) and payload[at] in _ARRAY_TYPES:
                rows_at = at
                unpacker.skip()
                wire.pop(key, None)
            elif key == "blocks" and at < len(payload) and payload[at] in _ARRAY_TYPES:
                blocks = _block_rows(unpacker) if checked else _unchecked_block_rows(unpacker)
                wire.pop(key, None)
            else:
                wire[key] = unpacker.unpack()
                if key == "inodes":
                    rows_at = None
                elif key == "blocks":
                    blocks = None
        end = unpacker.tell()
    except FormatError:
        raise
    except Exception as exc:        # noqa: BLE001 - msgpack raises several kinds for bad bytes
        raise FormatError(f"checkpoint payload does not decode: {exc}") from None
    if end != len(payload):
        raise FormatError("checkpoint payload does not decode: extra data after the map")
    state = CheckpointState.from_wire(wire, first_ino)
    if blocks is not None:
        state.blocks = blocks               # checked as decoded (_block_rows)
    if rows_at is not None:
        state.inodes = InodeRowStream(payload, rows_at, block_size, checked=checked)
    return state


def _unchecked_block_rows(unpacker):
    """The BlockRows of the ``blocks`` array, decoded only (see decode_streaming's ``checked``)."""
    unpack = unpacker.unpack
    return [BlockRow(*unpack()) for _ in range(unpacker.read_array_header())]


def _block_rows(unpacker):
    """The BlockRows of the ``blocks`` array at the unpacker's position, decoded and checked one at a time.

    Refused as :func:`check_block_rows` refuses them, row for row; a row of
    the usual shape is checked from its fields, before it is a BlockRow."""
    rows, keys = [], set()
    append, add_key, unpack = rows.append, keys.add, unpacker.unpack
    for _ in range(unpacker.read_array_header()):
        wire = unpack()
        # Five fields: a block of a dedup domain, which is every block of a
        # store with a key secret (format 2); four: domain 0.
        if type(wire) is list and len(wire) == 5:
            k, off, length, refs, domain = wire
            if block_fields_are_valid(k, off, length, refs, domain) and k not in keys:
                add_key(k)
                append(BlockRow(k, off, length, refs, domain))
                continue
        elif type(wire) is list and len(wire) == 4:
            k, off, length, refs = wire
            if block_fields_are_valid(k, off, length, refs, 0) and k not in keys:
                add_key(k)
                append(BlockRow(k, off, length, refs))
                continue
        try:
            row = BlockRow(*wire)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"checkpoint payload is malformed: {exc}") from None
        check_block_rows((row,), keys)
        append(row)
    return rows


class InodeRowStream:
    """The checkpoint's inode rows, decoded and validated as they are iterated (once).

    Iterating gives InodeRows; :meth:`fields` gives each row's fields as the
    wire list ``[ino, mode, uid, gid, nlink, rdev, atime, mtime, ctime,
    payload]`` (InodeRow's field order), validated the same, without making
    an InodeRow: mount's load takes those (0.8 us a row less, a million times).
    """

    def __init__(self, payload, start, block_size=None, *, checked=True):
        self._payload, self._start, self._block_size = payload, start, block_size
        self._checked = checked         # False: see decode_streaming

    def __iter__(self):
        for fields in self.fields():
            yield InodeRow(*fields)

    def fields(self):
        """The rows' validated field lists (see the class doc), once."""
        for rows, _ in self.batches():
            yield from rows

    def batches(self, size=BATCH_ROWS):
        """The rows' validated field lists, in their order, as ``(rows, only_files)`` pairs, once.

        Consecutive regular files come in lists of up to ``size`` (``only_files``
        True), which mount makes into Inodes a list at a time
        (kvfs/namespace/treeload.py); every other row comes alone. A directory's
        row is made at once: decoding several directories' entries (a KV store
        directory holds up to millions) before making them left their names
        scattered among freed pools, 60 bytes of RSS a file at a million files.
        A bad row is refused when it is decoded, before the files ahead of it in
        its list are yielded.
        """
        payload, self._payload = self._payload, None        # iterated once; the bytes go after
        if payload is None:
            raise RuntimeError("a checkpoint's streamed inode rows can be read only once")
        unpacker = _unpacker(payload, self._start)
        block_size, unpack, checked = self._block_size, unpacker.unpack, self._checked
        if not checked:
            block_size = None
        try:
            left = unpacker.read_array_header()
        except Exception as exc:    # noqa: BLE001
            raise FormatError(f"checkpoint payload does not decode: {exc}") from None
        files = []
        append = files.append
        for _ in range(left):
            try:
                fields = unpack()
            except Exception as exc:    # noqa: BLE001
                raise FormatError(f"checkpoint payload does not decode: {exc}") from None
            # Each row checked as it is decoded, while its objects are in the
            # CPU's cache: decoding a list of rows first and checking them after
            # (even column by column, in C-level passes) was slower.
            if checked and (type(fields) is not list or len(fields) != ROW_FIELDS
                            or not inode_fields_are_valid(*fields)):
                _refuse(fields)
            if fields[1] & 0o170000 != S_IFREG:
                if files:
                    yield files, True
                    files = []
                    append = files.append
                yield [fields], False
                continue
            if block_size is not None:
                size_, keys = fields[9]
                if len(keys) > 1 or size_ == 0:     # else: one block fills any size above 0
                    check_block_count(block_size, size_, len(keys), fields[0])
            append(fields)
            if len(files) == size:
                yield files, True
                files = []
                append = files.append
        if files:
            yield files, True


ROW_FIELDS = len(dataclasses.fields(InodeRow))


def _refuse(fields):
    """Raise FormatError for a row that failed the fast check, with the explaining check's message."""
    try:
        row = InodeRow(*fields)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"checkpoint payload is malformed: {exc}") from None
    _inode_row(row)
    raise FormatError(f"checkpoint inode {row.ino!r:.20} is invalid")      # not reached: _inode_row raised
