"""The by-hash view: ``/.kvfs/by-hash/<content key>``, RAM only.

Each entry is a :class:`ViewInode` for one (content key, source inode) pair,
numbered ``VIEW_BIT | n`` with ``n`` never reused in the life of the mount. A
view's content never changes: its first open builds an immutable FileData from
the source's committed block list (pinned in the block index until the last
close), so the kernel may keep its pages forever; if the source no longer holds
that content, the open fails with ENOENT. Who may see which entries is decided
by the caller (fuseops): ``caller=None`` sees every content, ``(uid, gid)`` only
files it owns, may read, and reaches through directories it may search.
"""
import trio

from ..blockcache import FileData
from ..blockcache.port import CachePort
from ..errors import CorruptBlock, NotFound
from ..schema.port import JournalPort
from .inodes import ROOT_INO, VIEW_BIT, ViewInode
from .tree import Tree


class ByHashView:
    journal: JournalPort

    def __init__(self, tree: Tree, cache: CachePort, journal: JournalPort) -> None:
        self.tree = tree
        self.cache, self.journal = cache, journal
        self.views = {}            # view inode number -> ViewInode
        self._view_of = {}         # (content key, source ino) -> view inode number
        self._next_view = 1

    def inode(self, ino: int) -> ViewInode:
        view = self.views.get(ino)
        if view is None:
            raise NotFound()
        return view

    def lookup_all(self, name: bytes) -> int:
        """by-hash lookup for a caller that may see every content (root)."""
        key = self._key_of_name(name)
        self.tree.content.ready_now()
        holders = self.tree.content_owners(key)
        if not holders:
            raise NotFound()
        view = self._view(key, self.tree.inodes[min(holders)])
        view.lookups += 1
        return view.ino

    async def lookup(self, name: bytes, caller: tuple[int, int] | None) -> int:
        """Resolve by-hash/<name> for ``caller``: None (sees all) or (uid, gid)."""
        await self.tree.content.ready()
        if caller is None:
            return self.lookup_all(name)
        key = self._key_of_name(name)
        found = await self._visible_sources(caller, {key})
        if key not in found:
            raise NotFound()
        view = self._view(key, self.tree.inodes[found[key]])
        view.lookups += 1
        return view.ino

    async def listing(self, caller: tuple[int, int] | None) -> list[tuple[bytes, int, int]]:
        """The by-hash entries ``caller`` may see, as (name, view ino, cookie).

        Each entry is held until :meth:`release_listing`, so a listing's
        inode numbers stay valid while it is read.
        """
        await self.tree.content.ready()
        if caller is None:
            sources = {}
            for n, key in enumerate(list(self.tree.content.by_content)):
                if n % 1024 == 1023:
                    await trio.lowlevel.checkpoint()
                holders = self.tree.content_owners(key)      # now: it may have changed while we yielded
                if holders:
                    sources[key] = min(holders)
        else:
            sources = await self._visible_sources(caller)
        listing = []
        for key in sorted(sources):
            source = self.tree.inodes.get(sources[key])
            if source is None or source.content_key != key:
                continue                            # changed while we yielded
            view = self._view(key, source)
            view.holds += 1
            listing.append((key.hex().encode(), view.ino, len(listing) + 1))
        return listing

    def release_listing(self, listing: list[tuple[bytes, int, int]]) -> None:
        for _, ino, _ in listing:
            view = self.views.get(ino)
            if view is not None:
                view.holds -= 1
                self.maybe_drop(view)

    @staticmethod
    def _key_of_name(name):
        try:
            key = bytes.fromhex(name.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            raise NotFound() from None
        if len(key) != 16:
            raise NotFound()
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

    def maybe_drop(self, view: ViewInode) -> None:
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
        for key in (self.tree.content.by_content if keys is None else keys):
            for ino in self.tree.content_owners(key):
                inode = self.tree.inodes[ino]
                if inode.uid == uid and inode.mode & 0o400:
                    wanted[ino] = key
        found = {}                                  # ino -> (directory, name)
        root = self.tree.inodes[ROOT_INO]
        todo, seen, steps = [root], set(), 0
        while todo and wanted and len(found) < len(wanted) and self._may(root, uid, gid, 1):
            directory = todo.pop()
            if directory.ino in seen or directory.ino not in self.tree.inodes:
                continue
            seen.add(directory.ino)
            for name, ino in directory.entries.items():
                steps += 1
                if steps % 4096 == 0:
                    await trio.lowlevel.checkpoint()
                if ino in wanted:
                    found.setdefault(ino, (directory, name))
                    continue
                child = self.tree.inodes.get(ino)
                if child is not None and child.is_dir and self._may(child, uid, gid, 1):
                    todo.append(child)
        sources = {}
        for ino, (directory, name) in sorted(found.items()):
            inode = self.tree.inodes.get(ino)
            key = wanted[ino]
            if (inode is not None and inode.content_key == key and inode.uid == uid
                    and inode.mode & 0o400 and directory.entries.get(name) == ino
                    and self._reachable(directory, uid, gid)):
                sources.setdefault(key, ino)
        return sources

    def _reachable(self, directory, uid, gid):
        """Whether the caller may search ``directory`` and every directory above it."""
        while directory is not None and directory.ino in self.tree.inodes:
            if not self._may(directory, uid, gid, 1):
                return False
            if directory.ino == ROOT_INO:
                return True
            directory = self.tree.inodes.get(directory.parent)
        return False

    def forget(self, ino: int, count: int) -> None:
        view = self.views.get(ino)
        if view is not None:
            view.lookups = max(0, view.lookups - count)
            self.maybe_drop(view)

    def open_data(self, view: ViewInode) -> FileData:
        """The immutable content of a by-hash entry: exactly what its key names, or ENOENT if it is gone."""
        if view.data is None:
            source = self.tree.inodes.get(view.source)
            if source is None or source.content_key != view.content_key:
                raise NotFound("that content is no longer stored")
            if any(k is not None and not self.journal.has_block(k) for k in source.committed):
                raise CorruptBlock("that content names blocks missing from the index")
            view.data = FileData(source.size_committed, source.committed)
            self.cache.attach(view.data)
        self.cache.prefetch(view.data)
        return view.data
