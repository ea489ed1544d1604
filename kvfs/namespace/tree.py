"""The durable namespace: inodes and entries as the records build them, load and snapshot.

Every change to durable state is a record (``kvfs.schema``). Live operations
validate their arguments, build a record and hand it to ``Namespace._emit``,
which journals it and applies it with the very same :meth:`Tree.apply` that
mount uses to replay the journal, so replay cannot drift from live behaviour.

A file's content record is written only when all its blocks are on the device
(after close, fsync or ``kvfs-admin flush``), so after a crash a file shows
either an older complete content or the new complete content, never a mix.
A regular file is *provisional* from its Make record until its first Content
record: another file's fsync may make the create durable while this file is
still being written. Load drops every file still provisional after replay, so
after a crash such a file is absent, never empty.

Invariants (checked by fsck): every directory entry names an inode in
``inodes``; every inode but the root is reachable; ``nlink`` equals the number
of entries naming it (directories: 2 + subdirectories); inode numbers are never
reused (``next_ino`` only grows).

The tree takes block references, keys and domains from the journal port
(kvfs/schema/port.py, the block index), and pins live contents in the block
cache; fsck loads a tree with no cache (``cache`` None): nothing is pinned.
"""
import logging
import stat
from stat import S_IFDIR, S_IFREG
from typing import Any, Callable, Optional

from .. import schema
from ..base.sharedints import shared
from ..blockcache import BlockCache, FileData
from ..errors import CorruptBlock, FormatError, NotADirectory, NotFound, Stale
from ..schema.port import JournalPort
from .contentindex import ContentIndex
from .cut import TreeCut
from .idle import build_live_data
from .inodes import (DIR_ENTRY_COST, FILE_KEY_COST, FIRST_INO, INDEX_BLOCK_COST, INODE_ROW_COST, ROOT_INO,
                     Inode, add_name, drop_name)
from .treeload import load_rows

log = logging.getLogger(__name__)


class Tree:
    journal: JournalPort

    def __init__(self, journal: JournalPort, now: Callable[[], int], cache: Optional[BlockCache] = None) -> None:
        self.journal, self.cache = journal, cache
        self.now = now
        self.inodes = {}           # durable inodes
        self.orphans = {}          # unlinked but still open or looked up
        self.content = ContentIndex(journal, self.inodes)    # built on first use (contentindex.py)
        self.next_ino = FIRST_INO
        self.loading = True        # during replay nothing is held in RAM yet
        self.pinned = set()        # files never evicted (durable: the checkpoint's "pinned")
        self.on_drop = None        # called with an inode that left the durable namespace
        self._meta_bytes = 0       # inode rows, entries, targets, block lists (see INODE_ROW_COST)
        self._cut = None           # a checkpoint's TreeCut while its rows are being built
        # Kept as they change, so statistics never walk a million inodes on the event loop.
        self.file_count = self.dir_count = 0
        self.committed_bytes = 0   # sum of the regular files' recorded content sizes

    # -- lookups --------------------------------------------------------------
    def inode(self, ino: int) -> Inode:
        inode = self.inodes.get(ino) or self.orphans.get(ino)
        if inode is None:
            raise NotFound()
        if inode.evicted:
            # Eviction removed it behind the kernel's back: the kernel may still hold the
            # name's entry (entry_timeout). ENOENT would fail open(O_CREAT) of that name;
            # ESTALE makes the kernel drop the entry and look the name up again.
            raise Stale("the file was evicted")
        return inode

    def dir(self, ino: int) -> Inode:
        inode = self.inode(ino)
        if not inode.is_dir:
            raise NotADirectory()
        return inode

    # -- load and snapshot ------------------------------------------------------
    def load(self, state: schema.CheckpointState, records: list[Any], *, skip_failures: bool = False,
             consume: bool = False) -> int:
        """Build the tree from a CheckpointState and the replayed records.

        With ``skip_failures`` (fsck salvaging a damaged store) a record that
        does not apply is skipped and counted; returns the number skipped.
        With ``consume`` (mount) each row is dropped from ``state.inodes`` once
        it is an Inode, so the rows and the tree are not both in memory whole.
        """
        assert self._cut is None and not self.inodes and not self.content.built, "load builds a new tree"
        self.next_ino = state.next_ino
        # state.inodes: a list, or a stream decoded as it goes (kvfs/schema/stream.py)
        rows_miss_blocks = load_rows(self, state.inodes, consume=consume)
        for ino in state.provisional:
            if ino in self.inodes and self.inodes[ino].is_file:     # only files can be provisional
                self.inodes[ino].provisional = True
        self.pinned = set(state.pinned)
        top = max(self.inodes, default=0)
        if top >= self.next_ino and not skip_failures:
            # A checkpoint's next_ino is above every inode in it (numbers are never
            # reused). Mounting one that is not would hand out numbers in use, and a
            # checkpoint cut leaves out inodes at or above next_ino (kvfs/namespace/cut.py).
            raise FormatError(f"checkpoint next inode number {self.next_ino} is not above inode {top} "
                              f"in use: run fsck.kvfs --repair")
        if ROOT_INO not in self.inodes:     # a fresh filesystem: mkfs writes an empty state
            root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, 0, 0, now=self.now())
            root.parent = ROOT_INO
            self.inodes[ROOT_INO] = root
        skipped = replayed = 0
        for replayed, record in enumerate(records, 1):
            if not skip_failures:
                self.apply(record)
                continue
            try:
                self.apply(record)
            except Exception:               # noqa: BLE001 - salvage: whatever does not apply is skipped
                skipped += 1
        self._drop_provisional()
        self.pinned &= self.inodes.keys()
        self._finish_load(check_keys=replayed or rows_miss_blocks)
        return skipped

    def _finish_load(self, check_keys):
        """One pass over the loaded inodes: eviction's names, the running counts, missing blocks.

        One pass, not one per purpose: at a million inodes each pass over them
        costs a remount about a second. ``check_keys``: whether a file may name
        a block the index lacks; not when every row's blocks were found and no
        record was replayed since (a clean unmount leaves none): a million
        lookups less.
        """
        inodes, cost_of = self.inodes, self._inode_cost
        stored_keys, domain_of = self.journal.stored_keys, self.journal.domain_of
        meta = files = dirs = committed_bytes = 0
        for inode in inodes.values():
            kind = inode.mode & 0o170000
            if kind != S_IFREG:
                meta += cost_of(inode)
                if kind == S_IFDIR:
                    dirs += 1
                    ino, entries = inode.ino, inode.entries
                    for name, node in zip(list(entries.names()), map(inodes.get, entries.inos())):
                        if node is None:
                            continue
                        known = node.names
                        if known == ():             # add_name's first name, inline: one per file
                            node.name_dir, node.names = ino, name
                        elif known is not None:     # None: a directory, named by its parent
                            add_name(node, (ino, name))
            else:                       # most inodes; _inode_cost of a file, inline
                keys = inode._committed     # (not .committed: a tuple made a file for its length)
                meta += INODE_ROW_COST + FILE_KEY_COST * (len(keys) if type(keys) is tuple else 1)
                files += 1
                committed_bytes += inode.size_committed
                if not check_keys:
                    continue
                # The index's key objects (as treeload's _load_file): one key object per block.
                # Its live content stays unbuilt until an open (namespace/idle.py),
                # but for a file whose blocks are missing: that one fails its reads.
                committed = inode.committed
                present = tuple(stored_keys(committed))
                if present == committed:
                    inode.committed = present
                    continue
                inode.committed = tuple([p if p is not None else k for p, k in zip(present, committed)])
                log.error("inode %d names blocks missing from the index: reads give EIO", inode.ino)
                inode.data = FileData(inode.size_committed, present, domain_of(inode.uid))
                inode.data.failed = CorruptBlock
                if self.cache is not None:
                    self.cache.attach(inode.data)
        self._meta_bytes, self.file_count, self.dir_count, self.committed_bytes = meta, files, dirs, committed_bytes
        self.loading = False

    def _recount(self):
        """The running counts from scratch (tests compare them with the kept ones; load counts in _finish_load)."""
        files = [i for i in self.inodes.values() if i.is_file]
        self.file_count, self.committed_bytes = len(files), sum(i.size_committed for i in files)
        self.dir_count = sum(1 for i in self.inodes.values() if i.is_dir)

    def _drop_provisional(self):
        """Remove files whose content was never recorded: they were in flight at a crash."""
        # _rare None: every rare field, provisional among them, is at its default
        # (inodes.py); a million property calls less at a remount.
        doomed = {ino for ino, inode in self.inodes.items() if inode._rare is not None and inode.provisional}
        if not doomed:
            return
        for directory in [i for i in self.inodes.values() if i.is_dir]:
            for name in [n for n, child in directory.entries.items() if child in doomed]:
                directory.entries.remove(name)
        for ino in doomed:
            self.content.forget(self.inodes.pop(ino))
        log.info("dropped %d file(s) created but never closed or fsynced before the crash", len(doomed))

    def cut(self) -> TreeCut:
        """Take a copy-on-write cut for a checkpoint (kvfs/namespace/cut.py); ``end_cut`` ends it."""
        assert self._cut is None, "one checkpoint at a time"
        self._cut = TreeCut(self)
        return self._cut

    def end_cut(self) -> None:
        self._cut = None

    def preserve(self, inode: Inode) -> None:
        """Called before a durable field of ``inode`` changes (the cut keeps the old value)."""
        if self._cut is not None:
            self._cut.preserve(inode)

    def _preserve_name(self, directory, name):
        if self._cut is not None:
            self._cut.preserve(directory)
            self._cut.preserve_name(directory, name)

    def snapshot(self) -> schema.CheckpointState:
        """The namespace's part of a CheckpointState, synchronously (fsck; checkpoints use ``cut``).

        A cut built at once, with nothing changing meanwhile, is exactly that state."""
        return TreeCut(self, listed_now=True).build()

    # -- record application (shared by live operations and replay) ----------
    def apply(self, rec: Any) -> None:
        """Apply one record. A record that cannot apply to this tree (an unknown inode, a
        name that is taken or missing, a directory moved into itself) raises FormatError
        before anything changes: replay of a damaged or crafted journal stops there."""
        if isinstance(rec, schema.Make):
            directory = self._dir_for(rec, rec.parent, rec.name, present=False)
            if rec.ino in self.inodes or rec.ino in self.orphans:
                raise FormatError(f"{rec!r:.80}: inode {rec.ino} exists already")
            inode = Inode(rec.ino, rec.mode, rec.uid, rec.gid, rec.rdev, rec.ns)
            inode.target = rec.target
            self.inodes[rec.ino] = inode
            self.file_count += inode.is_file
            self.dir_count += inode.is_dir
            self._meta_bytes += INODE_ROW_COST + len(rec.target or b"")
            self.next_ino = max(self.next_ino, rec.ino + 1)
            self._link(directory, rec.name, inode, rec.ns)
            if inode.is_file:
                if not self.loading:        # replay builds none: load leaves files idle (idle.py)
                    inode.data = FileData(domain=self.journal.domain_of(inode.uid))
                self._set_committed(inode, 0, ())
                inode.provisional = True
        elif isinstance(rec, schema.Link):
            inode = self._known(rec, rec.ino)
            if inode.is_dir:
                raise FormatError(f"{rec!r:.80}: a hard link to a directory")
            self._link(self._dir_for(rec, rec.parent, rec.name, present=False), rec.name, inode, rec.ns)
            inode.nlink += 1
            inode.ctime = rec.ns
        elif isinstance(rec, schema.Remove):
            directory = self._dir_for(rec, rec.parent, rec.name, present=True)
            victim = self._known(rec, directory.entries.get(rec.name))
            if victim.is_dir and len(victim.entries):
                raise FormatError(f"{rec!r:.80}: removes a directory that is not empty")
            self._unlink(directory, rec.name, rec.ns)
        elif isinstance(rec, schema.Move):
            src_dir = self._dir_for(rec, rec.old_parent, rec.old_name, present=True)
            dst_dir = self._dir_for(rec, rec.new_parent, rec.new_name, present=None)
            inode = self._known(rec, src_dir.entries.get(rec.old_name))
            self._check_move(rec, inode, dst_dir)
            if dst_dir.entries.get(rec.new_name) is not None:
                self._unlink(dst_dir, rec.new_name, rec.ns)
            self._unlink(src_dir, rec.old_name, rec.ns, keep=True)
            self._link(dst_dir, rec.new_name, inode, rec.ns)
            inode.ctime = rec.ns
        elif isinstance(rec, schema.Attrs):
            inode = self._known(rec, rec.ino)
            if stat.S_IFMT(rec.mode) != stat.S_IFMT(inode.mode):
                raise FormatError(f"{rec!r:.80}: changes the file type of inode {rec.ino}")
            self.preserve(inode)
            inode.mode, inode.uid, inode.gid = rec.mode, rec.uid, rec.gid
            if inode.data is not None:      # new blocks go to the new owner's dedup domain
                inode.data.domain = self.journal.domain_of(inode.uid)
            inode.atime, inode.mtime, inode.ctime = rec.atime, rec.mtime, rec.ctime
        elif isinstance(rec, schema.Content):
            inode = self._known(rec, rec.ino)
            if not inode.is_file:
                raise FormatError(f"{rec!r:.80}: inode {rec.ino} is not a regular file")
            self.preserve(inode)
            for block in rec.blocks:
                if block is not None:
                    self.journal.add_ref(block.key, block.off, block.length, block.domain)
            for key in inode.committed:
                if key is not None:
                    self.journal.drop_ref(key)
            self._set_committed(inode, rec.size, tuple(None if b is None else b.key for b in rec.blocks))
            inode.mtime, inode.ctime = rec.mtime, rec.ctime
            inode.provisional = False
        else:
            raise FormatError(f"unknown journal record {rec!r:.60}")

    def _known(self, rec, ino):
        inode = self.inodes.get(ino)
        if inode is None:
            raise FormatError(f"{rec!r:.80}: names inode {ino}, which does not exist")
        return inode

    def _dir_for(self, rec, ino, name, *, present):
        """The directory ``ino`` of a record; ``present``: must ``name`` be in it (None: either)."""
        directory = self._known(rec, ino)
        if not directory.is_dir:
            raise FormatError(f"{rec!r:.80}: inode {ino} is not a directory")
        if present is not None and (directory.entries.get(name) is not None) != present:
            raise FormatError(f"{rec!r:.80}: {'no' if present else 'an'} entry {name!r} in directory {ino}")
        return directory

    def _check_move(self, rec, inode, dst_dir):
        victim = self.inodes.get(dst_dir.entries.get(rec.new_name))
        if victim is not None and victim is not inode and (
                victim.is_dir != inode.is_dir or (victim.is_dir and len(victim.entries))):
            raise FormatError(f"{rec!r:.80}: cannot replace {rec.new_name!r}")
        if victim is inode:
            raise FormatError(f"{rec!r:.80}: renames an entry onto itself")
        if inode.is_dir:
            up, steps = dst_dir, 0
            while up.ino != ROOT_INO and steps <= len(self.inodes):   # bounded: a damaged tree may loop
                if up is inode:
                    raise FormatError(f"{rec!r:.80}: moves a directory into itself")
                up, steps = self.inodes.get(up.parent), steps + 1
                if up is None:
                    break

    def _link(self, directory, name, inode, ns):
        self._preserve_name(directory, name)
        self.preserve(inode)
        directory.entries.add(name, inode.ino)
        if inode.names is not None and not self.loading:
            add_name(inode, (directory.ino, name))
        self._meta_bytes += DIR_ENTRY_COST + len(name)
        directory.mtime = directory.ctime = ns
        if inode.is_dir:
            inode.parent = directory.ino
            directory.nlink += 1

    def _unlink(self, directory, name, ns, keep=False):
        inode = self.inodes[directory.entries.get(name)]
        self._preserve_name(directory, name)
        self.preserve(inode)
        directory.entries.remove(name)
        if inode.names is not None:
            drop_name(inode, (directory.ino, name))
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
        if self._cut is not None:
            self._cut.forget(inode)
        del self.inodes[inode.ino]
        self.file_count -= inode.is_file
        self.dir_count -= inode.is_dir
        if inode.is_file:
            self.committed_bytes -= inode.size_committed
        self.pinned.discard(inode.ino)
        if self.on_drop is not None:
            self.on_drop(inode)
        self._meta_bytes -= INODE_ROW_COST + len(inode.target or b"") + FILE_KEY_COST * len(inode.committed)
        orphan = inode.lookups or inode.opens
        if inode.is_file:
            if orphan and inode.data is None and not inode.evicted and not self.loading:
                build_live_data(inode, self.journal, self.cache)    # the kernel may still open it (idle.py)
            for key in inode.committed:
                if key is not None:
                    self.journal.drop_ref(key)
            self.content.forget(inode)
            inode.committed = ()
        if orphan:
            self.orphans[inode.ino] = inode
            if inode.evicted and inode.data is not None and not self.loading:
                # Nobody has it open, and a cached lookup may not reach it any more:
                # its blocks go now, not when the kernel forgets the inode.
                self._release(inode.data)
                inode.data = None
        else:
            self.destroy(inode)

    def destroy(self, inode: Inode) -> None:
        """Nothing refers to the inode any more: let go of its live content."""
        self.orphans.pop(inode.ino, None)
        if inode.data is not None and not self.loading:
            self._release(inode.data)

    def _release(self, data):
        if self.cache is not None:
            self.cache.release(data)

    def maybe_destroy(self, inode: Inode) -> None:
        if inode.ino in self.orphans and not inode.lookups and not inode.opens:
            self.destroy(inode)

    def _set_committed(self, inode, size, keys):
        self.preserve(inode)
        self._meta_bytes += FILE_KEY_COST * (len(keys) - len(inode.committed))
        if inode.ino in self.inodes:
            self.committed_bytes += size - inode.size_committed
        inode.committed = keys
        inode.size_committed = shared(size)
        self.content.committed(inode)

    def content_owners(self, key: bytes) -> set[int] | tuple[int, ...]:
        return self.content.owners(key)

    def has_copies(self, inode: Inode) -> bool:
        """Whether another file holds ``inode``'s committed content (builds the index, without yielding)."""
        self.content.ready_now()
        return len(self.content.owners(self.content.key(inode))) > 1

    # -- metadata space ---------------------------------------------------------
    @staticmethod
    def _inode_cost(inode):
        cost = INODE_ROW_COST + len(inode.target or b"") + FILE_KEY_COST * len(inode.committed)
        if inode.is_dir:
            cost += sum(DIR_ENTRY_COST + len(name) for name in inode.entries.names())
        return cost

    def recount_metadata(self) -> int:
        """The running count recomputed from scratch (tests compare the two)."""
        return sum(self._inode_cost(i) for i in self.inodes.values())

    def metadata_bytes(self) -> int:
        """Estimated (upper bound) checkpoint size of the durable state."""
        return self._meta_bytes + INDEX_BLOCK_COST * self.journal.block_count() + 4096

