"""Type and range checks of decoded records and checkpoint state (what the device may not lie about).

A checksum proves that bytes are the ones written, not that the writer was
kvfs: a crafted or buggy store can hold well-checksummed msgpack of any shape.
Everything below the decoders trusts field types (an inode number is an int, a
name is 1..255 bytes without '/'), so the decoders check them here and raise
FormatError naming the field; the layers then only meet values they can handle.
Relations between fields (does an entry name an existing inode? do extents
overlap?) are the loader's and the namespace's business, not checked here.
"""
import stat
from stat import S_IFDIR, S_IFLNK, S_IFREG

from ..errors import FormatError

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
NAME_MAX = 255
RESERVED_INOS = 16              # 0..15: 1 the root, 2 and 3 virtual; the rest unused
ROOT = 1
KEY_LEN = 16
MAX_BLOCK_LEN = 16 << 20        # layout.MAX_BLOCK_SIZE (the superblock bounds it further)
FILE_TYPES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR,
              stat.S_IFBLK)


def _fail(what, value):
    raise FormatError(f"{what} is invalid: {value!r:.60}")


def uint(value, what, top=U64):
    if type(value) is not int or not 0 <= value <= top:
        _fail(what, value)
    return value


def time_ns(value, what):
    if type(value) is not int or not I64_MIN <= value <= I64_MAX:
        _fail(what, value)


def ino(value, what):
    if type(value) is not int or not (value == ROOT or RESERVED_INOS <= value <= U64):
        _fail(what, value)
    return value


def name(value, what):
    if (type(value) is not bytes or not 1 <= len(value) <= NAME_MAX or b"/" in value or b"\0" in value
            or value in (b".", b"..")):
        _fail(what, value)


def mode(value, what):
    if type(value) is not int or not 0 <= value <= 0o177777 or stat.S_IFMT(value) not in FILE_TYPES:
        _fail(what, value)
    return value


def key(value, what):
    if type(value) is not bytes or len(value) != KEY_LEN:
        _fail(what, value)


def target(value, what):
    # No upper bound: a mount only ever gets targets under PATH_MAX from the kernel,
    # but the layers accept longer ones, and the journal and slot sizes bound them.
    if type(value) is not bytes or not value:
        _fail(what, value)


def extent_length(value, what):
    if type(value) is not int or not 1 <= value <= MAX_BLOCK_LEN:
        _fail(what, value)


def check_block_count(block_size, size, count, ino):
    """A file of ``size`` bytes names at most ceil(size / block_size) blocks (``ino``: for the message).

    This is what catches a superblock whose block size was changed (a crafted or
    re-checksummed sector): every file of more than one block would then be read
    with the wrong block boundaries, which would serve wrong bytes.
    """
    if count > -(-size // block_size):
        raise FormatError(f"inode {ino} names {count} blocks, more than its {size} bytes fill at the block "
                          f"size of {block_size}: the superblock or the checkpoint is corrupt")


# -- journal records ---------------------------------------------------------------

def check_record(rec):
    """Raise FormatError unless every field of ``rec`` has its type and range."""
    tag = rec.TAG
    check = _RECORD_CHECKS[tag]
    check(rec, f"journal record {tag!r}")
    return rec


def _make(rec, w):
    ino(rec.parent, f"{w} parent")
    name(rec.name, f"{w} name")
    if type(rec.ino) is not int or not RESERVED_INOS <= rec.ino <= U64:
        _fail(f"{w} inode number", rec.ino)
    mode(rec.mode, f"{w} mode")
    uint(rec.uid, f"{w} uid", U32)
    uint(rec.gid, f"{w} gid", U32)
    uint(rec.rdev, f"{w} rdev")
    time_ns(rec.ns, f"{w} time")
    if stat.S_ISLNK(rec.mode):
        target(rec.target, f"{w} symlink target")
    elif rec.target is not None:
        _fail(f"{w} target of a non-symlink", rec.target)


def _link(rec, w):
    ino(rec.ino, f"{w} inode")
    ino(rec.parent, f"{w} parent")
    name(rec.name, f"{w} name")
    time_ns(rec.ns, f"{w} time")


def _remove(rec, w):
    ino(rec.parent, f"{w} parent")
    name(rec.name, f"{w} name")
    time_ns(rec.ns, f"{w} time")


def _move(rec, w):
    ino(rec.old_parent, f"{w} old parent")
    name(rec.old_name, f"{w} old name")
    ino(rec.new_parent, f"{w} new parent")
    name(rec.new_name, f"{w} new name")
    time_ns(rec.ns, f"{w} time")


def _attrs(rec, w):
    ino(rec.ino, f"{w} inode")
    mode(rec.mode, f"{w} mode")
    uint(rec.uid, f"{w} uid", U32)
    uint(rec.gid, f"{w} gid", U32)
    for field in ("atime", "mtime", "ctime"):
        time_ns(getattr(rec, field), f"{w} {field}")


def _content(rec, w):
    ino(rec.ino, f"{w} inode")
    uint(rec.size, f"{w} size", I64_MAX)
    time_ns(rec.mtime, f"{w} mtime")
    time_ns(rec.ctime, f"{w} ctime")
    for block in rec.blocks:
        if block is not None:
            key(block.key, f"{w} block key")
            uint(block.off, f"{w} block offset")
            extent_length(block.length, f"{w} block length")
            uint(block.domain, f"{w} block domain")


_RECORD_CHECKS = {"mk": _make, "ln": _link, "rm": _remove, "mv": _move, "at": _attrs, "ct": _content}


# -- checkpoint state ----------------------------------------------------------------

def check_state(state):
    """Raise FormatError unless the CheckpointState's rows have their types and ranges.

    Also refused: two rows of one inode number or of one block key, a root that
    is not a directory.
    """
    uint(state.next_ino, "checkpoint next_ino")
    seen = set()
    for row in state.inodes:
        _inode_row(row)
        if row.ino in seen:
            raise FormatError(f"checkpoint holds inode {row.ino} twice")
        seen.add(row.ino)
    check_block_rows(state.blocks)
    for extent in state.free or ():
        if len(extent) != 2:
            _fail("checkpoint free extent", extent)
        uint(extent[0], "checkpoint free extent offset")
        uint(extent[1], "checkpoint free extent length")
    for number in state.provisional:
        uint(number, "checkpoint provisional inode")
    for number in state.pinned:
        uint(number, "checkpoint pinned inode")
    return state


def check_block_rows(rows, keys=None):
    """Raise FormatError unless every BlockRow has its types and ranges, and no key repeats.

    ``keys``: the keys of rows checked before these (a set, which this adds to)."""
    keys = set() if keys is None else keys
    for row in rows:
        if not block_fields_are_valid(row.key, row.off, row.length, row.refs, row.domain):
            key(row.key, "checkpoint block key")
            uint(row.off, "checkpoint block offset")
            extent_length(row.length, "checkpoint block length")
            uint(row.refs, "checkpoint block refs")
            uint(row.domain, "checkpoint block domain")
        if row.key in keys:
            raise FormatError(f"checkpoint holds block {row.key.hex()} twice")
        keys.add(row.key)


def block_fields_are_valid(k, off, length, refs, domain):
    """Whether a BlockRow's fields have their types and ranges (no message: check_block_rows says why)."""
    return (type(k) is bytes and type(off) is type(length) is type(refs) is type(domain) is int
            and len(k) == KEY_LEN and 0 <= off <= U64 and 1 <= length <= MAX_BLOCK_LEN
            and 0 <= refs <= U64 and 0 <= domain <= U64)


def _inode_row(row):
    """Raise FormatError unless the row is valid (:func:`_explain_inode_row` says why).

    This runs for every inode at every mount, a million times at issue 10's
    scale, so the common case is checked inline, with no message formatted:
    it accepts exactly what :func:`_explain_inode_row` accepts (the unit tests
    compare the two on valid and on broken rows).
    """
    if not _inode_row_is_valid(row):
        _explain_inode_row(row)
        raise FormatError(f"checkpoint inode {row.ino!r:.20} is invalid")   # not reached: explained above


def _inode_row_is_valid(row):
    return inode_fields_are_valid(*row.to_wire())


def inode_fields_are_valid(n, m, uid, gid, nlink, rdev, at, mt, ct, payload):
    """Whether an InodeRow's fields, in wire order, make a valid row (no message: see _inode_row).

    Positional fields, not a row: mount streams a million rows through this
    (kvfs/schema/stream.py) and builds no InodeRow for them. Regular files, most
    of a KV store, come first and are checked in one expression: measured on a
    200,000-file checkpoint, 1.7 us a row against 4.5 us for the check by row
    attributes it replaced.
    """
    # One chained comparison for the nine types: a third faster than nine "and"s.
    if not (type(n) is type(m) is type(uid) is type(gid) is type(nlink) is type(rdev) is type(at) is type(mt)
            is type(ct) is int
            and 0 <= m <= 0o177777 and 0 <= uid <= U32 and 0 <= gid <= U32 and 0 <= nlink <= U32
            and 0 <= rdev <= U64 and I64_MIN <= at <= I64_MAX and I64_MIN <= mt <= I64_MAX
            and I64_MIN <= ct <= I64_MAX):
        return False
    kind = m & 0o170000
    if kind == S_IFREG:
        if not (isinstance(payload, (list, tuple)) and len(payload) == 2 and RESERVED_INOS <= n <= U64):
            return False
        size, keys = payload
        if not isinstance(keys, (list, tuple)) or type(size) is not int or not 0 <= size <= I64_MAX:
            return False
        for k in keys:
            if k is not None and (type(k) is not bytes or len(k) != KEY_LEN):
                return False
        return True
    if not (n == ROOT or RESERVED_INOS <= n <= U64):
        return False
    if kind == S_IFDIR:
        if not isinstance(payload, (list, tuple)) or len(payload) != 2:
            return False
        parent, entries = payload
        if (not isinstance(entries, (list, tuple)) or type(parent) is not int
                or not (parent == ROOT or RESERVED_INOS <= parent <= U64)):
            return False
        return _entries_pass_at_once(entries) or _entries_are_valid(entries)
    if kind not in FILE_TYPES or n == ROOT:
        return False
    if kind == S_IFLNK:
        return type(payload) is bytes and len(payload) > 0
    return payload is None


def _entries_pass_at_once(entries):
    """True if a directory's entries are certainly valid, checked with C-level passes over all of them.

    A directory of a KV store holds up to millions of entries, and checking
    them one by one in Python cost 2 us an entry. False means "not shown
    here": :func:`_entries_are_valid` then decides, entry by entry (an entry
    naming the root, a tuple among lists, anything unusual goes there).
    """
    if not entries or set(map(type, entries)) != _LIST or set(map(len, entries)) != _TWO:
        return False
    names, children = zip(*entries)
    if set(map(type, names)) != _BYTES or set(map(type, children)) != _INT:
        return False
    lengths = set(map(len, names))
    if min(lengths) < 1 or max(lengths) > NAME_MAX or min(children) < RESERVED_INOS or max(children) > U64:
        return False
    unique = set(names)
    if len(unique) != len(names) or b"." in unique or b".." in unique:
        return False
    joined = b"".join(names)                # a '/' or NUL in it is in one of the names
    return b"/" not in joined and b"\0" not in joined


_LIST, _TWO, _BYTES, _INT = {list}, {2}, {bytes}, {int}


def _entries_are_valid(entries):
    names = set()
    for entry in entries:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            return False
        entry_name, child = entry
        if (type(entry_name) is not bytes or not 1 <= len(entry_name) <= NAME_MAX or b"/" in entry_name
                or b"\0" in entry_name or entry_name in (b".", b"..") or entry_name in names
                or type(child) is not int or not (child == ROOT or RESERVED_INOS <= child <= U64)):
            return False
        names.add(entry_name)
    return True


def _explain_inode_row(row):
    """The field-by-field check, with the message that names the bad field."""
    w = f"checkpoint inode {row.ino!r:.20}"
    ino(row.ino, "checkpoint inode number")
    kind = stat.S_IFMT(mode(row.mode, f"{w} mode"))
    if row.ino == ROOT and kind != stat.S_IFDIR:
        _fail("checkpoint root (not a directory) mode", row.mode)
    uint(row.uid, f"{w} uid", U32)
    uint(row.gid, f"{w} gid", U32)
    uint(row.nlink, f"{w} nlink", U32)
    uint(row.rdev, f"{w} rdev")
    for field in ("atime", "mtime", "ctime"):
        time_ns(getattr(row, field), f"{w} {field}")
    payload = row.payload
    if kind == stat.S_IFDIR:
        if not isinstance(payload, (list, tuple)) or len(payload) != 2 or not isinstance(payload[1], (list, tuple)):
            _fail(f"{w} directory payload", payload)
        ino(payload[0], f"{w} parent")
        names = set()
        for entry in payload[1]:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                _fail(f"{w} entry", entry)
            name(entry[0], f"{w} entry name")
            ino(entry[1], f"{w} entry inode")
            if entry[0] in names:
                _fail(f"{w} entry name (given twice)", entry[0])
            names.add(entry[0])
    elif kind == stat.S_IFREG:
        if not isinstance(payload, (list, tuple)) or len(payload) != 2 or not isinstance(payload[1], (list, tuple)):
            _fail(f"{w} file payload", payload)
        uint(payload[0], f"{w} size", I64_MAX)
        for k in payload[1]:
            if k is not None:
                key(k, f"{w} block key")
    elif kind == stat.S_IFLNK:
        target(payload, f"{w} symlink target")
    elif payload is not None:
        _fail(f"{w} payload", payload)
