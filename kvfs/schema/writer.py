"""A checkpoint payload encoded as its rows are made, straight into the buffer the device writes.

The payload is a msgpack map of :meth:`CheckpointState.to_wire`'s keys. Encoded
whole, a checkpoint held every row three times over before a byte was written
(the InodeRows and BlockRows, their wire lists, a packed bytes object each):
several hundred MB at a million files, made in a worker thread while the event
loop went on allocating new files among them. Here each row is packed and
copied into the buffer as soon as it is made, so the next row reuses its
garbage, and the buffer is an anonymous mapping the kernel takes back whole.

Each layer of the stack writes its own part, top down, in this key order
(``KEY_ORDER``)::

    next_ino, inodes, provisional, pinned     the namespace
    blocks                                    the block index
    free                                      the store (absent: all of the data region is free)

Readers take a map's keys in any order (the loader, fsck, ``msgpack.unpackb``),
so the order is this writer's choice, not a format rule. The two row arrays
(``ROW_ARRAYS``) get a 5-byte header (msgpack "array 32"), filled in when the
array ends, since only then is the count known (the block index leaves out
blocks that nothing names); msgpack readers accept any header width. Every
other value has exactly the bytes ``msgpack.packb`` gives it, and so does each
row.

The buffer is ``capacity`` bytes of address space, mapped without reserving
memory (MAP_NORESERVE): pages come as the rows reach them. A payload that would
not fit is still counted to its end (``size``) but no longer copied, so the
caller can say how big it was.
"""
import mmap
import struct

import msgpack

from ..base.aligned import align_up
from ..errors import InternalError

KEY_ORDER = ("next_ino", "inodes", "provisional", "pinned", "blocks", "free")
ROW_ARRAYS = frozenset({"inodes", "blocks"})

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)     # Linux's value; Python 3.11 lacks the name
_FIXMAP = 0x80                  # msgpack fixmap: 0x80 | count, for up to 15 keys
_ARRAY32 = struct.Struct(">BI")  # msgpack array 32: 0xdd, then the count
assert _ARRAY32.size == 5 and len(KEY_ORDER) <= 15


class CheckpointWriter:
    """One checkpoint payload, written key by key in ``KEY_ORDER`` (see the module doc).

    ``put(key, value)`` for a value packed whole, ``start_rows(key)`` then
    ``add_row(row)`` per row (an InodeRow or BlockRow) for a row array, and
    :meth:`finish` for the payload. Not thread-safe: one thread writes at a time.
    """

    def __init__(self, capacity):
        self.capacity = capacity
        self._buffer = mmap.mmap(-1, align_up(max(capacity, 1)),
                                 flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self._pack = msgpack.Packer().pack     # packb's defaults: use_bin_type, autoreset
        self.size = 1                          # the map header, one byte, written by finish()
        self._keys = 0
        self._next_key = 0                     # index in KEY_ORDER of the earliest key still allowed
        self._array_at = None                  # where the open row array's header goes
        self._rows = 0

    @property
    def overflowed(self):
        return self.size > self.capacity

    def put(self, key, value):
        self._start(key)
        self._write(self._pack(value))

    def start_rows(self, key):
        if key not in ROW_ARRAYS:
            raise InternalError(f"checkpoint key {key!r} is not a row array")
        self._start(key)
        self._array_at, self._rows = self.size, 0
        self.size += _ARRAY32.size             # the header, once the count is known

    def add_row(self, row):
        if self._array_at is None:
            raise InternalError("a checkpoint row outside a row array")
        self._rows += 1
        self._write(self._pack(row.to_wire()))

    def finish(self):
        """The payload: a read-only view at the start of a page-aligned buffer (its ``.obj``)
        that holds zeros after it, as ``Device.pwrite_sync``'s ``source`` wants."""
        self._end_rows()
        if self.overflowed:
            raise InternalError(f"finish() of a checkpoint that overflowed ({self.size} bytes)")
        self._buffer[0] = _FIXMAP | self._keys
        return memoryview(self._buffer).toreadonly()[:self.size]

    def _start(self, key):
        self._end_rows()
        try:
            self._next_key = KEY_ORDER.index(key, self._next_key) + 1
        except ValueError:
            raise InternalError(f"checkpoint key {key!r} out of order (KEY_ORDER: {KEY_ORDER})") from None
        self._keys += 1
        self._write(self._pack(key))

    def _end_rows(self):
        if self._array_at is not None:
            at, self._array_at = self._array_at, None
            if at + _ARRAY32.size <= self.capacity:
                self._buffer[at:at + _ARRAY32.size] = _ARRAY32.pack(0xdd, self._rows)

    def _write(self, piece):
        end = self.size + len(piece)
        if end <= self.capacity:
            self._buffer[self.size:end] = piece
        self.size = end


def write_state(writer, state):
    """Write a CheckpointState into ``writer``, all but ``free`` (the store's part, written last)."""
    writer.put("next_ino", state.next_ino)
    writer.start_rows("inodes")
    for row in state.inodes:
        writer.add_row(row)
    writer.put("provisional", list(state.provisional))
    writer.put("pinned", list(state.pinned))
    writer.start_rows("blocks")
    for row in state.blocks:
        writer.add_row(row)
