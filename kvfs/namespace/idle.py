"""Idle files keep no live content object: a million chunk files in little RAM.

A regular file's live content is a :class:`~kvfs.blockcache.FileData` (its
size, its block list with dirty buffers, read-ahead state), and each one pins
its stored blocks in the index. Most files of a KV tier are idle: written
once, sealed, and read now and then. For those the live content is exactly
the durable one (``size_committed`` and ``committed``), so keeping a FileData,
its list and the pins cost about 170 bytes a file for nothing.

So ``inode.data`` is None for an idle file, and the live content is built from
the durable record when something needs it (:meth:`IdleFiles.live_data`: an
open, a truncate). It is dropped again once the file is idle
(:meth:`IdleFiles.shed_if_idle`: after the last close, and when the last
:meth:`IdleFiles.holding` ends). Whatever awaits with a file's live content
and no open handle (a seal, a truncate) holds it: a seal that finished
meanwhile must not drop it under them.

Invariant: ``inode.data is None`` on a regular file means its live content
equals its durable content, and nothing holds a pin for it. Its blocks stay
alive through their ``refs`` (the durable content record), so a straggler that
still holds the old FileData (a prefetch) reads the same verified bytes, or
gets EIO once a later content freed them; never other bytes.
"""
import contextlib
from typing import Any, Iterator, Sequence

from ..blockcache import FileData
from ..blockcache.port import CachePort
from ..schema.port import JournalPort
from .inodes import Inode


class IdleFiles:
    """Building and dropping the live content of the files of ``tree`` for the namespace.

    ``unsealed`` is the namespace's table of files whose content is not yet
    recorded (ino -> inode, durability.py): such a file is never idle.
    """

    journal: JournalPort        # the dedup domain of a file's owner

    def __init__(self, tree: Any, journal: JournalPort, cache: CachePort, unsealed: dict[int, Inode]) -> None:
        self.tree, self.journal, self.cache = tree, journal, cache
        self.unsealed = unsealed

    def live_data(self, inode: Inode) -> FileData:
        """``inode``'s FileData, built from its durable content if it is idle."""
        return inode.data if inode.data is not None else build_live_data(inode, self.journal, self.cache)

    @contextlib.contextmanager
    def holding(self, inode: Inode) -> Iterator[None]:
        """Keep ``inode``'s live content while the block runs; drop it after, if idle."""
        inode.data_holds += 1
        try:
            yield
        finally:
            inode.data_holds -= 1
            if not inode.data_holds:
                self.shed_if_idle(inode)

    def shed_if_idle(self, inode: Inode) -> bool:
        """Drop ``inode``'s FileData if its live content is its durable content and nothing uses it."""
        data = inode.data
        if (data is None or not inode.is_file or inode.opens or inode.writers or inode.content_dirty
                or inode.data_holds or inode.provisional or inode.page_writers or inode.pre_truncate is not None
                or inode.ino in self.unsealed or inode.ino not in self.tree.inodes
                or data.dirty_count or data.failed or data.size != inode.size_committed):
            return False
        if not idle_keys_match(data, inode.committed):
            return False
        inode.data = None
        # Unpin only: a prefetch that still holds ``data`` reads its keys, which the
        # durable record keeps alive. (release() would empty ``data`` under it.)
        self.cache.detach(data)
        return True


def build_live_data(inode: Inode, journal: JournalPort, cache: CachePort) -> FileData:
    """Make an idle file's live content from its durable record, its blocks pinned in
    ``cache`` (None: fsck's tree, which pins nothing); ``journal`` gives its dedup domain.

    The tree calls this too when an idle file leaves the namespace while the
    kernel still knows it (an unlink or a rename over it, with lookups held): the
    kernel may still open it by inode number, after a lookup that raced the
    unlink, and its blocks must stay alive for that open once the durable
    references are gone. Built at the open instead, it would name blocks already
    freed, with the size of the old content: zeros where the content was
    (tests/test_stress.py found it)."""
    data = inode.data = FileData(inode.size_committed, inode.committed, journal.domain_of(inode.uid))
    if cache is not None:
        cache.attach(data)
    return data


def idle_keys_match(data: FileData, committed: Sequence[bytes | None]) -> bool:
    """Whether ``data``'s blocks are exactly the stored keys ``committed`` lists (trailing holes aside)."""
    blocks = data.blocks
    n = len(committed)
    if len(blocks) < n or any(b is not None for b in blocks[n:]):
        return False
    return all(b is None if k is None else isinstance(b, bytes) and b == k for b, k in zip(blocks, committed))
