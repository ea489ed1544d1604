"""The namespace's side of the shared tier (kvfs/tier/): publish sealed files, fill misses.

The namespace holds the tier only as :class:`kvfs.namespace.port.TierPort` (wired by
kvfs/server/stack.py; None without ``tier=``), and imports nothing of it.

- **Publishing.** When a file's last writer closes, its seal is scheduled as
  always; with a tier, a task waits for that seal and offers the file
  (``TierPort.offer``, which never awaits: a full queue drops the offer). The
  reader handed over resolves the file's name and reads its content when its turn
  comes, so a file written under a temporary name and renamed is published under
  the name it has then; a file changed or removed by then is skipped.
- **A lookup miss.** ``lookup_remote`` asks the tier for the path (within the
  tier's deadline; None is a miss). Verified content is written to a new file
  under a hidden temporary name in the same directory, through the normal write
  path (which keys its blocks with this store's own keys), and renamed onto the
  name without replacing: no reader ever sees it half written. The rename does
  not wait for the seal (the file stays provisional until then, so a crash drops
  it, name and all). Fetched files are not published back. The first read-only
  open then places the file in the kernel's page cache, as an open of a file cold
  on the device does: its reader's read() copies from there instead of one READ
  at a time through the event loop.
"""
from __future__ import annotations

import os
import stat
from typing import Optional

import trio

from ..errors import Exists, KvfsError, NotFound
from .inodes import BY_HASH_INO, META_DIR_INO, ROOT_INO, VIEW_BIT, names_of
from .port import TierPort

FETCH_PREFIX = b".kvfs-tier-fetch-"


class TierLink:
    tier: Optional[TierPort] = None
    _fetched_inos: Optional[set] = None

    # -- publishing ------------------------------------------------------------------------
    def _schedule_seal(self, inode):
        super()._schedule_seal(inode)
        if self.tier is not None and inode.is_file and not inode.writers and self._nursery is not None:
            if self._fetched_inos and inode.ino in self._fetched_inos:
                self._fetched_inos.discard(inode.ino)        # its content came from the tier
                return
            self._nursery.start_soon(self._offer_when_sealed, inode)

    async def _offer_when_sealed(self, inode):
        try:
            await self.seal(inode)
        except KvfsError:
            return                      # logged by the seal; nothing to publish
        if inode.writers or inode.content_dirty or inode.ino not in self.tree.inodes:
            return
        version = inode.content_version
        self.tier.offer(lambda: self._tier_read(inode, version))

    async def _tier_read(self, inode, version):
        """(path, mode, content) of a file still as it was offered, or None."""
        if inode.ino not in self.tree.inodes or inode.writers or inode.content_dirty \
                or inode.content_version != version:
            return None
        path = self._path_of_file(inode)
        if path is None:
            return None
        fh, _, _ = self.open(inode.ino, os.O_RDONLY)
        try:
            size, parts, off = inode.size, [], 0
            with self.views_held():
                while off < size:
                    piece = await self.read(fh, off, min(self.block_size * 8, size - off))
                    if not piece:
                        break
                    parts.append(bytes(piece))
                    off += len(piece)
        finally:
            await self.release(fh)
        if inode.content_version != version or inode.ino not in self.tree.inodes:
            return None
        return path, stat.S_IMODE(inode.mode), b"".join(parts)

    def _path_of_file(self, inode) -> Optional[bytes]:
        entries = sorted(names_of(inode))
        if not entries:
            return None
        parent, name = entries[0]
        if name.startswith(FETCH_PREFIX):
            return None
        directory = self._path_of_dir(parent)
        return None if directory is None else directory + b"/" + name

    def _path_of_dir(self, ino) -> Optional[bytes]:
        """"/a/b" for a directory (b"" for the root): each name found in its parent's entries."""
        parts = []
        while ino != ROOT_INO:
            node = self.tree.inodes.get(ino)
            if node is None or not node.is_dir:
                return None
            parent = self.tree.inodes.get(node.parent)
            if parent is None:
                return None
            for name, child in zip(parent.entries.names(), parent.entries.inos()):
                if child == ino:
                    parts.append(name)
                    break
            else:
                return None
            ino = node.parent
        return b"".join(b"/" + p for p in reversed(parts))

    # -- a lookup that missed ---------------------------------------------------------------
    async def lookup_remote(self, parent: int, name: bytes) -> int:
        """After ``lookup`` raised NotFound: the file from the tier, made here (one lookup
        counted), or NotFound. Answers within the tier's deadline plus the local write."""
        if self.tier is None or parent in (META_DIR_INO, BY_HASH_INO) or parent & VIEW_BIT \
                or name.startswith(FETCH_PREFIX):
            raise NotFound()
        directory = self._path_of_dir(parent)
        if directory is None:
            raise NotFound()
        got = await self.tier.fetch(directory + b"/" + name)
        if got is None:
            raise NotFound()
        blocks, mode = got
        try:
            return self.lookup(parent, name)            # made here meanwhile
        except NotFound:
            pass
        owner = self.tree.dir(parent)
        temp = FETCH_PREFIX + os.urandom(8).hex().encode()
        ino = self.make(parent, temp, stat.S_IFREG | (mode & 0o777), owner.uid, owner.gid)
        if self._fetched_inos is None:
            self._fetched_inos = set()
        self._fetched_inos.add(ino)
        try:
            fh, _, _ = self.open(ino, os.O_WRONLY)
            try:
                off = 0
                for block in blocks:                # as fetched: no join, no slices
                    await self.write(fh, off, block)
                    off += len(block)
            finally:
                await self.release(fh)
            # Provisional, onto a free name: the rename does not wait for the seal (the
            # device write), and a crash before the seal drops the file, name and all.
            await self.rename(parent, temp, parent, name, noreplace=True)
            # The kernel has never held a page of it: its first reader's open fills them
            # (pagecache.py), as for a file read from the device.
            self.tree.inodes[ino].fill_on_open = True
        except Exists:
            self._drop_temp(parent, temp, ino)
            return self.lookup(parent, name)
        except BaseException:
            with trio.CancelScope(shield=True):
                self._drop_temp(parent, temp, ino)
            raise
        return ino

    def _drop_temp(self, parent, temp, ino):
        self._fetched_inos.discard(ino)
        try:
            self.unlink(parent, temp, directory=False)
        except KvfsError:
            pass
        self.forget(ino, 1)
