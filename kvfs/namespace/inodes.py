"""Inodes and directory entries: the namespace's data types and reserved numbers."""
from __future__ import annotations

import array
import bisect
import dataclasses
import stat
from typing import Any, Iterable, Iterator, KeysView, Sequence

from ..base.sharedints import shared

_new_object = object.__new__


ROOT_INO = 1
META_DIR_INO = 2          # /.kvfs
BY_HASH_INO = 3           # /.kvfs/by-hash
FIRST_INO = 16
VIEW_BIT = 1 << 62        # inode number of a file seen through /.kvfs/by-hash
META_NAME = b".kvfs"
NAME_MAX = 255
KEY_XATTR = b"user.kvfs.key"
# Metadata space. Everything durable must fit one checkpoint slot, so every
# operation that adds metadata is charged against it first and refused with
# ENOSPC when it would not fit; a checkpoint that does not fit would otherwise
# leave the journal unable to fold. The costs are upper bounds of each item's
# msgpack size in the checkpoint (see Tree.snapshot): an inode row without its
# payload, a directory entry without its name, a key in a file's block list,
# and a block-index entry together with the free extent it can split off.
INODE_ROW_COST = 96
DIR_ENTRY_COST = 16
FILE_KEY_COST = 18
INDEX_BLOCK_COST = 57
CHECKPOINT_MARGIN = 1 / 16       # headroom for the estimate and for writers racing each other
TYPICAL_NAME = 40                # for statfs's inode count: a LMCache chunk name is ~60 bytes
# DirEntries packs an entry's inode number and cookie into one int: while the
# inode number fits 32 bits and the cookie 28, ``cookie << 32 | ino`` (below
# 2**60, a 32-byte int); past that ``~(cookie << 64 | ino)``, negative, 48
# bytes. Inode numbers stay below 2**62 (VIEW_BIT marks views, never entries).
_NARROW_INO_BITS = 32
_NARROW_INO_MASK = (1 << _NARROW_INO_BITS) - 1
_NARROW_COOKIE_LIMIT = 1 << 28
_WIDE_INO_BITS = 64
_WIDE_INO_MASK = (1 << _WIDE_INO_BITS) - 1
_COMPACTION_STEP = 64      # DirEntries: entries each add or remove moves while a compaction runs


def _pack(cookie, ino):
    if ino <= _NARROW_INO_MASK and cookie < _NARROW_COOKIE_LIMIT:
        return cookie << _NARROW_INO_BITS | ino
    return ~(cookie << _WIDE_INO_BITS | ino)


def _ino_of(packed):
    return packed & _NARROW_INO_MASK if packed >= 0 else ~packed & _WIDE_INO_MASK


def _cookie_of(packed):
    return packed >> _NARROW_INO_BITS if packed >= 0 else ~packed >> _WIDE_INO_BITS
# FIFOs, sockets and device nodes are metadata-only inodes, as on any Linux filesystem.
SUPPORTED_TYPES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK,
                   stat.S_IFCHR, stat.S_IFBLK)


class DirEntries:
    """Name -> inode, plus readdir cookies that stay valid while entries come and go.

    Cookies grow monotonically. ``_cookies`` (an array of 8-byte cookies) and
    ``_order`` are parallel, in cookie order: each cookie and its entry's
    name, or None once the entry is removed (a tombstone). They are compacted
    once tombstones outnumber live entries, so a listing resumes by bisection
    instead of a scan.

    A compaction runs a step at a time: rebuilt at once, a directory of a
    million entries (LMCache keeps every chunk in one) held the event loop a
    quarter of a second on the remove that crossed the line. While one runs,
    ``_fresh`` (cookies, names) takes the live entries of the arrays from
    ``_moved`` on, ``_COMPACTION_STEP`` of them a call to add or remove, and
    replaces them once it has them all; new entries go to the old arrays'
    end meanwhile (their cookies are the largest), so a cookie up to the
    fresh arrays' last is in them and any other in the old ones past _moved.

    ``by_name`` maps a name to one int packing the cookie and the inode
    number (see _pack): one 32-byte object an entry where an (ino, cookie)
    tuple and its cookie took 88, and at mount a child's inode number decoded
    for the entry took 32 more. (A cookie -> name dict did the same as the
    arrays for 40 more bytes an entry.)
    """

    __slots__ = ("by_name", "_cookies", "_order", "_next", "_dead", "_fresh", "_moved")

    def __init__(self) -> None:
        self.by_name = {}                  # name -> _pack(cookie, ino)
        self._cookies = array.array("Q")   # sorted cookies, live and tombstoned
        self._order = []                   # the name of each cookie in _cookies; None: removed
        self._next = 1
        self._dead = 0                     # tombstones, in _fresh and in the arrays past _moved
        self._fresh = None                 # (cookies, names) a compaction is filling, or None
        self._moved = 0                    # entries of the arrays that compaction has been through

    def __len__(self):
        return len(self.by_name)

    def get(self, name: bytes) -> int | None:
        hit = self.by_name.get(name)
        return None if hit is None else _ino_of(hit)

    def cookie_of(self, name: bytes) -> int:
        return _cookie_of(self.by_name[name])

    def names(self) -> KeysView[bytes]:
        return self.by_name.keys()

    # inos() and items() unpack inline (see _ino_of): mount walks every entry with them.
    def inos(self) -> list[int]:
        """The children's inode numbers (a list: safe while entries change)."""
        return [p & _NARROW_INO_MASK if p >= 0 else ~p & _WIDE_INO_MASK for p in self.by_name.values()]

    def items(self) -> list[tuple[bytes, int]]:
        """[(name, ino)] as they are now (a list: the caller may change entries meanwhile)."""
        return [(name, p & _NARROW_INO_MASK if p >= 0 else ~p & _WIDE_INO_MASK) for name, p in self.by_name.items()]

    def items_from_thread(self) -> list[tuple[bytes, int]]:
        """:meth:`items` for a worker thread while the loop changes entries: one dict
        copy first, made under the GIL, so the walk never sees the dict change size."""
        return [(name, _ino_of(packed)) for name, packed in self.by_name.copy().items()]

    def add(self, name: bytes, ino: int) -> None:
        self._next += 1
        self.by_name[name] = _pack(self._next, ino)
        self._cookies.append(self._next)
        self._order.append(name)
        if self._fresh is not None:
            self._compact_some()

    def add_all(self, entries: Iterable[tuple[bytes, int]]) -> None:
        """Add [(name, ino), ...] (names new and distinct) as :meth:`add` would, one by one.

        Mount loads every directory so: a million entries added one call each
        cost a remount about a second more."""
        first = self._next + 1
        cookies = range(first, first + len(entries))
        names = [entry[0] for entry in entries]
        self.by_name.update(zip(names, map(_pack, cookies, [entry[1] for entry in entries])))
        self._cookies.extend(cookies)
        self._order.extend(names)
        self._next += len(entries)

    def remove(self, name: bytes) -> None:
        cookie = _cookie_of(self.by_name.pop(name))
        cookies, names, lo, fresh = self._cookies, self._order, self._moved, self._fresh
        if fresh is not None and fresh[0] and cookie <= fresh[0][-1]:
            cookies, names, lo = fresh[0], fresh[1], 0
        names[bisect.bisect_left(cookies, cookie, lo)] = None
        self._dead += 1
        if fresh is not None or self._dead > len(self.by_name) + 64:
            self._compact_some()

    def _compact_some(self):
        """Move the next step of entries (starting a compaction if none runs) into _fresh."""
        if self._fresh is None:
            self._fresh, self._moved = (array.array("Q"), []), 0
        fresh_cookies, fresh_names = self._fresh
        cookies, names = self._cookies, self._order
        start = self._moved
        end = min(start + _COMPACTION_STEP, len(cookies))
        for i in range(start, end):
            name = names[i]
            if name is None:
                self._dead -= 1
            else:
                fresh_cookies.append(cookies[i])
                fresh_names.append(name)
        self._moved = end
        if end == len(cookies):
            self._cookies, self._order = self._fresh
            self._fresh, self._moved = None, 0

    def items_after(self, cookie: int) -> Iterator[tuple[bytes, int, int]]:
        """Yield (name, ino, cookie) for entries with a cookie greater than ``cookie``."""
        # The arrays as they are now: a compaction while the caller iterates
        # replaces them, and positions in the new ones mean other entries.
        # An entry removed since is skipped (its name is gone or has another
        # cookie); one added after a compaction may be missed, as POSIX allows.
        # Mid-compaction, the fresh arrays as far as they are filled now, then
        # the old ones past what they hold (filling them more later moves no
        # entry out of the old arrays, so none is seen twice).
        if self._fresh is None:
            parts = [(self._cookies, self._order, 0, None)]
        else:
            parts = [(*self._fresh, 0, len(self._fresh[0])), (self._cookies, self._order, self._moved, None)]
        by_name = self.by_name
        for cookies, order, lo, end in parts:
            i = bisect.bisect_right(cookies, cookie, lo, len(cookies) if end is None else end)
            while i < (len(cookies) if end is None else end):
                name = order[i]
                if name is not None:
                    hit = by_name.get(name)
                    if hit is not None and _cookie_of(hit) == cookies[i]:
                        yield name, _ino_of(hit), cookies[i]
                i += 1


# "One or a set": the owners of a content (Tree.content) and a file's names
# (for eviction, which removes them all; see add_name) are almost always a single value, and an
# empty set is 216 bytes. So such a field holds nothing (() or None), the one
# value, or a set once there are two or more.
def with_member(current: Any, item: Any) -> Any:
    """``current`` (a one-or-a-set field) with ``item`` added."""
    if not current:
        return item
    if isinstance(current, set):
        current.add(item)
        return current
    return current if current == item else {current, item}


def without_member(current: Any, item: Any) -> Any:
    """``current`` with ``item`` removed; () once nothing is left."""
    if isinstance(current, set):
        current.discard(item)
        return next(iter(current)) if len(current) == 1 else current
    return () if current == item else current


def members(current: Any) -> set | tuple:
    """The values of a one-or-a-set field."""
    if isinstance(current, set):
        return current
    return (current,) if current else ()


# A file's names. One name, the common case, is kept as the name itself (the
# directory's key object) with its directory's inode number in ``name_dir``
# (the directory's own int): no tuple, which was 56 bytes a file. Two or more
# are a set of (directory ino, name). Directories keep None (they have one
# name, found through ``parent``).
def add_name(inode: Inode, entry: tuple[int, bytes]) -> None:
    current = inode.names
    if not current:
        inode.name_dir, inode.names = entry
    elif type(current) is bytes:
        if (inode.name_dir, current) != entry:
            inode.names, inode.name_dir = {(inode.name_dir, current), entry}, None
    else:
        current.add(entry)


def drop_name(inode: Inode, entry: tuple[int, bytes]) -> None:
    current = inode.names
    if type(current) is bytes:
        if (inode.name_dir, current) == entry:
            inode.names, inode.name_dir = (), None
    elif current:
        current.discard(entry)
        if len(current) == 1:
            inode.name_dir, inode.names = next(iter(current))


def names_of(inode: Inode) -> set[tuple[int, bytes]] | tuple[tuple[int, bytes], ...]:
    """A file's (directory ino, name) entries."""
    current = inode.names
    if type(current) is bytes:
        return ((inode.name_dir, current),)
    return current if current else ()


def _rare(name, default):
    """A field of :class:`Inode` that is almost always ``default``, kept in ``_rare``.

    A slot costs 8 bytes on every inode, a million files or not; these fields
    are set only on a directory, a symlink or device node, or a file while it
    is open, written or being sealed. ``_rare`` is None until one of them is
    set to something else, and goes back to None once all are default again.
    """
    def get(self):
        rare = self._rare
        return default if rare is None else rare.get(name, default)

    def put(self, value):
        rare = self._rare
        if value is default or value == default and type(value) is type(default):
            if rare is not None:
                rare.pop(name, None)
                if not rare:
                    self._rare = None
        elif rare is None:
            self._rare = {name: value}
        else:
            rare[name] = value
    return property(get, put, doc=f"(rare; default {default!r})")


def _shared_values(column):
    """{value: its shared int} for each distinct value of ``column`` (kvfs/base/sharedints.py)."""
    return {value: shared(value) for value in set(column)}


class Inode:
    __slots__ = ("ino", "mode", "uid", "gid", "nlink", "atime", "mtime", "ctime",
                 "data", "_committed", "size_committed", "content_key", "content_version",
                 "cached_version", "filled_version", "lookups", "names", "name_dir", "kernel_mtime", "_rare")

    # 20 slots: 192 bytes with the GC header (the allocator's classes are 16
    # bytes apart). rdev and evicted were slots too, for the attribute reply and
    # the inode lookup that read them on every request; as _rare properties
    # they cost those requests ~40 ns (of tens of microseconds), and every
    # file 16 bytes less.
    rdev = _rare("rdev", 0)                        # device nodes only
    evicted = _rare("evicted", False)              # removed by eviction: gone, even for the kernel's cached lookups
    parent = _rare("parent", None)                 # directories only
    entries = _rare("entries", None)               # directories only: DirEntries
    target = _rare("target", None)                 # symlinks only
    content_dirty = _rare("content_dirty", False)  # live content differs from the durable record
    opens = _rare("opens", 0)
    writers = _rare("writers", 0)
    page_writers = _rare("page_writers", 0)        # open writers through the page cache (see namespace/pagecache.py)
    direct_writes_under_page_writers = _rare("direct_writes_under_page_writers", False)
    sealing = _rare("sealing", False)
    data_holds = _rare("data_holds", 0)            # awaiting with the live content, no handle: namespace/idle.py
    provisional = _rare("provisional", False)      # created, no content record yet (see module doc)
    pre_truncate = _rare("pre_truncate", None)     # (old content, truncating fh): see namespace/truncation.py
    page_reads = _rare("page_reads", None)         # ReadsUnderPageWriters while page_writers: namespace/pagecache.py
    fill_on_open = _rare("fill_on_open", False)    # made from the tier, never in the kernel's page cache: pagecache.py

    def __init__(self, ino: int, mode: int, uid: int, gid: int, rdev: int = 0, now: int = 0) -> None:
        self._rare = None
        # Modes and owners repeat across files: one int object each (kvfs/base/sharedints.py).
        self.ino, self.mode, self.uid, self.gid = ino, shared(mode), shared(uid), shared(gid)
        if rdev:
            self.rdev = rdev
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.atime = self.mtime = self.ctime = now
        if stat.S_ISDIR(mode):
            self.entries = DirEntries()
        self.data = None                   # a file's live content; None: idle (namespace/idle.py)
        self.committed = ()                # durable block list: (key | None, ...)
        self.size_committed = 0
        self.content_key = None
        self.content_version = 0           # bumped on every content change
        self.cached_version = -1           # content version the kernel page cache holds
        self.filled_version = -1           # content version a page fill stored whole in the kernel (pagecache.py)
        self.lookups = 0
        self.kernel_mtime = None           # the mtime last put in an attribute reply (None: not yet)
        self.names = () if stat.S_ISREG(mode) else None      # files: see add_name, for eviction
        self.name_dir = None

    @classmethod
    def loaded_file(cls, ino: int, mode: int, uid: int, gid: int, nlink: int, atime: int, mtime: int, ctime: int,
                    committed: Sequence[bytes | None], size: int) -> Inode:
        """A regular file as a checkpoint row makes it: idle (namespace/idle.py), never looked up.

        The same inode as ``Inode(ino, mode, uid, gid)`` given the row's fields
        (a unit test compares every slot), made with each slot set once and no
        tests of the mode: mount makes one per file, a million per remount.
        """
        inode = _new_object(cls)
        inode._rare = inode.data = inode.content_key = inode.kernel_mtime = inode.name_dir = None
        inode.ino, inode.mode, inode.uid, inode.gid, inode.nlink = ino, shared(mode), shared(uid), shared(gid), nlink
        inode.atime, inode.mtime, inode.ctime = atime, mtime, ctime
        inode._committed = committed[0] if len(committed) == 1 and committed[0] is not None else tuple(committed)
        inode.size_committed = shared(size)
        inode.content_version = inode.lookups = 0
        inode.cached_version = inode.filled_version = -1
        inode.names = ()
        return inode

    @classmethod
    def loaded_files(cls, inos: Sequence[int], modes: Sequence[int], uids: Sequence[int], gids: Sequence[int],
                     nlinks: Sequence[int], atimes: Sequence[int], mtimes: Sequence[int], ctimes: Sequence[int],
                     committed: Sequence[Any], sizes: Sequence[int]) -> list[Inode]:
        """:meth:`loaded_file` for each row of a batch, given as columns; a list of Inodes.

        ``committed``: each file's block list as ``_committed`` keeps it (a
        one-block file's bare key, else a tuple). Mount's batches of files come
        here (kvfs/namespace/treeload.py): the same slots set the same way, with
        the shared ints looked up once per distinct value, not once per file.
        """
        modes, uids, gids, sizes = (map(_shared_values(column).__getitem__, column)
                                    for column in (modes, uids, gids, sizes))
        made, new = [], _new_object
        append = made.append
        for ino, mode, uid, gid, nlink, atime, mtime, ctime, keys, size in zip(
                inos, modes, uids, gids, nlinks, atimes, mtimes, ctimes, committed, sizes):
            inode = new(cls)
            inode._rare = inode.data = inode.content_key = inode.kernel_mtime = inode.name_dir = None
            inode.ino, inode.mode, inode.uid, inode.gid, inode.nlink = ino, mode, uid, gid, nlink
            # Equal timestamps share one int object, as loaded_file's caller makes them.
            inode.atime, inode.mtime = (mtime if atime == mtime else atime), mtime
            inode.ctime = mtime if ctime == mtime else ctime
            inode._committed, inode.size_committed = keys, size
            inode.content_version = inode.lookups = 0
            inode.cached_version = inode.filled_version = -1
            inode.names = ()
            append(inode)
        return made

    # A file's durable block list, (key | None, ...). A one-block file keeps its
    # key bare: a 1-tuple was 48 bytes a file, and most small files are one block.
    @property
    def committed(self) -> tuple[bytes | None, ...]:
        keys = self._committed
        return keys if type(keys) is tuple else (keys,)

    @committed.setter
    def committed(self, keys: Sequence[bytes | None]) -> None:
        self._committed = keys[0] if len(keys) == 1 and keys[0] is not None else tuple(keys)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def size(self) -> int:
        if self.data is not None:
            return self.data.size
        if stat.S_ISREG(self.mode):
            return self.size_committed
        if self.target is not None:
            return len(self.target)
        return 4096 if self.is_dir else 0


class ViewInode(Inode):
    """A committed content seen through /.kvfs/by-hash; attributes follow its source."""

    __slots__ = ("source", "view_size", "holds")

    def __init__(self, ino: int, key: bytes, source: Inode) -> None:
        super().__init__(ino, stat.S_IFREG, source.uid, source.gid)
        self.data = None                   # an immutable FileData while open
        self.content_key = key
        self.source = source.ino
        self.holds = 0                     # by-hash listings that include this entry
        self.refresh(source)

    def refresh(self, source: Inode) -> None:
        # Only the owner (and root) may use a view entry: read and search bits, nothing else.
        self.mode = stat.S_IFREG | (source.mode & 0o500)
        self.uid, self.gid = source.uid, source.gid
        self.atime, self.mtime, self.ctime = source.atime, source.mtime, source.ctime
        self.view_size = source.size_committed

    @property
    def size(self) -> int:
        return self.view_size


@dataclasses.dataclass
class Handle:
    inode: Inode
    writable: bool
    view: bool = False
    kill_suid: bool = False      # a direct_io writer without CAP_FSETID: its writes drop set-ID bits
    page_writer: bool = False    # writes through the kernel's page cache (not direct_io)
    o_direct: bool = False       # opened O_DIRECT: its reads put no pages in the kernel's cache
    pages_read: list = None      # page_writer: [(first, last)] page spans read by anyone since its last reply
    cold_blocks: int = 0         # blocks the open's prefetch did not find in the clean cache
