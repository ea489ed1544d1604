"""pyfuse3 handlers: translate FUSE requests into namespace calls.

This is the only place where errors become errnos: every handler is wrapped by
:func:`_errno_mapped`, which turns a :class:`KvfsError` into ``FUSEError`` with
its errno and any other exception into a logged EIO. (pyfuse3 kills its main
loop on any exception that is not a FUSEError.)
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar

import pyfuse3
from pyfuse3 import (EntryAttributes, FileHandleT, FileInfo, FileNameT, FlagT, InodeT, ModeT, ReaddirToken,
                     RequestContext, SetattrFields, StatvfsData, XAttrNameT)

from ..base.aligned import Buffer
from ..errors import (AccessDenied, InternalError, InvalidArgument, KvfsError, NoData, NotFound, NotPermitted,
                     NotSupported)
from ..namespace import BY_HASH_INO, KEY_XATTR, META_DIR_INO, NAME_MAX, ROOT_INO, VIEW_BIT
from ..namespace.port import NamespacePort
from .blockmaps import BlockMaps
from .frontend import NativeReads
from .pagedrops import KernelPageDropper
from .pagefill import FILL_MOST, PageFiller

log = logging.getLogger(__name__)

assert ROOT_INO == pyfuse3.ROOT_INODE

STATS_XATTR = b"user.kvfs.stats"
CONTROL_XATTR = b"user.kvfs.control"
RESULT_XATTR = b"user.kvfs.result"     # what the caller's last control command answered
# How long the kernel may answer path walks and stat() from its own caches.
# Only this mount changes the namespace (multi-mount protection keeps other
# hosts out), and every change made through the kernel updates or drops what it
# caches: creates and unlinks replace entries (negative ones too), writes and
# truncations invalidate the attributes they change. The one change made behind
# its back is eviction, which drops the evicted names from the kernel itself
# (KvfsOperations.entry_removed). So the kernel may keep entries and attributes
# as long as ext4 keeps its own; an hour bounds what an unforeseen change could
# leave stale. With 1 s here, every stat() of a file not touched in the last
# second cost a GETATTR on the daemon's one loop thread (issue 10's stat rate).
ENTRY_TIMEOUT = 3600.0
ATTR_TIMEOUT = 3600.0
# Attributes that hold back a page-cache writer's mtime (kvfs/namespace/pagecache.py)
# go stale this soon, so a stat() that soon after the close shows the real mtime;
# not 0, because with auto_inval_data every read() of a file with stale attributes
# costs a GETATTR round trip first.
HELD_BACK_ATTR_TIMEOUT = 0.1
DOT_ENTRIES = 2             # "." and ".." lead every listing
STATFS_BSIZE = 4096          # LMCache uses O_DIRECT only if f_bsize divides its chunk size
BY_HASH_POLICIES = ("root", "owner")

F = TypeVar("F", bound=Callable[..., Any])


class Control(Protocol):
    """What the handlers ask of the daemon (kvfs/server/daemon.py, an application above this layer)."""
    def stats(self) -> dict[str, Any]: ...
    async def command(self, text: str) -> Any: ...     # a JSON-able answer, or None


def _errno_mapped(handler: F) -> F:
    @functools.wraps(handler)
    async def wrapper(self, *args):
        try:
            return await handler(self, *args)
        except Exception as exc:
            raise _fuse_error(handler.__name__, exc) from None
    return wrapper


def _fuse_error(handler_name: str, exc: Exception) -> pyfuse3.FUSEError:
    """The FUSEError that ``exc``, raised by a handler, becomes (call it in the ``except`` block: it logs)."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc
    if isinstance(exc, InternalError):
        log.exception("bug in %s", handler_name)
        return pyfuse3.FUSEError(errno.EIO)
    if isinstance(exc, KvfsError):
        if exc.errno in (errno.EIO, errno.EUCLEAN, errno.ENOSPC):
            log.warning("%s: %s", handler_name, exc)
        return pyfuse3.FUSEError(exc.errno)
    log.exception("internal error in %s", handler_name)
    return pyfuse3.FUSEError(errno.EIO)


class KvfsOperations(pyfuse3.Operations):
    """The FUSE surface. ``control`` answers stats and admin commands (the daemon).

    Privileged callers are root and the mount's owner (the daemon's uid, who can
    read the store anyway). Only they read the statistics, and with
    ``by_hash="root"`` (the default) only they may enter /.kvfs/by-hash. With
    ``by_hash="owner"`` anyone may, but sees only the files it owns, may read and
    can reach by some path (see Namespace._visible_sources).
    """

    enable_writeback_cache = False

    def __init__(self, namespace: NamespacePort, control: Control, *, by_hash: str = "root") -> None:
        super().__init__()
        if by_hash not in BY_HASH_POLICIES:
            raise ValueError(f"by_hash must be one of {BY_HASH_POLICIES}")
        self.ns = namespace
        self.block_size = namespace.block_size       # fixed by mkfs
        self.control = control
        self.by_hash = by_hash
        self.owner_uid = os.getuid()
        self._dir_handles: dict[int, tuple[int, Any]] = {}     # fh -> (ino, by-hash snapshot or None)
        self._next_dir_fh = 1
        self._results: dict[int, bytes] = {}     # caller pid -> JSON answer of its last control command
        self.page_dropper: Optional[KernelPageDropper] = None    # once mounted (kvfs/fuse/pagedrops.py)
        self.page_filler: Optional[PageFiller] = None            # once mounted (kvfs/fuse/pagefill.py)
        self.native: Optional[NativeReads] = None                # the native read plane (kvfs/fuse/frontend.py)
        self.native_direct_io = False    # read-only opens it serves bypass the page cache (native_direct_io)
        self.block_maps: Optional[BlockMaps] = None              # bypass readers' maps (kvfs/fuse/blockmaps.py)
        self.kernel_reads = 0            # READ requests from the kernel (page fills are not among them)
        self.kernel_lookups = 0          # LOOKUP and GETATTR requests: what the kernel could not answer
        self.kernel_getattrs = 0         # from its caches (see ENTRY_TIMEOUT)
        self.entry_invalidations = 0     # names dropped from the kernel's dentry cache (entry_removed)

    # -- attributes -----------------------------------------------------------
    def _entry(self, ino: InodeT) -> EntryAttributes:
        # Every LOOKUP and GETATTR the kernel sends makes one: each Python call
        # here costs about 1,000 instructions on the loop thread, so the
        # namespace answers in one call and the block size is kept.
        inode, view, mtime, held_back = self.ns.attr(ino)
        e = pyfuse3.EntryAttributes()        # generation 0
        e.st_ino = ino
        e.entry_timeout = ENTRY_TIMEOUT
        e.attr_timeout = ATTR_TIMEOUT
        e.st_mode = inode.mode & ~0o222 if view else inode.mode
        e.st_nlink = inode.nlink
        e.st_uid, e.st_gid, e.st_rdev = inode.uid, inode.gid, inode.rdev
        e.st_size = size = inode.size
        e.st_blksize = self.block_size
        e.st_blocks = (size + 511) // 512
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = inode.atime, mtime, inode.ctime
        if held_back:
            e.attr_timeout = HELD_BACK_ATTR_TIMEOUT
        if ino & VIEW_BIT:
            # Who may see a view entry depends on the caller, but the kernel's dentry
            # cache is shared by all: make it ask again on every path walk.
            e.entry_timeout = e.attr_timeout = 0
        elif ino == BY_HASH_INO and self.by_hash == "root":
            e.st_mode, e.st_uid = stat.S_IFDIR | 0o500, self.owner_uid
        return e

    def _privileged(self, ctx: Optional[RequestContext]) -> bool:
        return ctx is not None and ctx.uid in (0, self.owner_uid)

    def _view_caller(self, ctx: Optional[RequestContext]) -> Optional[tuple[int, int]]:
        """Who asks the by-hash view: None (sees all), (uid, gid), or EACCES."""
        if self._privileged(ctx):
            return None
        if self.by_hash != "owner" or ctx is None:
            raise AccessDenied("/.kvfs/by-hash is root-only on this mount")
        return ctx.uid, ctx.gid

    # lookup and getattr map their errors themselves (_fuse_error), without
    # _errno_mapped's second coroutine: they are most of the kernel's requests.
    async def lookup(self, parent_inode: InodeT, name: FileNameT,
                     ctx: Optional[RequestContext] = None) -> EntryAttributes:
        self.kernel_lookups += 1
        try:
            if parent_inode == BY_HASH_INO:
                return self._entry(await self.ns.lookup_view(name, self._view_caller(ctx)))
            try:
                return self._entry(self.ns.lookup(parent_inode, name))
            except NotFound:
                pass
        except Exception as exc:
            raise _fuse_error("lookup", exc) from None
        # Cache the miss in the kernel: engines probe for chunks that are not
        # there (os.path.exists), and only this mount changes the namespace, so
        # the kernel drops the negative entry itself when the name is created.
        miss = pyfuse3.EntryAttributes()
        miss.st_ino = 0
        miss.entry_timeout = ENTRY_TIMEOUT
        return miss

    async def forget(self, inode_list: Sequence[tuple[InodeT, int]]) -> None:
        for ino, count in inode_list:
            try:
                self.ns.forget(ino, count)
            except Exception:
                log.exception("forget(%d) failed", ino)

    async def getattr(self, inode: InodeT, ctx: Optional[RequestContext] = None) -> EntryAttributes:
        self.kernel_getattrs += 1
        try:
            return self._entry(inode)
        except Exception as exc:
            raise _fuse_error("getattr", exc) from None

    def entry_removed(self, parent_inode: InodeT, name: FileNameT, inode: InodeT) -> None:
        """A name was removed behind the kernel's back (eviction): drop it from the kernel's dentry cache.

        Without this the kernel would answer stat() and open() of the name from
        its cache for up to ENTRY_TIMEOUT. The drop runs in pyfuse3's notify
        thread: the kernel takes the directory's lock for it, and a request
        holding that lock may be waiting for this very loop.
        """
        self.entry_invalidations += 1
        pyfuse3.invalidate_entry_async(parent_inode, name, deleted=inode, ignore_enoent=True)

    @_errno_mapped
    async def setattr(self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields, fh: Optional[FileHandleT],
                      ctx: RequestContext) -> EntryAttributes:
        if fields.update_size and self.page_filler is not None:
            async with self.page_filler.fenced(inode):
                return await self._setattr(inode, attr, fields)
        return await self._setattr(inode, attr, fields)

    async def _setattr(self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields) -> EntryAttributes:
        await self.ns.setattr(
            inode,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime=attr.st_atime_ns if fields.update_atime else None,
            mtime=attr.st_mtime_ns if fields.update_mtime else None)
        return self._entry(inode)

    @_errno_mapped
    async def readlink(self, inode: InodeT, ctx: RequestContext) -> FileNameT:
        return self.ns.readlink(inode)

    # -- names ----------------------------------------------------------------
    @_errno_mapped
    async def mknod(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        return self._entry(self.ns.make(parent_inode, name, mode, ctx.uid, ctx.gid, rdev))

    @_errno_mapped
    async def mkdir(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, ctx: RequestContext) -> EntryAttributes:
        return self._entry(self.ns.make(parent_inode, name, stat.S_IFDIR | (mode & 0o7777), ctx.uid, ctx.gid))

    @_errno_mapped
    async def symlink(self, parent_inode: InodeT, name: FileNameT, target: FileNameT,
                      ctx: RequestContext) -> EntryAttributes:
        return self._entry(self.ns.make(parent_inode, name, stat.S_IFLNK | 0o777, ctx.uid, ctx.gid,
                                        target=bytes(target)))

    @_errno_mapped
    async def link(self, inode: InodeT, new_parent_inode: InodeT, new_name: FileNameT,
                   ctx: RequestContext) -> EntryAttributes:
        return self._entry(self.ns.link(inode, new_parent_inode, new_name))

    @_errno_mapped
    async def unlink(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        self.ns.unlink(parent_inode, name, directory=False)

    @_errno_mapped
    async def rmdir(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        self.ns.unlink(parent_inode, name, directory=True)

    @_errno_mapped
    async def rename(self, parent_inode_old: InodeT, name_old: FileNameT, parent_inode_new: InodeT,
                     name_new: FileNameT, flags: FlagT, ctx: RequestContext) -> None:
        if flags & ~pyfuse3.RENAME_NOREPLACE:
            raise InvalidArgument("only RENAME_NOREPLACE is supported")
        await self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                       noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE))

    # -- files ----------------------------------------------------------------
    @_errno_mapped
    async def create(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, flags: FlagT,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        ino = self.ns.make(parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx.uid, ctx.gid)
        fh, direct_io, keep_cache = self.ns.open(ino, flags, privileged=ctx.uid == 0)
        return pyfuse3.FileInfo(fh=fh, direct_io=direct_io, keep_cache=keep_cache), self._entry(ino)

    @_errno_mapped
    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        if self.page_filler is None:
            return self._open(inode, flags, ctx)
        if (flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC:
            # The content may change from here on: no page fill may still be storing the old bytes.
            async with self.page_filler.fenced(inode):
                return self._open(inode, flags, ctx)
        info = self._open(inode, flags, ctx)
        size = self.ns.page_fill_size(info.fh, FILL_MOST)
        if size:
            try:
                info.keep_cache, whole = await self.page_filler.fill(
                    inode, size, lambda off, length: self.ns.read(info.fh, off, length), self.ns.views_held,
                    info.keep_cache)
                if whole:
                    self.ns.page_fill_done(info.fh, size)
            except Exception:
                # The open itself succeeded (its handle exists): answer it; the pages
                # stored so far are the file's bytes, and without keep_cache they go.
                log.exception("page fill of inode %d failed", inode)
        return info

    def _open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        # uid 0 stands in for CAP_FSETID (FUSE does not pass capabilities).
        if self.native is not None and (flags & os.O_ACCMODE) != os.O_RDONLY:
            # A writer's READs must reach the namespace, which tracks the pages a
            # page-cache writer's reads refetch (kvfs/namespace/pagecache.py).
            self.native.withdraw(inode)
        fh, direct_io, keep_cache = self.ns.open(inode, flags, privileged=ctx.uid == 0)
        if self.native is not None and self._publish(fh) and self.native_direct_io and not flags & os.O_DIRECT:
            # The reader's bytes go from the native reply straight into its buffer,
            # not through 4 KiB page-cache fills (about 1 CPU-s/GB of kernel time).
            # Not for O_DIRECT opens: the kernel sends a direct_io file's read() one
            # READ at a time, but an O_DIRECT read of a cached file all at once
            # (async dio), which a single reader needs to keep the device busy.
            direct_io = True
        return pyfuse3.FileInfo(fh=fh, direct_io=direct_io, keep_cache=keep_cache)

    def _publish(self, fh: int) -> bool:
        """Let the native read plane answer this file's READs, if the namespace says it may."""
        extents = self.ns.native_extents(fh)
        if extents is None:
            return False
        try:
            self.native.publish(extents.ino, extents.generation, extents.size, extents.block_size,
                                extents.blocks)
        except (ValueError, TypeError, MemoryError) as exc:
            # A bug, not the caller's: its READs go to Python, which serves them.
            log.error("inode %d: could not publish it to the native read plane: %s", extents.ino, exc)
            return False
        return True

    @_errno_mapped
    async def read(self, fh: FileHandleT, off: int, size: int) -> Buffer:
        self.kernel_reads += 1
        if self.native is not None:
            self._publish(fh)          # sealed since its open: the next READs need no Python
        return await self.ns.read(fh, off, size)

    @_errno_mapped
    async def write(self, fh: FileHandleT, off: int, buf: Buffer) -> int:
        written = await self.ns.write(fh, off, buf)
        # Pages a read may have refetched with older bytes while the kernel was
        # copying this write into them (kvfs/namespace/pagecache.py).
        ino, stale = await self.ns.stale_kernel_pages(fh, off, written)
        if stale and self.page_dropper is not None:
            await self.page_dropper.drop(ino, stale)
        return written

    async def flush(self, fh: FileHandleT) -> None:
        # close() returns at memory speed: data is written back in the background,
        # so flush has nothing to do. ENOSYS makes the kernel stop sending it,
        # which saves one round trip per close() (a quarter of a create's cost).
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_errno_mapped
    async def release(self, fh: FileHandleT) -> None:
        await self.ns.release(fh)

    @_errno_mapped
    async def fsync(self, fh: FileHandleT, datasync: bool) -> None:
        await self.ns.fsync(fh)

    # -- directories ----------------------------------------------------------
    @_errno_mapped
    async def opendir(self, inode: InodeT, ctx: RequestContext) -> FileHandleT:
        self.ns.attr(inode)
        fh = self._next_dir_fh
        self._next_dir_fh += 1
        # The by-hash listing is a snapshot per handle and per caller, so its offsets stay stable.
        snapshot = await self.ns.view_listing(self._view_caller(ctx)) if inode == BY_HASH_INO else None
        self._dir_handles[fh] = (inode, snapshot)
        return fh

    @_errno_mapped
    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken) -> None:
        # Offsets 1 and 2 are "." and ".."; the namespace's cookies follow,
        # shifted by DOT_ENTRIES. The kernel takes no lookup reference for the
        # two dot entries, so they are not counted.
        ino, snapshot = self._dir_handles[fh]
        for offset, name, target in ((1, b".", ino), (2, b"..", self.ns.parent_of(ino))):
            if start_id < offset and not pyfuse3.readdir_reply(token, name, self._entry(target), offset):
                return
        after = max(start_id - DOT_ENTRIES, 0)
        entries = snapshot[after:] if snapshot is not None else self.ns.list_dir(ino, after)
        for name, child, cookie in entries:
            try:
                attrs = self._entry(child)
            except KvfsError:
                continue                       # removed while we were listing
            if not pyfuse3.readdir_reply(token, name, attrs, cookie + DOT_ENTRIES):
                break
            self.ns.count_lookup(child)

    @_errno_mapped
    async def releasedir(self, fh: FileHandleT) -> None:
        _, snapshot = self._dir_handles.pop(fh, (None, None))
        if snapshot is not None:
            self.ns.release_view_listing(snapshot)

    @_errno_mapped
    async def fsyncdir(self, fh: FileHandleT, datasync: bool) -> None:
        await self.ns.commit()

    @_errno_mapped
    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        space = self.ns.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = STATFS_BSIZE
        s.f_blocks = space.capacity_bytes // STATFS_BSIZE
        s.f_bfree = s.f_bavail = space.available_bytes // STATFS_BSIZE
        s.f_files = space.inodes
        s.f_ffree = s.f_favail = space.free_inodes
        s.f_namemax = NAME_MAX
        return s

    # -- extended attributes: content keys and the admin channel -------------
    @_errno_mapped
    async def getxattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> bytes:
        if inode == ROOT_INO and name == STATS_XATTR:
            if not self._privileged(ctx):
                raise AccessDenied("statistics are readable by root and the mount's owner only")
            return json.dumps(self.control.stats(), sort_keys=True).encode()
        if inode == ROOT_INO and name == RESULT_XATTR and ctx.pid in self._results:
            # Kept, not popped: the kernel may ask twice (first with a buffer too small).
            return self._results[ctx.pid]
        if self.block_maps is not None and self.block_maps.handles(name):
            return await self.block_maps.answer(inode, name, ctx)
        if name == KEY_XATTR:
            key = await self.ns.content_key(inode)      # the key names sealed content only
            if key is not None:
                return key.hex().encode()
        raise NoData()

    @_errno_mapped
    async def listxattr(self, inode: InodeT, ctx: RequestContext) -> list[XAttrNameT]:
        names = []
        if self.ns.inode(inode).is_file:
            names.append(KEY_XATTR)
        if inode == ROOT_INO and self._privileged(ctx):
            names.append(STATS_XATTR)
        return names

    @_errno_mapped
    async def setxattr(self, inode: InodeT, name: XAttrNameT, value: bytes, ctx: RequestContext) -> None:
        # On /.kvfs as well as on the root: the kernel holds the inode lock of
        # the one it names for the whole command, and on the root that stalls
        # every lookup and create there (kvfs-admin sends to /.kvfs).
        if inode in (ROOT_INO, META_DIR_INO) and name == CONTROL_XATTR:
            if not self._privileged(ctx):
                raise NotPermitted("kvfs control commands need root or the mount's owner")
            result = await self.control.command(bytes(value).decode("utf-8", "replace"))
            if result is not None:
                self._results.pop(ctx.pid, None)
                if len(self._results) >= 64:
                    self._results.pop(next(iter(self._results)))     # the oldest caller's answer
                self._results[ctx.pid] = json.dumps(result).encode()
            return
        raise NotSupported("kvfs stores no extended attributes")

    @_errno_mapped
    async def removexattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> None:
        raise NotSupported("kvfs stores no extended attributes")
