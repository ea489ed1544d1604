"""The namespace: POSIX operations on inodes and names, lookup counts, open files.

It talks to the block cache below it, and journals through its journal port (kvfs/schema/port.py). Its parts:

``inodes``      Inode, DirEntries, ViewInode, reserved inode numbers, metadata costs
``tree``        the durable tree: records applied (live and at replay), load (``treeload``), snapshot
``view``        the read-only ``/.kvfs/by-hash`` view
``durability``  sealing files, commits and checkpoints, background upkeep
``truncation``  an O_TRUNC open under readers; ``remote`` the shared tier (publish, fill misses)
``idle``        idle files keep no live content object; ``leases`` bypass readers' block maps
this module     the operations the FUSE layer calls
"""
from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from typing import Any, Callable, Iterator

import trio

from .. import schema
from ..base.aligned import Buffer
from ..base.crashpoints import armed, crashpoint
from ..blockcache.port import CachePort
from ..errors import (FormatError, BadDescriptor, Exists, InvalidArgument, IsADirectory, NameTooLong, NoSpace,
                      NotADirectory, NotEmpty, NotFound, NotPermitted, ReadOnly)
from ..schema.port import JournalPort
from .durability import Durability
from .eviction import Admin, Evictor
from .idle import IdleFiles
from .leases import BypassLeases, LeaseTable
from .inodes import (BY_HASH_INO, CHECKPOINT_MARGIN, DIR_ENTRY_COST, FILE_KEY_COST, FIRST_INO,
                     INDEX_BLOCK_COST, INODE_ROW_COST, KEY_XATTR, META_DIR_INO, META_NAME, NAME_MAX,
                     ROOT_INO, SUPPORTED_TYPES, TYPICAL_NAME, VIEW_BIT, DirEntries, Handle, Inode)
from .pagecache import KernelPages
from .remote import TierLink
from .port import SpaceFigures
from .shape import check_shape
from .tree import Tree
from .truncation import TruncationWindow
from .view import ByHashView
__all__ = ["BY_HASH_INO", "FIRST_INO", "KEY_XATTR", "META_DIR_INO", "META_NAME", "NAME_MAX", "ROOT_INO",
           "VIEW_BIT", "DirEntries", "Inode", "Namespace", "NamespaceStatistics", "SpaceFigures", "Tree"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NamespaceStatistics:
    inodes: int
    files: int
    directories: int
    logical_bytes: int           # sum of the files' recorded content sizes
    open_handles: int
    orphans: int
    next_ino: int
    metadata_bytes: int          # estimated checkpoint size of the durable state
    metadata_capacity: int       # what the checkpoint slot allows, less the margin
    checkpoint_cut_ms_max: float         # longest a checkpoint held the event loop (taking its cuts)
    checkpoint_last_ms: float            # the last checkpoint, from cut to durable
    checkpoint_rows_built_off_loop: int  # inode rows made in a worker thread (all checkpoints)
    checkpoint_rows_saved_on_loop: int   # inode rows saved on the loop because a change came first


class Namespace(TierLink, Durability, KernelPages, BypassLeases):
    def __init__(self, cache: CachePort, journal: JournalPort, *, now: Callable[[], int] = time.time_ns,
                 eviction_policy: str = "s3fifo", high_watermark: float = 0.9, low_watermark: float = 0.8) -> None:
        self.cache, self.journal, self.now = cache, journal, now
        self.tree = Tree(journal, now, cache)
        self.view = ByHashView(self.tree, cache, journal)
        self.evictor = Evictor(self, policy=eviction_policy, high_watermark=high_watermark, low_watermark=low_watermark)
        self.admin = Admin(self, self.evictor)
        self._unsealed = {}            # ino -> inode: every content_dirty file (durability.py)
        self.truncation = TruncationWindow(cache)
        self.idle = IdleFiles(self.tree, journal, cache, self._unsealed)
        self.handles, self._next_fh, self._nursery = {}, 1, None
        self._durability_lock = trio.Lock()
        self._cut_limiter = trio.CapacityLimiter(1)       # a checkpoint's rows, off the event loop
        self._checkpoint_stats = {"cut_ms_max": 0.0, "last_ms": 0.0, "rows_built_off_loop": 0, "rows_saved_on_loop": 0}
        self._space_wanted = trio.Event()
        self.content_watcher = None    # told an inode number on a content change, last close (pagecache.py)
        self.leases = LeaseTable(cache)    # bypass readers' holds on blocks (leases.py)

    def load(self, state: schema.CheckpointState, records: list[Any]) -> None:
        """Build the namespace from a CheckpointState (its blocks already in the index) and records."""
        self.tree.load(state, records, consume=True)
        try:
            check_shape(self.tree.inodes)
        except FormatError as exc:
            raise FormatError(f"the namespace is inconsistent: {exc}: run fsck.kvfs --repair") from None
        self.evictor.load()

    # -- space ----------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def metadata_bytes(self) -> int:
        return self.tree.metadata_bytes()

    def metadata_capacity(self) -> int:
        return int(self.journal.checkpoint_capacity() * (1 - CHECKPOINT_MARGIN))

    def _charge_metadata(self, nbytes):
        """Refuse with ENOSPC an operation whose ``nbytes`` of metadata would not fit."""
        if self.metadata_bytes() + nbytes > self.metadata_capacity():
            raise NoSpace("no metadata space left (the checkpoint slot is full)")

    def statfs(self) -> SpaceFigures:
        """Space and inode figures for statfs: data bytes, and inodes as metadata space allows."""
        free_inodes = max(0, self.metadata_capacity() - self.metadata_bytes())
        free_inodes //= INODE_ROW_COST + DIR_ENTRY_COST + TYPICAL_NAME
        return SpaceFigures(capacity_bytes=self.journal.capacity_bytes(),
                            available_bytes=max(0, self.journal.available_bytes()),
                            inodes=len(self.tree.inodes) + free_inodes, free_inodes=free_inodes,
                            block_size=self.block_size)

    # -- lookups --------------------------------------------------------------
    def inode(self, ino: int) -> Inode:
        return self.view.inode(ino) if ino & VIEW_BIT else self.tree.inode(ino)

    @staticmethod
    def _check_name(name):
        if len(name) > NAME_MAX:
            raise NameTooLong(f"name longer than {NAME_MAX} bytes")
        if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
            raise InvalidArgument("invalid name")

    def lookup(self, parent: int, name: bytes) -> int:
        """Resolve a name; counts one kernel lookup on success. Returns an inode number."""
        if len(name) > NAME_MAX:
            raise NameTooLong()
        if parent == ROOT_INO and name == META_NAME:
            return META_DIR_INO
        if parent == META_DIR_INO:
            if name == b"by-hash":
                return BY_HASH_INO
            raise NotFound()
        if parent == BY_HASH_INO:
            return self.view.lookup_all(name)
        child = self.tree.dir(parent).entries.get(name)
        if child is None:
            raise NotFound()
        self.tree.inodes[child].lookups += 1
        return child

    async def lookup_view(self, name: bytes, caller: tuple[int, int] | None) -> int:
        """by-hash/<name> for ``caller``: None (sees all) or (uid, gid)."""
        return await self.view.lookup(name, caller)

    async def view_listing(self, caller: tuple[int, int] | None) -> list[tuple[bytes, int, int]]:
        return await self.view.listing(caller)

    def release_view_listing(self, listing: list[tuple[bytes, int, int]]) -> None:
        self.view.release_listing(listing)

    def forget(self, ino: int, count: int) -> None:
        if ino < FIRST_INO:
            return
        if ino & VIEW_BIT:
            self.view.forget(ino, count)
            return
        inode = self.tree.inodes.get(ino) or self.tree.orphans.get(ino)
        if inode is not None:
            inode.lookups = max(0, inode.lookups - count)
            if not inode.lookups:
                inode.filled_version = -1      # the kernel let go of the inode, and of its pages
            self.tree.maybe_destroy(inode)

    def attr(self, ino: int) -> tuple[Inode, bool, int, bool]:
        """(inode-like attribute source, read_only, mtime, held back): all an attribute reply needs, in one call."""
        if ino in (META_DIR_INO, BY_HASH_INO):
            root = self.tree.inodes[ROOT_INO]
            inode = Inode(ino, stat.S_IFDIR | 0o555, 0, 0, now=root.ctime)
            inode.atime, inode.mtime = root.atime, root.mtime
        else:
            inode = self.view.inode(ino) if ino & VIEW_BIT else self.tree.inode(ino)
        return (inode, bool(ino & VIEW_BIT), *self.mtime_for_kernel(inode))

    def readlink(self, ino: int) -> bytes:
        target = self.inode(ino).target
        if target is None:
            raise InvalidArgument("not a symlink")
        return target

    async def content_key(self, ino: int) -> bytes | None:
        """The key of a file's sealed content (``user.kvfs.key``), or None while it is changing."""
        inode = self.inode(ino)
        if not inode.is_file:
            return None
        if not ino & VIEW_BIT:
            await self.seal(inode)
        return None if inode.content_dirty else self.tree.content.key(inode)

    # -- creating and removing ---------------------------------------------
    def _new_entry_checks(self, parent, name):
        self._check_name(name)
        directory = self.tree.dir(parent)
        if parent == ROOT_INO and name == META_NAME:
            raise Exists(".kvfs is reserved")
        if directory.ino not in self.tree.inodes:
            raise NotFound("directory was removed")
        if directory.entries.get(name) is not None:
            raise Exists()
        return directory

    @staticmethod
    def _check_writable_dir(parent):
        if parent in (META_DIR_INO, BY_HASH_INO) or parent & VIEW_BIT:
            raise ReadOnly("/.kvfs is read-only")

    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0, target: bytes | None = None) -> int:
        """mknod / mkdir / symlink / create: returns the new inode number (one lookup).

        In a set-group-ID directory the entry takes the directory's group, and a
        new subdirectory inherits the bit, as on every Linux filesystem.
        """
        self._check_writable_dir(parent)
        directory = self._new_entry_checks(parent, name)
        if stat.S_IFMT(mode) not in SUPPORTED_TYPES:
            raise InvalidArgument(f"unknown file type {stat.S_IFMT(mode):#o}")
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            rdev = 0
        if directory.mode & stat.S_ISGID:
            gid = directory.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        self._charge_metadata(INODE_ROW_COST + DIR_ENTRY_COST + len(name) + len(target or b""))
        ino = self.tree.next_ino
        self._emit(schema.Make(parent, name, ino, mode, uid, gid, rdev, self.now(), target))
        inode = self.tree.inodes[ino]
        inode.lookups += 1
        if inode.is_file:
            self.cache.attach(inode.data)
            self._mark_unsealed(inode)         # provisional until its first content record
        return ino

    def link(self, ino: int, parent: int, name: bytes) -> int:
        self._check_writable_dir(parent)
        inode = self.inode(ino)
        if ino & VIEW_BIT:
            raise ReadOnly()
        if inode.is_dir:
            raise NotPermitted("hard links to directories are not allowed")
        if inode.ino not in self.tree.inodes:
            raise NotFound("file was removed")
        self._new_entry_checks(parent, name)
        self._charge_metadata(DIR_ENTRY_COST + len(name))
        self._emit(schema.Link(inode.ino, parent, name, self.now()))
        inode.lookups += 1
        return inode.ino

    def unlink(self, parent: int, name: bytes, *, directory: bool) -> None:
        self._check_writable_dir(parent)
        if len(name) > NAME_MAX:
            raise NameTooLong()
        if parent == ROOT_INO and name == META_NAME:
            raise NotPermitted(".kvfs cannot be removed")
        child = self.tree.dir(parent).entries.get(name)
        if child is None:
            raise NotFound()
        inode = self.tree.inodes[child]
        if directory and not inode.is_dir:
            raise NotADirectory()
        if not directory and inode.is_dir:
            raise IsADirectory()
        if directory and len(inode.entries):
            raise NotEmpty()
        shared = inode.is_file and armed("dedup-unlink") and self.tree.has_copies(inode)
        self._emit(schema.Remove(parent, name, self.now()))
        if shared:
            crashpoint("dedup-unlink")

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, *, noreplace: bool = False) -> None:
        """Rename; a closed file's pending content is recorded first.

        Engines publish a chunk by writing a temp file and renaming it over the
        final name. If the rename became durable before the temp file's content
        record, a crash would leave the final name empty (ext4's auto_da_alloc
        exists for the same reason). Not so for a provisional file put on a free
        name (``noreplace``): load drops it, name and all (the tier's fetch, remote.py).
        """
        self._check_rename(old_parent, old_name, new_parent, new_name, noreplace)
        inode = self.tree.inodes[self.tree.dir(old_parent).entries.get(old_name)]
        if inode.is_file and inode.content_dirty and not inode.writers and not (noreplace and inode.provisional):
            await self.seal(inode)
            self._check_rename(old_parent, old_name, new_parent, new_name, noreplace)
        target = self.tree.dir(new_parent).entries.get(new_name)
        if target == self.tree.dir(old_parent).entries.get(old_name):
            return                                  # POSIX: renaming a link onto itself does nothing
        if len(new_name) > len(old_name):
            self._charge_metadata(len(new_name) - len(old_name))
        if target is not None:
            crashpoint("rename-source-sealed")
        self._emit(schema.Move(old_parent, old_name, new_parent, new_name, self.now()))
        if target is not None:
            crashpoint("rename-replaced")

    def _check_rename(self, old_parent, old_name, new_parent, new_name, noreplace):
        for parent in (old_parent, new_parent):
            self._check_writable_dir(parent)
        self._check_name(new_name)
        if META_NAME in (old_name, new_name) and ROOT_INO in (old_parent, new_parent):
            raise NotPermitted(".kvfs is reserved")
        src_dir, dst_dir = self.tree.dir(old_parent), self.tree.dir(new_parent)
        if src_dir.ino not in self.tree.inodes or dst_dir.ino not in self.tree.inodes:
            raise NotFound("directory was removed")
        child = src_dir.entries.get(old_name)
        if child is None:
            raise NotFound()
        inode = self.tree.inodes[child]
        target = dst_dir.entries.get(new_name)
        if target is not None:
            if noreplace:
                raise Exists()
            if target == child:
                return
            victim = self.tree.inodes[target]
            if inode.is_dir and not victim.is_dir:
                raise NotADirectory()
            if not inode.is_dir and victim.is_dir:
                raise IsADirectory()
            if victim.is_dir and len(victim.entries):
                raise NotEmpty()
        if inode.is_dir:
            up = dst_dir.ino
            while up != ROOT_INO:                   # no moving a directory into itself
                if up == inode.ino:
                    raise InvalidArgument("cannot move a directory into itself")
                up = self.tree.inodes[up].parent

    # -- attributes ---------------------------------------------------------
    async def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, atime: int | None = None, mtime: int | None = None) -> None:
        inode = self.inode(ino)
        if ino & VIEW_BIT:
            raise ReadOnly()
        now = self.now()
        if size is not None:
            if not inode.is_file:
                raise IsADirectory() if inode.is_dir else InvalidArgument()
            self.truncation.old_content_done(inode)
            with self.idle.holding(inode):
                await self._with_space(lambda: self.cache.truncate(self.idle.live_data(inode), size))
                self._content_changed(inode, now)
            if not inode.writers:
                self._schedule_seal(inode)
        changed = any(v is not None for v in (mode, uid, gid, atime, mtime))
        if changed and inode.ino in self.tree.inodes:
            new_mode = inode.mode if mode is None else (inode.mode & ~0o7777) | (mode & 0o7777)
            self._emit(schema.Attrs(inode.ino, new_mode,
                                    inode.uid if uid is None else uid, inode.gid if gid is None else gid,
                                    inode.atime if atime is None else atime,
                                    inode.mtime if mtime is None else mtime, now))
        inode.kernel_mtime = inode.mtime       # a setattr reply shows the real mtime (namespace/pagecache.py)

    # -- file data ------------------------------------------------------------
    def open(self, ino: int, flags: int, *, privileged: bool = True) -> tuple[int, bool, bool]:
        """Open a file; returns (fh, direct_io, keep_cache).

        ``privileged``: the caller may keep set-ID bits when it writes (CAP_FSETID).
        """
        inode, writable = self.inode(ino), (flags & os.O_ACCMODE) != os.O_RDONLY
        if inode.is_dir:
            raise IsADirectory()
        if not inode.is_file:
            raise InvalidArgument()
        view = bool(ino & VIEW_BIT)
        if view and (writable or flags & os.O_TRUNC):
            raise ReadOnly("/.kvfs/by-hash is read-only")
        fh = self._next_fh
        self._next_fh += 1
        if view:
            self.view.open_data(inode)
            self.handles[fh] = Handle(inode, False, True)
            inode.opens += 1
            # The inode number names this one content for the life of the mount,
            # so whatever the kernel has cached for it is always right.
            return fh, False, True
        self.idle.live_data(inode)
        direct_io, page_writer, keep = self._page_cache_mode(inode, flags, writable)
        self.handles[fh] = Handle(inode, writable, kill_suid=writable and direct_io and not privileged,
                                  page_writer=page_writer, o_direct=bool(flags & os.O_DIRECT))
        if page_writer:
            self._page_writer_opened(self.handles[fh])
        inode.opens += 1
        if writable:
            inode.writers += 1
        if flags & os.O_TRUNC:
            # Linux truncates on O_RDONLY|O_TRUNC too (the kernel checked write
            # permission); with atomic_o_trunc it leaves that to the filesystem.
            self.truncation.keep_old_content(inode, fh)
            if inode.data.size or inode.data.blocks:   # emptied: truncating to zero never awaits
                self.cache.release(inode.data)
                self._content_changed(inode, self.now())
            if not writable:
                self._schedule_seal(inode)
        if direct_io:
            return fh, True, keep
        if not writable:
            self.evictor.accessed(inode)
            # Not when the kernel holds every page, nor when the native plane will serve the READs.
            if not self.pages_filled(inode) and not (self.content_watcher and self._native_ready(self.handles[fh])):
                self.handles[fh].cold_blocks = self.cache.prefetch_on_open(inode.data)
        return fh, False, keep

    def handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise BadDescriptor() from None

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self.handle(fh)
        reads = self._page_cache_read(h)
        source = self.truncation.read_source(h.inode, fh)
        if reads is None:
            return await self.cache.read(source, off, size)
        return await self._read_under_page_writers(reads, source, off, size)

    async def write(self, fh: int, off: int, data: Buffer) -> int:
        h = self.handle(fh)
        if not h.writable:
            raise BadDescriptor()
        inode = h.inode
        if h.kill_suid:
            # The kernel drops set-ID bits on a write itself, but not on a
            # direct_io write: there the filesystem must (POSIX, file_remove_privs).
            kill = inode.mode & stat.S_ISUID | (inode.mode & stat.S_ISGID if inode.mode & stat.S_IXGRP else 0)
            if kill:
                await self.setattr(inode.ino, mode=inode.mode & ~kill)
        self.truncation.old_content_done(inode)
        self._page_cache_written(h)
        new_blocks = -(-(off + len(data)) // self.block_size) - len(inode.data.blocks)
        if new_blocks > 0:
            self._charge_metadata(new_blocks * (FILE_KEY_COST + INDEX_BLOCK_COST))
        await self._with_space(lambda: self.cache.write(inode.data, off, data))
        self._content_changed(inode, self.now())
        return len(data)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        inode = h.inode
        inode.opens -= 1
        if h.view:
            self.view.maybe_drop(inode)
            return
        self.truncation.old_content_done(inode, fh)
        self._page_cache_closed(h)
        if h.writable:
            inode.writers -= 1
            if inode.writers == 0:
                self._schedule_seal(inode)
        if not inode.opens and self.content_watcher is not None:
            self.content_watcher(inode.ino)
        self.tree.maybe_destroy(inode)
        self.idle.shed_if_idle(inode)

    async def fsync(self, fh: int) -> None:
        h = self.handle(fh)
        self.truncation.old_content_done(h.inode, fh)
        await self.seal(h.inode, force=True)
        await self.commit()

    # -- directories --------------------------------------------------------
    def list_dir(self, ino: int, after: int) -> Iterator[tuple[bytes, int, int]]:
        """Yield (name, ino, cookie) after ``after``; the caller counts lookups."""
        if ino == META_DIR_INO:
            if after < 1:
                yield b"by-hash", BY_HASH_INO, 1
            return
        if ino == BY_HASH_INO:
            raise InvalidArgument("by-hash is listed per caller: use view_listing")
        directory = self.tree.dir(ino)
        if ino == ROOT_INO and after < 1:
            yield META_NAME, META_DIR_INO, 1
        yield from directory.entries.items_after(max(after, 1))

    def parent_of(self, ino: int) -> int:
        """The inode number ".." names in directory ``ino``."""
        if ino in (META_DIR_INO, BY_HASH_INO):
            return ROOT_INO if ino == META_DIR_INO else META_DIR_INO
        return self.tree.dir(ino).parent

    def count_lookup(self, ino: int) -> None:
        if ino >= FIRST_INO:
            self.inode(ino).lookups += 1

    def statistics(self) -> NamespaceStatistics:
        c = self._checkpoint_stats
        tree = self.tree                # O(1): statistics are read while a million files exist
        return NamespaceStatistics(len(tree.inodes), tree.file_count, tree.dir_count, tree.committed_bytes,
                                   len(self.handles), len(tree.orphans), tree.next_ino, self.metadata_bytes(),
                                   self.metadata_capacity(), round(c["cut_ms_max"], 3), round(c["last_ms"], 3),
                                   c["rows_built_off_loop"], c["rows_saved_on_loop"])
