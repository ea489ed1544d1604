"""Journal records and checkpoint state as named types, with their wire encoding.

On the device both are msgpack: a record is a list ``[tag, field, ...]`` in the
field order declared below, and the checkpoint state is a map. These classes
are the only place that knows the positions; every producer and consumer
(namespace, block index, store, fsck, tests) uses the field names.

Invariants written next to the schema (fsck checks them):

* ``Make.ino`` is above every inode number in use; numbers are never reused.
  0..15 are reserved: 1 is the root, 2 ``/.kvfs`` and 3 ``/.kvfs/by-hash``
  (both virtual, never stored).
* A ``Content`` record is written only after every block it names is durable.
* A regular file is provisional from its ``Make`` until its first ``Content``;
  load drops files still provisional after replay (they were in flight at a crash).
* ``BlockRow.refs`` equals the number of times durable contents name the key;
  block extents and ``free`` extents tile the data region exactly.
"""
import dataclasses
from dataclasses import field
from typing import ClassVar, Optional

from ..errors import FormatError
from .validate import check_record, check_state


def doc(text):
    """A field whose meaning is recorded next to it (docs/format.md is checked against these)."""
    return field(metadata={"doc": text})


class _Record:
    """Base of the journal records: ``to_wire`` / ``decode_record``."""

    __slots__ = ()
    TAG: ClassVar[str]

    def to_wire(self):
        return [self.TAG, *(getattr(self, f.name) for f in dataclasses.fields(self))]

    @classmethod
    def from_wire(cls, values):
        return cls(*values)


@dataclasses.dataclass(frozen=True, slots=True)
class Make(_Record):
    """Create inode ``ino`` and link it as ``name`` in ``parent``."""

    TAG: ClassVar[str] = "mk"
    parent: int = doc("directory that gets the entry")
    name: bytes = doc("entry name: 1..255 bytes, no '/' or NUL, not '.' or '..'")
    ino: int = doc("the new inode number; next_ino becomes at least ino + 1")
    mode: int = doc("full st_mode, file type included")
    uid: int = doc("owner")
    gid: int = doc("group")
    rdev: int = doc("device number of a character or block node, else 0")
    ns: int = doc("time of creation (atime, mtime, ctime), ns since the epoch")
    target: Optional[bytes] = doc("symlink target, else nil")


@dataclasses.dataclass(frozen=True, slots=True)
class Link(_Record):
    """Hard link: add ``name`` in ``parent`` for inode ``ino``; nlink += 1."""

    TAG: ClassVar[str] = "ln"
    ino: int = doc("existing inode (not a directory)")
    parent: int = doc("directory that gets the entry")
    name: bytes = doc("entry name")
    ns: int = doc("ctime of the inode, mtime and ctime of the directory")


@dataclasses.dataclass(frozen=True, slots=True)
class Remove(_Record):
    """Unlink or rmdir; at link count 0 the inode leaves the durable namespace."""

    TAG: ClassVar[str] = "rm"
    parent: int = doc("directory holding the entry")
    name: bytes = doc("entry name")
    ns: int = doc("mtime and ctime of the directory, ctime of the inode")


@dataclasses.dataclass(frozen=True, slots=True)
class Move(_Record):
    """Rename; an existing ``new_name`` is removed first, in the same record (atomic replace)."""

    TAG: ClassVar[str] = "mv"
    old_parent: int = doc("directory holding the entry")
    old_name: bytes = doc("entry name")
    new_parent: int = doc("directory that gets the entry")
    new_name: bytes = doc("new entry name")
    ns: int = doc("mtime and ctime of both directories, ctime of the inode")


@dataclasses.dataclass(frozen=True, slots=True)
class Attrs(_Record):
    """chmod, chown, utimes: the inode's attributes after the change."""

    TAG: ClassVar[str] = "at"
    ino: int = doc("inode")
    mode: int = doc("full st_mode (the file type never changes)")
    uid: int = doc("owner")
    gid: int = doc("group")
    atime: int = doc("access time, ns")
    mtime: int = doc("modification time, ns")
    ctime: int = doc("change time, ns")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRef:
    """One block of a content record: where its bytes are."""

    key: bytes = doc("16-byte content key (keyed xxh3-128 of the domain and the bytes)")
    off: int = doc("extent offset in the data region")
    length: int = doc("bytes of content; the extent is length rounded up to 4 KiB")
    domain: int = field(default=0, metadata={"doc": "dedup domain whose key this is; 0: none "
                                                    "(version 1), absent on the wire when 0"})

    def to_wire(self):
        return [self.key, self.off, self.length, self.domain] if self.domain else [self.key, self.off, self.length]


@dataclasses.dataclass(frozen=True, slots=True)
class Content(_Record):
    """A file's whole content. Each named block gains a reference (at replay an unknown
    key is entered at that extent, marked allocated); then each block of the previous
    content loses one. The file stops being provisional."""

    TAG: ClassVar[str] = "ct"
    ino: int = doc("regular file")
    size: int = doc("file size in bytes")
    mtime: int = doc("modification time, ns")
    ctime: int = doc("change time, ns")
    blocks: tuple = doc("one BlockRef or nil (a hole) per block; missing trailing blocks are holes")

    def to_wire(self):
        return [self.TAG, self.ino, self.size, self.mtime, self.ctime,
                [None if b is None else b.to_wire() for b in self.blocks]]

    @classmethod
    def from_wire(cls, values):
        ino, size, mtime, ctime, blocks = values
        return cls(ino, size, mtime, ctime, tuple(None if b is None else BlockRef(*b) for b in blocks))


RECORD_TYPES = (Make, Link, Remove, Move, Attrs, Content)
_BY_TAG = {cls.TAG: cls for cls in RECORD_TYPES}


def decode_record(wire):
    """A record from its msgpack list; FormatError for an unknown tag or a wrong field count."""
    if not isinstance(wire, (list, tuple)) or not wire:
        raise FormatError(f"journal record is not a list: {wire!r:.60}")
    cls = _BY_TAG.get(wire[0]) if isinstance(wire[0], str) else None
    if cls is None:
        raise FormatError(f"unknown journal record {wire[0]!r}")
    if len(wire) != 1 + len(dataclasses.fields(cls)):
        raise FormatError(f"journal record {wire[0]!r} has {len(wire) - 1} fields, expected "
                          f"{len(dataclasses.fields(cls))}")
    try:
        record = cls.from_wire(wire[1:])
    except (TypeError, ValueError) as exc:
        raise FormatError(f"journal record {wire[0]!r} is malformed: {exc}") from None
    return check_record(record)


# -- checkpoint state -------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class InodeRow:
    """One inode of the durable namespace; ``payload`` on the wire depends on the type:
    directory ``[parent, [[name, ino], ...]]``, regular file ``[size, [key | nil, ...]]``,
    symlink the target bytes, anything else nil."""

    ino: int = doc("inode number")
    mode: int = doc("full st_mode")
    uid: int = doc("owner")
    gid: int = doc("group")
    nlink: int = doc("link count (directories: 2 + subdirectories)")
    rdev: int = doc("device number of a character or block node, else 0")
    atime: int = doc("access time, ns")
    mtime: int = doc("modification time, ns")
    ctime: int = doc("change time, ns")
    payload: object = doc("by type, see above")

    @property
    def parent(self):
        return self.payload[0]

    @parent.setter
    def parent(self, ino):
        self.payload = [ino, self.payload[1]]

    @property
    def entries(self):
        """Directories: [(name, ino), ...]."""
        return self.payload[1]

    @entries.setter
    def entries(self, entries):
        self.payload = [self.payload[0], list(entries)]

    @property
    def size(self):
        return self.payload[0]

    @property
    def keys(self):
        """Regular files: [key | None, ...]."""
        return self.payload[1]

    def to_wire(self):
        return [self.ino, self.mode, self.uid, self.gid, self.nlink, self.rdev,
                self.atime, self.mtime, self.ctime, self.payload]


@dataclasses.dataclass(slots=True)
class BlockRow:
    key: bytes = doc("16-byte content key")
    off: int = doc("extent offset in the data region")
    length: int = doc("bytes of content")
    refs: int = doc("how many times durable contents name the key")
    domain: int = field(default=0, metadata={"doc": "dedup domain (BlockRef.domain); absent on the wire when 0"})

    def to_wire(self):
        wire = [self.key, self.off, self.length, self.refs]
        return wire + [self.domain] if self.domain else wire


@dataclasses.dataclass(slots=True)
class CheckpointState:
    """The whole durable state: the checkpoint payload, a msgpack map of these keys."""

    next_ino: int = doc("next inode number to hand out")
    inodes: list = doc("InodeRow per inode of the durable namespace")
    blocks: list = doc("BlockRow per block that durable contents name")
    free: Optional[list] = doc("[off, length] free extents of the data region, sorted and "
                               "coalesced; absent (mkfs's empty map): all of it is free")
    provisional: list = doc("inode numbers of files with no content record yet")
    pinned: list = field(default_factory=list, metadata={"doc": "inode numbers of files never evicted"})

    def to_wire(self):
        wire = {"next_ino": self.next_ino, "inodes": [r.to_wire() for r in self.inodes],
                "blocks": [b.to_wire() for b in self.blocks], "free": None,
                "provisional": list(self.provisional), "pinned": list(self.pinned)}
        if self.free is None:
            del wire["free"]                # absent: the whole data region is free (mkfs's map)
        else:
            wire["free"] = [list(e) for e in self.free]
        return wire

    @classmethod
    def from_wire(cls, wire, first_ino):
        if not isinstance(wire, dict):
            raise FormatError("checkpoint payload is not a map")
        try:
            free = wire.get("free")
            state = cls(next_ino=wire.get("next_ino", first_ino),
                        inodes=[InodeRow(*row) for row in wire.get("inodes", ())],
                        blocks=[BlockRow(*row) for row in wire.get("blocks", ())],
                        free=None if free is None else [tuple(e) for e in free],
                        provisional=list(wire.get("provisional", ())),
                        pinned=list(wire.get("pinned", ())))
        except (TypeError, ValueError) as exc:
            raise FormatError(f"checkpoint payload is malformed: {exc}") from None
        return check_state(state)
