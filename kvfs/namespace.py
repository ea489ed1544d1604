"""The namespace: inodes, directory entries, lookup counts and per-file contents.

Every change to durable state is a *record* (a short msgpack-able list).
Live operations validate their arguments, build a record and hand it to
:meth:`Namespace._emit`, which applies it with the very same
:meth:`Namespace.apply` that mount uses to replay the journal. Replay therefore
cannot drift from live behaviour.

Records (``ns`` is a timestamp in ns, names are bytes)::

    ["mk", parent, name, ino, mode, uid, gid, rdev, ns, target]   create (target: symlinks)
    ["ln", ino, parent, name, ns]                                  hard link
    ["rm", parent, name, ns]                                       unlink / rmdir
    ["mv", old_parent, old_name, new_parent, new_name, ns]         rename (replaces target)
    ["at", ino, mode, uid, gid, atime, mtime, ctime]               attributes
    ["ct", ino, size, mtime, ctime, [[key, off, len] | None, ...]] whole file content

A file's content record is written only when all its blocks are on the device
(after close, fsync or ``kvfs-admin flush``), so after a crash a file shows
either an older complete content or the new complete content, never a mix.

A regular file is *provisional* from its "mk" record until its first "ct"
record: another file's fsync may make the create durable while this file is
still being written, and a crash must not then show it empty. Load drops every
file that is still provisional once the journal is replayed, so after a crash
such a file is absent. The checkpoint lists provisional inodes under
``"provisional"``.

Invariants (checked by fsck):

* every directory entry names an inode in ``inodes``; every inode but the root
  is reachable; ``nlink`` equals the number of entries naming it (directories:
  2 + subdirectories);
* ``BlockEntry.refs`` equals the number of times durable contents name a key;
* inode numbers are never reused (``next_ino`` only grows); 0-15 are reserved:
  1 is the root, 2 is ``/.kvfs``, 3 is ``/.kvfs/by-hash``.

The by-hash view (``/.kvfs/by-hash/<content key>``) is RAM-only: each entry is a
:class:`ViewInode` for one (content key, source inode) pair, numbered
``VIEW_BIT | n`` with ``n`` never reused in the life of the mount. A view's
content never changes: its first open builds an immutable FileData from the
source's committed block list (pinned in the block index until the last close),
so the kernel may keep its pages forever; if the source no longer holds that
content, the open fails with ENOENT. Who may see which entries is decided by the
caller (fuseops): ``caller=None`` sees every content, ``(uid, gid)`` only files
it owns, may read, and reaches through directories it may search.
"""
import bisect
import dataclasses
import errno
import logging
import os
import stat
import time

import trio

from .blockcache import FileData
from .errors import FsError, KvfsError

log = logging.getLogger(__name__)

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
# msgpack size in the checkpoint (see snapshot()): an inode row without its
# payload, a directory entry without its name, a key in a file's block list,
# and a block-index entry together with the free extent it can split off.
INODE_ROW_COST = 96
DIR_ENTRY_COST = 16
FILE_KEY_COST = 18
INDEX_BLOCK_COST = 57
CHECKPOINT_MARGIN = 1 / 16       # headroom for the estimate and for writers racing each other
TYPICAL_NAME = 40                # for statfs's inode count: a LMCache chunk name is ~60 bytes
# FIFOs, sockets and device nodes are metadata-only inodes, as on any Linux filesystem.
SUPPORTED_TYPES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK,
                   stat.S_IFCHR, stat.S_IFBLK)


class DirEntries:
    """Name -> inode, plus readdir cookies that stay valid while entries come and go.

    Cookies grow monotonically; removal leaves a tombstone in the cookie list,
    and the list is compacted once tombstones outnumber live entries, so a
    listing resumes by bisection instead of a scan.
    """

    __slots__ = ("by_name", "_cookies", "_names", "_next", "_dead")

    def __init__(self):
        self.by_name = {}          # name -> (ino, cookie)
        self._cookies = []         # sorted cookies (possibly tombstoned)
        self._names = {}           # cookie -> name (absent: tombstone)
        self._next = 1
        self._dead = 0

    def __len__(self):
        return len(self.by_name)

    def get(self, name):
        hit = self.by_name.get(name)
        return None if hit is None else hit[0]

    def add(self, name, ino):
        self._next += 1
        self.by_name[name] = (ino, self._next)
        self._cookies.append(self._next)
        self._names[self._next] = name

    def remove(self, name):
        _, cookie = self.by_name.pop(name)
        del self._names[cookie]
        self._dead += 1
        if self._dead > len(self.by_name) + 64:
            self._cookies = [c for c in self._cookies if c in self._names]
            self._dead = 0

    def items_after(self, cookie):
        """Yield (name, ino, cookie) for entries with a cookie greater than ``cookie``."""
        i = bisect.bisect_right(self._cookies, cookie)
        while i < len(self._cookies):
            c = self._cookies[i]
            name = self._names.get(c)
            if name is not None:
                yield name, self.by_name[name][0], c
            i += 1


class Inode:
    __slots__ = ("ino", "mode", "uid", "gid", "nlink", "rdev", "atime", "mtime", "ctime",
                 "parent", "entries", "target", "data", "committed", "size_committed",
                 "content_key", "content_version", "cached_version", "content_dirty",
                 "lookups", "opens", "writers", "sealing", "provisional")

    def __init__(self, ino, mode, uid, gid, rdev=0, now=0):
        self.ino, self.mode, self.uid, self.gid, self.rdev = ino, mode, uid, gid, rdev
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.atime = self.mtime = self.ctime = now
        self.parent = None                 # directories only
        self.entries = DirEntries() if stat.S_ISDIR(mode) else None
        self.target = None                 # symlinks only
        self.data = FileData() if stat.S_ISREG(mode) else None
        self.committed = []                # durable block list: [key | None, ...]
        self.size_committed = 0
        self.content_key = None
        self.content_version = 0           # bumped on every content change
        self.cached_version = -1           # content version the kernel page cache holds
        self.content_dirty = False         # live content differs from the durable record
        self.lookups = self.opens = self.writers = 0
        self.sealing = False
        self.provisional = False           # created, no content record yet (see module doc)

    @property
    def is_dir(self):
        return stat.S_ISDIR(self.mode)

    @property
    def is_file(self):
        return stat.S_ISREG(self.mode)

    @property
    def size(self):
        if self.data is not None:
            return self.data.size
        if self.target is not None:
            return len(self.target)
        return 4096 if self.is_dir else 0


class ViewInode(Inode):
    """A committed content seen through /.kvfs/by-hash; attributes follow its source."""

    __slots__ = ("source", "view_size", "holds")

    def __init__(self, ino, key, source):
        super().__init__(ino, stat.S_IFREG, source.uid, source.gid)
        self.data = None                   # an immutable FileData while open
        self.content_key = key
        self.source = source.ino
        self.holds = 0                     # by-hash listings that include this entry
        self.refresh(source)

    def refresh(self, source):
        # Only the owner (and root) may use a view entry: read and search bits, nothing else.
        self.mode = stat.S_IFREG | (source.mode & 0o500)
        self.uid, self.gid = source.uid, source.gid
        self.atime, self.mtime, self.ctime = source.atime, source.mtime, source.ctime
        self.view_size = source.size_committed

    @property
    def size(self):
        return self.view_size


@dataclasses.dataclass
class Handle:
    inode: Inode
    writable: bool
    view: bool = False


@dataclasses.dataclass(frozen=True)
class SpaceFigures:
    capacity_bytes: int
    available_bytes: int
    inodes: int
    free_inodes: int
    block_size: int


@dataclasses.dataclass(frozen=True)
class NamespaceStatistics:
    inodes: int
    files: int
    directories: int
    logical_bytes: int
    open_handles: int
    orphans: int
    next_ino: int
    metadata_bytes: int          # estimated checkpoint size of the durable state
    metadata_capacity: int       # what the checkpoint slot allows, less the margin


class Namespace:
    def __init__(self, cache, journal, *, now=time.time_ns):
        self.cache = cache
        self.index = cache.index
        self.journal = journal
        self.now = now
        self.inodes = {}           # durable inodes
        self.orphans = {}          # unlinked but still open or looked up
        self.by_content = {}       # content key -> set of inode numbers
        self.handles = {}
        self._next_fh = 1
        self.next_ino = FIRST_INO
        self._nursery = None
        self._meta_bytes = 0       # inode rows, entries, targets, block lists (see INODE_ROW_COST)
        self.views = {}            # view inode number -> ViewInode (RAM only)
        self._view_of = {}         # (content key, source ino) -> view inode number
        self._next_view = 1

    # -- state --------------------------------------------------------------
    def load(self, state, records):
        """Build the namespace from a checkpoint state and the replayed journal records."""
        self.index.load(state)
        self.next_ino = state.get("next_ino", FIRST_INO)
        for row in state.get("inodes", ()):
            self._load_inode(row)
        for ino in state.get("provisional", ()):
            self.inodes[ino].provisional = True
        if ROOT_INO not in self.inodes:     # a fresh filesystem: mkfs writes an empty state
            root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, 0, 0, now=self.now())
            root.parent = ROOT_INO
            self.inodes[ROOT_INO] = root
        for record in records:
            self.apply(record)
        self._drop_provisional()
        self._meta_bytes = sum(self._inode_cost(i) for i in self.inodes.values())
        for inode in self.inodes.values():
            if inode.is_file:
                present = [k if k is None or k in self.index.entries else None for k in inode.committed]
                inode.data = FileData(inode.size_committed, present)
                if present != inode.committed:
                    log.error("inode %d names blocks missing from the index: reads give EIO", inode.ino)
                    inode.data.failed = errno.EIO
                self.cache.attach(inode.data)

    @staticmethod
    def _inode_cost(inode):
        cost = INODE_ROW_COST + len(inode.target or b"") + FILE_KEY_COST * len(inode.committed)
        if inode.is_dir:
            cost += sum(DIR_ENTRY_COST + len(name) for name in inode.entries.by_name)
        return cost

    def _drop_provisional(self):
        """Remove files whose content was never recorded: they were in flight at a crash."""
        doomed = {ino for ino, inode in self.inodes.items() if inode.provisional}
        if not doomed:
            return
        for directory in [i for i in self.inodes.values() if i.is_dir]:
            for name in [n for n, (child, _) in directory.entries.by_name.items() if child in doomed]:
                directory.entries.remove(name)
        for ino in doomed:
            self._forget_content_key(self.inodes.pop(ino))
        log.info("dropped %d file(s) created but never closed or fsynced before the crash", len(doomed))

    def _load_inode(self, row):
        ino, mode, uid, gid, nlink, rdev, atime, mtime, ctime, payload = row
        inode = Inode(ino, mode, uid, gid, rdev)
        inode.nlink, inode.atime, inode.mtime, inode.ctime = nlink, atime, mtime, ctime
        if inode.is_dir:
            inode.parent = payload[0]
            for name, child in payload[1]:
                inode.entries.add(name, child)
        elif inode.is_file:
            size, keys = payload
            self._set_committed(inode, size, keys)
        elif stat.S_ISLNK(mode):
            inode.target = payload
        self.inodes[ino] = inode

    def snapshot(self):
        rows = []
        for inode in self.inodes.values():
            if inode.is_dir:
                payload = [inode.parent, [(n, i) for n, (i, _) in inode.entries.by_name.items()]]
            elif inode.is_file:
                payload = [inode.size_committed, inode.committed]
            else:
                payload = inode.target
            rows.append((inode.ino, inode.mode, inode.uid, inode.gid, inode.nlink, inode.rdev,
                         inode.atime, inode.mtime, inode.ctime, payload))
        state = self.index.snapshot()
        state.update(next_ino=self.next_ino, inodes=rows,
                     provisional=[i.ino for i in self.inodes.values() if i.provisional])
        return state

    # -- record application (shared by live operations and replay) ----------
    def _emit(self, record):
        # Append first: extents freed while applying are then tagged with this
        # record, so they are not reused before it is durable. Records are
        # validated before they are built; a failure to apply one is a bug.
        self.journal.append(record)
        try:
            self.apply(record)
        except Exception:
            log.critical("record %r was journaled but does not apply", record[:2])
            raise

    def apply(self, rec):
        op = rec[0]
        if op == "mk":
            _, parent, name, ino, mode, uid, gid, rdev, ns, target = rec
            inode = Inode(ino, mode, uid, gid, rdev, ns)
            inode.target = target
            self.inodes[ino] = inode
            self._meta_bytes += INODE_ROW_COST + len(target or b"")
            self.next_ino = max(self.next_ino, ino + 1)
            self._link(self.inodes[parent], name, inode, ns)
            if inode.is_file:
                self._set_committed(inode, 0, [])
                inode.provisional = True
        elif op == "ln":
            _, ino, parent, name, ns = rec
            inode = self.inodes[ino]
            self._link(self.inodes[parent], name, inode, ns)
            inode.nlink += 1
            inode.ctime = ns
        elif op == "rm":
            _, parent, name, ns = rec
            self._unlink(self.inodes[parent], name, ns)
        elif op == "mv":
            _, old_parent, old_name, new_parent, new_name, ns = rec
            src_dir, dst_dir = self.inodes[old_parent], self.inodes[new_parent]
            inode = self.inodes[src_dir.entries.get(old_name)]
            if dst_dir.entries.get(new_name) is not None:
                self._unlink(dst_dir, new_name, ns)
            self._unlink(src_dir, old_name, ns, keep=True)
            self._link(dst_dir, new_name, inode, ns)
            inode.ctime = ns
        elif op == "at":
            _, ino, mode, uid, gid, atime, mtime, ctime = rec
            inode = self.inodes[ino]
            inode.mode, inode.uid, inode.gid = mode, uid, gid
            inode.atime, inode.mtime, inode.ctime = atime, mtime, ctime
        elif op == "ct":
            _, ino, size, mtime, ctime, blocks = rec
            inode = self.inodes[ino]
            for block in blocks:
                if block is not None:
                    self.index.add_ref(*block)
            for key in inode.committed:
                if key is not None:
                    self.index.drop_ref(key)
            self._set_committed(inode, size, [b[0] if b is not None else None for b in blocks])
            inode.mtime, inode.ctime = mtime, ctime
            inode.provisional = False
        else:
            raise KvfsError(f"unknown journal record {op!r}", errno.EUCLEAN)

    def _link(self, directory, name, inode, ns):
        directory.entries.add(name, inode.ino)
        self._meta_bytes += DIR_ENTRY_COST + len(name)
        directory.mtime = directory.ctime = ns
        if inode.is_dir:
            inode.parent = directory.ino
            directory.nlink += 1

    def _unlink(self, directory, name, ns, keep=False):
        inode = self.inodes[directory.entries.get(name)]
        directory.entries.remove(name)
        self._meta_bytes -= DIR_ENTRY_COST + len(name)
        directory.mtime = directory.ctime = ns
        inode.ctime = ns
        if inode.is_dir:
            directory.nlink -= 1
            if not keep:
                inode.nlink = 0
        elif not keep:
            inode.nlink -= 1
        if inode.nlink == 0:
            self._drop_inode(inode)

    def _drop_inode(self, inode):
        """The inode left the durable namespace; free it now or when the kernel lets go."""
        del self.inodes[inode.ino]
        self._meta_bytes -= INODE_ROW_COST + len(inode.target or b"") + FILE_KEY_COST * len(inode.committed)
        if inode.is_file:
            for key in inode.committed:
                if key is not None:
                    self.index.drop_ref(key)
            self._forget_content_key(inode)
            inode.committed = []
        if inode.lookups or inode.opens:
            self.orphans[inode.ino] = inode
        else:
            self._destroy(inode)

    def _destroy(self, inode):
        self.orphans.pop(inode.ino, None)
        if inode.data is not None and not self.journal.replaying:
            self.cache.release(inode.data)

    def _set_committed(self, inode, size, keys):
        self._forget_content_key(inode)
        self._meta_bytes += FILE_KEY_COST * (len(keys) - len(inode.committed))
        inode.committed = keys
        inode.size_committed = size
        inode.content_key = self._content_key(size, keys)
        self.by_content.setdefault(inode.content_key, set()).add(inode.ino)

    def _forget_content_key(self, inode):
        owners = self.by_content.get(inode.content_key)
        if owners is not None:
            owners.discard(inode.ino)
            if not owners:
                del self.by_content[inode.content_key]

    def _content_key(self, size, keys):
        hole = b"\0" * 16
        return self.index.key_of(size.to_bytes(8, "little") + b"".join(k or hole for k in keys))

    # -- metadata space ---------------------------------------------------------
    def metadata_bytes(self):
        """Estimated (upper bound) checkpoint size of the durable state."""
        return self._meta_bytes + INDEX_BLOCK_COST * self.index.block_count() + 4096

    def metadata_capacity(self):
        return int(self.journal.checkpoint_capacity() * (1 - CHECKPOINT_MARGIN))

    def _charge_metadata(self, nbytes):
        """Refuse with ENOSPC an operation whose ``nbytes`` of metadata would not fit."""
        if self.metadata_bytes() + nbytes > self.metadata_capacity():
            raise FsError(errno.ENOSPC, "no metadata space left (the checkpoint slot is full)")

    def statfs(self):
        """Space and inode figures for statfs: data bytes, and inodes as metadata space allows."""
        free_inodes = max(0, self.metadata_capacity() - self.metadata_bytes())
        free_inodes //= INODE_ROW_COST + DIR_ENTRY_COST + TYPICAL_NAME
        return SpaceFigures(capacity_bytes=self.index.capacity_bytes(),
                            available_bytes=max(0, self.index.available_bytes()),
                            inodes=len(self.inodes) + free_inodes, free_inodes=free_inodes,
                            block_size=self.index.block_size)

    # -- lookups --------------------------------------------------------------
    def inode(self, ino):
        if ino & VIEW_BIT:
            inode = self.views.get(ino)
        else:
            inode = self.inodes.get(ino) or self.orphans.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT)
        return inode

    def _dir(self, ino):
        inode = self.inode(ino)
        if not inode.is_dir:
            raise FsError(errno.ENOTDIR)
        return inode

    @staticmethod
    def _check_name(name):
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
        if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL, "invalid name")

    def lookup(self, parent, name):
        """Resolve a name; counts one kernel lookup on success. Returns an inode number."""
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if parent == ROOT_INO and name == META_NAME:
            return META_DIR_INO
        if parent == META_DIR_INO:
            if name == b"by-hash":
                return BY_HASH_INO
            raise FsError(errno.ENOENT)
        if parent == BY_HASH_INO:
            return self._lookup_by_hash(name)
        child = self._dir(parent).entries.get(name)
        if child is None:
            raise FsError(errno.ENOENT)
        self.inodes[child].lookups += 1
        return child

    def _lookup_by_hash(self, name):
        """by-hash lookup for a caller that may see every content (root)."""
        key = self._view_key(name)
        holders = self.by_content.get(key)
        if not holders:
            raise FsError(errno.ENOENT)
        view = self._view(key, self.inodes[min(holders)])
        view.lookups += 1
        return view.ino

    async def lookup_view(self, name, caller):
        """Resolve by-hash/<name> for ``caller``: None (sees all) or (uid, gid)."""
        if caller is None:
            return self._lookup_by_hash(name)
        key = self._view_key(name)
        found = await self._visible_sources(caller, {key})
        if key not in found:
            raise FsError(errno.ENOENT)
        view = self._view(key, self.inodes[found[key]])
        view.lookups += 1
        return view.ino

    async def view_listing(self, caller):
        """The by-hash entries ``caller`` may see, as (name, view ino, cookie).

        Each entry is held until :meth:`release_view_listing`, so a listing's
        inode numbers stay valid while it is read.
        """
        if caller is None:
            sources = {}
            for n, (key, holders) in enumerate(list(self.by_content.items())):
                if n % 1024 == 1023:
                    await trio.lowlevel.checkpoint()
                if holders and self.by_content.get(key) is holders:
                    sources[key] = min(holders)
        else:
            sources = await self._visible_sources(caller)
        listing = []
        for key in sorted(sources):
            source = self.inodes.get(sources[key])
            if source is None or source.content_key != key:
                continue                            # changed while we yielded
            view = self._view(key, source)
            view.holds += 1
            listing.append((key.hex().encode(), view.ino, len(listing) + 1))
        return listing

    def release_view_listing(self, listing):
        for _, ino, _ in listing:
            view = self.views.get(ino)
            if view is not None:
                view.holds -= 1
                self._maybe_drop_view(view)

    @staticmethod
    def _view_key(name):
        try:
            key = bytes.fromhex(name.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            raise FsError(errno.ENOENT) from None
        if len(key) != 16:
            raise FsError(errno.ENOENT)
        return key

    def _view(self, key, source):
        """The view inode of ``key`` as held by ``source`` (made on first use)."""
        ino = self._view_of.get((key, source.ino))
        if ino is None:
            ino = VIEW_BIT | self._next_view
            self._next_view += 1
            self.views[ino] = ViewInode(ino, key, source)
            self._view_of[key, source.ino] = ino
        else:
            self.views[ino].refresh(source)
        return self.views[ino]

    def _maybe_drop_view(self, view):
        if not view.opens and view.data is not None:
            self.cache.release(view.data)          # unpins the content's blocks
            view.data = None
        if not (view.lookups or view.opens or view.holds):
            del self.views[view.ino]
            del self._view_of[view.content_key, view.source]

    @staticmethod
    def _may(inode, uid, gid, bit):
        """POSIX permission check of one class: owner, else group, else other."""
        shift = 6 if inode.uid == uid else 3 if inode.gid == gid else 0
        return bool((inode.mode >> shift) & bit)

    async def _visible_sources(self, caller, keys=None):
        """{content key: source ino} of the files ``caller`` may see through the view.

        Visible: a regular file the caller owns and may read, named by an entry in
        a directory from which every directory up to the root is searchable by the
        caller. Only uid and primary gid are known (FUSE passes no supplementary
        groups), so a directory searchable only through a supplementary group
        hides its files: the check can refuse, never leak. The walk visits the
        directories the caller may search, yielding to the event loop as it goes;
        every answer is checked again, without yielding, before it is returned.
        """
        uid, gid = caller
        wanted = {}
        for key in (self.by_content if keys is None else keys):
            for ino in self.by_content.get(key, ()):
                inode = self.inodes[ino]
                if inode.uid == uid and inode.mode & 0o400:
                    wanted[ino] = key
        found = {}                                  # ino -> (directory, name)
        root = self.inodes[ROOT_INO]
        todo, seen, steps = [root], set(), 0
        while todo and wanted and len(found) < len(wanted) and self._may(root, uid, gid, 1):
            directory = todo.pop()
            if directory.ino in seen or directory.ino not in self.inodes:
                continue
            seen.add(directory.ino)
            for name, (ino, _) in list(directory.entries.by_name.items()):
                steps += 1
                if steps % 4096 == 0:
                    await trio.lowlevel.checkpoint()
                if ino in wanted:
                    found.setdefault(ino, (directory, name))
                    continue
                child = self.inodes.get(ino)
                if child is not None and child.is_dir and self._may(child, uid, gid, 1):
                    todo.append(child)
        sources = {}
        for ino, (directory, name) in sorted(found.items()):
            inode = self.inodes.get(ino)
            key = wanted[ino]
            if (inode is not None and inode.content_key == key and inode.uid == uid
                    and inode.mode & 0o400 and directory.entries.get(name) == ino
                    and self._reachable(directory, uid, gid)):
                sources.setdefault(key, ino)
        return sources

    def _reachable(self, directory, uid, gid):
        """Whether the caller may search ``directory`` and every directory above it."""
        while directory is not None and directory.ino in self.inodes:
            if not self._may(directory, uid, gid, 1):
                return False
            if directory.ino == ROOT_INO:
                return True
            directory = self.inodes.get(directory.parent)
        return False

    def forget(self, ino, count):
        if ino < FIRST_INO:
            return
        if ino & VIEW_BIT:
            view = self.views.get(ino)
            if view is not None:
                view.lookups = max(0, view.lookups - count)
                self._maybe_drop_view(view)
            return
        inode = self.inodes.get(ino) or self.orphans.get(ino)
        if inode is None:
            return
        inode.lookups = max(0, inode.lookups - count)
        self._maybe_destroy(inode)

    def _maybe_destroy(self, inode):
        if inode.ino in self.orphans and not inode.lookups and not inode.opens:
            self._destroy(inode)

    def is_virtual(self, ino):
        return ino in (META_DIR_INO, BY_HASH_INO)

    def attr(self, ino):
        """Return (inode-like attribute source, reported ino, read_only)."""
        if ino in (META_DIR_INO, BY_HASH_INO):
            root = self.inodes[ROOT_INO]
            fake = Inode(ino, stat.S_IFDIR | 0o555, 0, 0, now=root.ctime)
            fake.atime, fake.mtime = root.atime, root.mtime
            return fake, False
        inode = self.inode(ino)
        return inode, bool(ino & VIEW_BIT)

    # -- creating and removing ---------------------------------------------
    def _new_entry_checks(self, parent, name):
        self._check_name(name)
        directory = self._dir(parent)
        if parent == ROOT_INO and name == META_NAME:
            raise FsError(errno.EEXIST, ".kvfs is reserved")
        if directory.ino not in self.inodes:
            raise FsError(errno.ENOENT, "directory was removed")
        if directory.entries.get(name) is not None:
            raise FsError(errno.EEXIST)
        return directory

    def _check_writable_dir(self, parent):
        if parent in (META_DIR_INO, BY_HASH_INO) or parent & VIEW_BIT:
            raise FsError(errno.EROFS, "/.kvfs is read-only")

    def make(self, parent, name, mode, uid, gid, rdev=0, target=None):
        """mknod / mkdir / symlink / create: returns the new inode number (one lookup)."""
        self._check_writable_dir(parent)
        self._new_entry_checks(parent, name)
        if stat.S_IFMT(mode) not in SUPPORTED_TYPES:
            raise FsError(errno.EINVAL, f"unknown file type {stat.S_IFMT(mode):#o}")
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            rdev = 0
        self._charge_metadata(INODE_ROW_COST + DIR_ENTRY_COST + len(name) + len(target or b""))
        ino = self.next_ino
        self._emit(["mk", parent, name, ino, mode, uid, gid, rdev, self.now(), target])
        inode = self.inodes[ino]
        inode.lookups += 1
        if inode.is_file:
            self.cache.attach(inode.data)
            inode.content_dirty = True         # provisional until its first content record
        return ino

    def link(self, ino, parent, name):
        self._check_writable_dir(parent)
        inode = self.inode(ino)
        if ino & VIEW_BIT:
            raise FsError(errno.EROFS)
        if inode.is_dir:
            raise FsError(errno.EPERM, "hard links to directories are not allowed")
        if inode.ino not in self.inodes:
            raise FsError(errno.ENOENT, "file was removed")
        self._new_entry_checks(parent, name)
        self._charge_metadata(DIR_ENTRY_COST + len(name))
        self._emit(["ln", inode.ino, parent, name, self.now()])
        inode.lookups += 1
        return inode.ino

    def unlink(self, parent, name, *, directory):
        self._check_writable_dir(parent)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if parent == ROOT_INO and name == META_NAME:
            raise FsError(errno.EPERM, ".kvfs cannot be removed")
        child = self._dir(parent).entries.get(name)
        if child is None:
            raise FsError(errno.ENOENT)
        inode = self.inodes[child]
        if directory and not inode.is_dir:
            raise FsError(errno.ENOTDIR)
        if not directory and inode.is_dir:
            raise FsError(errno.EISDIR)
        if directory and len(inode.entries):
            raise FsError(errno.ENOTEMPTY)
        self._emit(["rm", parent, name, self.now()])

    async def rename(self, old_parent, old_name, new_parent, new_name, *, noreplace=False):
        """Rename; a closed file's pending content is recorded first.

        Engines publish a chunk by writing a temp file and renaming it over the
        final name. If the rename became durable before the temp file's content
        record, a crash would leave the final name empty (ext4's auto_da_alloc
        exists for the same reason).
        """
        self._check_rename(old_parent, old_name, new_parent, new_name, noreplace)
        inode = self.inodes[self._dir(old_parent).entries.get(old_name)]
        if inode.is_file and inode.content_dirty and not inode.writers:
            await self.seal(inode)
            self._check_rename(old_parent, old_name, new_parent, new_name, noreplace)
        if self._dir(new_parent).entries.get(new_name) == self._dir(old_parent).entries.get(old_name):
            return                                  # POSIX: renaming a link onto itself does nothing
        if len(new_name) > len(old_name):
            self._charge_metadata(len(new_name) - len(old_name))
        self._emit(["mv", old_parent, old_name, new_parent, new_name, self.now()])

    def _check_rename(self, old_parent, old_name, new_parent, new_name, noreplace):
        for parent in (old_parent, new_parent):
            self._check_writable_dir(parent)
        self._check_name(new_name)
        if META_NAME in (old_name, new_name) and ROOT_INO in (old_parent, new_parent):
            raise FsError(errno.EPERM, ".kvfs is reserved")
        src_dir, dst_dir = self._dir(old_parent), self._dir(new_parent)
        if src_dir.ino not in self.inodes or dst_dir.ino not in self.inodes:
            raise FsError(errno.ENOENT, "directory was removed")
        child = src_dir.entries.get(old_name)
        if child is None:
            raise FsError(errno.ENOENT)
        inode = self.inodes[child]
        target = dst_dir.entries.get(new_name)
        if target is not None:
            if noreplace:
                raise FsError(errno.EEXIST)
            if target == child:
                return
            victim = self.inodes[target]
            if inode.is_dir and not victim.is_dir:
                raise FsError(errno.ENOTDIR)
            if not inode.is_dir and victim.is_dir:
                raise FsError(errno.EISDIR)
            if victim.is_dir and len(victim.entries):
                raise FsError(errno.ENOTEMPTY)
        if inode.is_dir:
            up = dst_dir.ino
            while up != ROOT_INO:                   # no moving a directory into itself
                if up == inode.ino:
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                up = self.inodes[up].parent

    # -- attributes ---------------------------------------------------------
    async def setattr(self, ino, *, size=None, mode=None, uid=None, gid=None, atime=None,
                      mtime=None, ctime_now=True):
        inode = self.inode(ino)
        if ino & VIEW_BIT:
            raise FsError(errno.EROFS)
        now = self.now()
        if size is not None:
            if not inode.is_file:
                raise FsError(errno.EISDIR if inode.is_dir else errno.EINVAL)
            await self.cache.truncate(inode.data, size)
            self._content_changed(inode, now)
            if not inode.writers:
                self._schedule_seal(inode)
        changed = any(v is not None for v in (mode, uid, gid, atime, mtime))
        if changed and inode.ino in self.inodes:
            new_mode = inode.mode if mode is None else (inode.mode & ~0o7777) | (mode & 0o7777)
            self._emit(["at", inode.ino, new_mode,
                        inode.uid if uid is None else uid, inode.gid if gid is None else gid,
                        inode.atime if atime is None else atime,
                        inode.mtime if mtime is None else mtime, now])

    # -- file data ------------------------------------------------------------
    def open(self, ino, flags):
        """Open a file; returns (fh, direct_io, keep_cache)."""
        inode = self.inode(ino)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if inode.is_dir:
            raise FsError(errno.EISDIR)
        if not inode.is_file:
            raise FsError(errno.EINVAL)
        view = bool(ino & VIEW_BIT)
        if view and (writable or flags & os.O_TRUNC):
            raise FsError(errno.EROFS, "/.kvfs/by-hash is read-only")
        if view:
            return self._open_view(inode)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(inode, writable, view)
        inode.opens += 1
        if writable:
            inode.writers += 1
        if flags & os.O_TRUNC and writable:
            self._truncate_now(inode)
        if (flags & os.O_ACCMODE) == os.O_WRONLY:
            # A write-only descriptor cannot be mmapped, so it bypasses the page
            # cache: the engines' one big write() goes to the daemon as 1 MiB
            # requests without a copy into kernel pages. (The kernel invalidates
            # cached pages of the range on each direct_io write.)
            return fh, True, False
        # Everything else uses the page cache, so MAP_SHARED mmap works on every
        # file (numpy.memmap, torch.load(mmap=True), safetensors). Writes through
        # it keep the kernel's pages current; pages are kept across opens only
        # while nobody has written since they were cached.
        keep = not writable and not inode.writers and inode.cached_version == inode.content_version
        inode.cached_version = inode.content_version
        if not writable:
            self.cache.prefetch(inode.data)
        return fh, False, keep

    def _open_view(self, view):
        """Open a by-hash entry: exactly the content its key names, or ENOENT if it is gone."""
        if view.data is None:
            source = self.inodes.get(view.source)
            if source is None or source.content_key != view.content_key:
                raise FsError(errno.ENOENT, "that content is no longer stored")
            if any(k is not None and k not in self.index.entries for k in source.committed):
                raise FsError(errno.EIO, "that content names blocks missing from the index")
            view.data = FileData(source.size_committed, source.committed)
            self.cache.attach(view.data)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(view, False, True)
        view.opens += 1
        self.cache.prefetch(view.data)
        # The inode number names this one content for the life of the mount, so
        # whatever the kernel has cached for it is always right.
        return fh, False, True

    def _truncate_now(self, inode):
        if inode.data.size or inode.data.blocks:
            # Truncating to zero needs no old bytes, so this never awaits.
            self.cache.release(inode.data)
            self._content_changed(inode, self.now())

    def _content_changed(self, inode, now):
        inode.content_dirty = True
        inode.content_version += 1
        inode.mtime = inode.ctime = now

    def handle(self, fh):
        try:
            return self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    async def read(self, fh, off, size):
        h = self.handle(fh)
        return await self.cache.read(h.inode.data, off, size)

    async def write(self, fh, off, data):
        h = self.handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        inode = h.inode
        new_blocks = -(-(off + len(data)) // self.index.block_size) - len(inode.data.blocks)
        if new_blocks > 0:
            self._charge_metadata(new_blocks * (FILE_KEY_COST + INDEX_BLOCK_COST))
        await self.cache.write(inode.data, off, data)
        self._content_changed(inode, self.now())
        return len(data)

    async def release(self, fh):
        h = self.handles.pop(fh, None)
        if h is None:
            return
        inode = h.inode
        inode.opens -= 1
        if h.view:
            self._maybe_drop_view(inode)
            return
        if h.writable:
            inode.writers -= 1
            if inode.writers == 0:
                self._schedule_seal(inode)
        self._maybe_destroy(inode)

    async def fsync(self, fh):
        h = self.handle(fh)
        await self.seal(h.inode, force=True)
        await self.journal.commit()

    def _schedule_seal(self, inode):
        if inode.content_dirty and self._nursery is not None:
            self._nursery.start_soon(self._seal_quietly, inode)

    async def _seal_quietly(self, inode):
        if inode.sealing:
            return
        inode.sealing = True
        try:
            await self.seal(inode)
        except KvfsError as exc:
            log.error("inode %d: writing back its content failed: %s", inode.ino, exc)
        finally:
            inode.sealing = False

    async def seal(self, inode, force=False):
        """Flush a file's blocks and record its content (once no writer has it open).

        With ``force`` (fsync, flush) the content is recorded even while writers
        keep the file open.
        """
        while inode.content_dirty and inode.ino in self.inodes:
            if inode.writers and not force:
                return
            await self.cache.flush_file(inode.data)
            if inode.writers and not force:
                # Reopened for writing while we flushed: the content now holds
                # writes that no close or fsync has finished. Its last close seals it.
                return
            if inode.data.dirty_count == 0 and inode.ino in self.inodes and inode.content_dirty:
                self._record_content(inode)

    def _record_content(self, inode):
        fd = inode.data
        keys = fd.keys()
        while keys and keys[-1] is None:
            keys.pop()                     # trailing holes are implied by the size
        inode.content_dirty = False
        if fd.size == inode.size_committed and keys == inode.committed and not inode.provisional:
            # Rewritten with identical bytes (LMCache after a restart): nothing
            # changed on the device, so nothing is written, not even a record.
            return
        blocks = [None if k is None else [k, *self.index.extent(k)] for k in keys]
        self._emit(["ct", inode.ino, fd.size, inode.mtime, inode.ctime, blocks])

    # -- directories --------------------------------------------------------
    def list_dir(self, ino, after):
        """Yield (name, ino, cookie) after ``after``; the caller counts lookups."""
        if ino == META_DIR_INO:
            if after < 1:
                yield b"by-hash", BY_HASH_INO, 1
            return
        if ino == BY_HASH_INO:
            raise FsError(errno.EINVAL, "by-hash is listed per caller: use view_listing")
        directory = self._dir(ino)
        if ino == ROOT_INO and after < 1:
            yield META_NAME, META_DIR_INO, 1
        yield from directory.entries.items_after(max(after, 1))

    def parent_of(self, ino):
        """The inode number ".." names in directory ``ino``."""
        if ino in (META_DIR_INO, BY_HASH_INO):
            return ROOT_INO if ino == META_DIR_INO else META_DIR_INO
        return self._dir(ino).parent

    def count_lookup(self, ino):
        if ino >= FIRST_INO:
            self.inode(ino).lookups += 1

    # -- whole-filesystem operations -----------------------------------------
    async def flush_all(self):
        """Make everything durable: blocks, contents (open files too) and the journal."""
        await self.cache.flush_all()
        for inode in [i for i in self.inodes.values() if i.is_file and i.content_dirty]:
            try:
                await self.seal(inode, force=True)
            except KvfsError as exc:
                log.error("inode %d: flush failed: %s", inode.ino, exc)
        await self.journal.commit()

    async def run(self, commit_interval, *, task_status=trio.TASK_STATUS_IGNORED):
        """Background upkeep: seal idle files, commit the journal, checkpoint when it fills."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await trio.sleep(commit_interval)
                for inode in [i for i in self.inodes.values()
                              if i.is_file and i.content_dirty and not i.writers
                              and not i.sealing and not i.data.failed]:
                    self._schedule_seal(inode)
                try:
                    await self.journal.commit()
                    if self.journal.journal_fill > 0.5:
                        await self.journal.checkpoint()
                except KvfsError as exc:
                    # The device refused (EIO, or ENOSPC from the host below a
                    # sparse store). The records stay queued and the next round
                    # retries; fsync and flush report the error to their callers.
                    # The mount stays up, and the durable state is untouched.
                    log.error("committing metadata failed, will retry: %s", exc)

    def statistics(self):
        files = [i for i in self.inodes.values() if i.is_file]
        return NamespaceStatistics(len(self.inodes), len(files),
                                   sum(1 for i in self.inodes.values() if i.is_dir),
                                   sum(i.data.size for i in files), len(self.handles),
                                   len(self.orphans), self.next_ino, self.metadata_bytes(),
                                   self.metadata_capacity())
