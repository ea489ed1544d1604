"""An O_TRUNC open under readers: reads the kernel sent before it knew of the truncation.

With atomic_o_trunc the daemon empties the file while it answers FUSE_OPEN;
the kernel sets its i_size to 0 only once it has that answer. A READ it sent
before then (the readahead of another descriptor of the file) can reach the
daemon after the truncation. Answered from the emptied file it comes back
short: the kernel zero-fills the rest of its pages and marks them up to date,
and trusts a short read to shrink i_size only if no attribute update came in
between (fuse_read_update_size). When one did (a GETATTR of another reader,
answered before the truncation), or when the truncating writer's first write
had grown the file again by the time the reader copied (filemap_read checks
i_size only after its pages are up to date), read() returned zeros that
nobody wrote: as many as the old length, or the new one (tests/test_stress.py
found it, tests/test_otrunc_readers.py shows it).

So an O_TRUNC open that finds other descriptors of the file open keeps a
snapshot of the old content, and reads through the other descriptors are
answered from it until a request on the truncating descriptor shows that the
kernel has finished that open (after which it sends no READ beyond the new
size, 0, until a write grows the file) or anything writes to the file. The
old content is a state the file had during that open(), so such a read is
one the kernel could have made before the truncation.
"""
from __future__ import annotations

from ..blockcache import FileData
from ..blockcache.port import CachePort
from .inodes import Inode


class TruncationWindow:
    """The O_TRUNC windows of the namespace's files, kept in the blocks of ``cache``.

    A file's window is ``inode.pre_truncate``: (a snapshot of its old content,
    the truncating fh) while it is open, else None. The namespace empties the
    file itself, right after :meth:`keep_old_content`.
    """

    def __init__(self, cache: CachePort) -> None:
        self.cache = cache

    def keep_old_content(self, inode: Inode, fh: int) -> None:
        """Called by an O_TRUNC open (``fh``) before it empties ``inode``."""
        self.old_content_done(inode)
        others = inode.opens > 1                 # this open is already counted
        if others and (inode.data.size or inode.data.blocks):
            inode.pre_truncate = (self.cache.snapshot(inode.data), fh)

    def read_source(self, inode: Inode, fh: int) -> FileData:
        """The FileData a read of ``inode`` through ``fh`` is answered from."""
        if inode.pre_truncate is None:
            return inode.data
        snapshot, truncating = inode.pre_truncate
        if fh == truncating:
            self.old_content_done(inode)
            return inode.data
        return snapshot

    def old_content_done(self, inode: Inode, fh: int | None = None) -> None:
        """The kernel knows of the truncation (a request on ``fh``, the truncating
        descriptor) or the content changes again (``fh`` None): drop the snapshot."""
        held = inode.pre_truncate
        if held is not None and (fh is None or fh == held[1]):
            inode.pre_truncate = None
            self.cache.release_snapshot(held[0])
