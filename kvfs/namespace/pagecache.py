"""What an open tells the kernel about its page cache: direct_io, and whether to keep the pages.

Mixed into :class:`~kvfs.namespace.Namespace`. Three facts of the kernel
(fs/fuse/file.c, without writeback_cache) decide it:

* An open that is not told ``keep_cache`` drops every cached page of the file
  (invalidate_inode_pages2 in fuse_finish_open). That is how a reader sees
  what a direct_io writer wrote: its pages were never updated.
* A write through the page cache copies its bytes into the kernel's pages
  *before* it sends the WRITE. If those pages are dropped in between, a read
  of them goes to the daemon, which does not have the bytes yet: the read
  caches the older content (zero-filled past the old end), the WRITE then
  lands in the daemon only, and the stale page stays cached, up to date in
  the kernel's eyes, for every later reader. tests/test_stress.py found it
  (a reader that opened during a chunked O_TRUNC rewrite got zeros after a
  write boundary).
* A GETATTR reply whose mtime differs from the one the kernel holds drops
  every cached page too (auto_inval_data, which libfuse turns on and pyfuse3
  cannot turn off; it needs no writeback_cache). While a write extends the
  file the kernel ignores GETATTR replies (FUSE_I_SIZE_UNSTABLE), but one
  answered just before the write began drops the pages during its copy.

So while a page-cache writer has the file open (and nothing else writes it):

* no open drops the pages: the writer keeps them current itself. The version
  the kernel was last told to drop is left alone, so the first open after
  the writers have gone drops them, as it would after any change;
* the mtime the kernel is told stays the one it was last told. The real one
  is kept and stored; the kernel learns it once the last such writer has
  closed, or from a setattr reply (ftruncate, utimens: the kernel drops no
  pages for those). So stat() of a file that is open for writing through the
  page cache may show an mtime from before its last setattr until the close,
  as on NFS (close-to-open). Attributes that hold the mtime back go out with
  a 0.1 s attr_timeout, so a stat() that long after the close shows the real
  one (tests/test_page_writer_opens.py).

A direct_io write while a page-cache writer is open (two writers of one file
at once, or a descriptor opened O_RDWR only to fsync) ends that until the
page-cache writers have closed: the kernel did not update its pages for the
direct write, so opens must drop them again and the mtime must show.

Those are the drops kvfs can foresee. Others it cannot: a GETATTR reply the
kernel ignored leaves it an older mtime than the one held back, and an open
answered just before the writer's drops the pages in the kernel after it
(invalidate_inode_pages2; memory reclaim and posix_fadvise(DONTNEED) cannot
drop them, the WRITE in flight holds a reference on each). So kvfs also
repairs what such a drop leaves behind: **a READ that reaches the
daemon between a page-cache writer's last reply and the daemon applying its
next WRITE may have cached older bytes** of pages that WRITE covers (the
kernel copied the new bytes, the pages were dropped, the READ refetched them).
While a page-cache writer is open, every read of the file notes the pages it
asked for on each such writer's handle (``ReadsUnderPageWriters``). A WRITE
through that handle that finds pages noted, once applied, waits for the reads
that began before it to end, and has the FUSE layer drop those of them it covers
from the kernel before it replies (:meth:`KernelPages.stale_kernel_pages`): the writer's
next copy then lands in a page the kernel must read again from the daemon,
which now has the bytes. (A READ that reached the daemon before the writer's
last reply was sent before the writer's copy, and its pages were locked until
its reply: the copy waited for it.)

Reads through a descriptor opened with O_DIRECT are not noted: the kernel
copies them straight to the reader, caching no page. (A descriptor whose
O_DIRECT is cleared later with fcntl reads through the cache unnoted; no engine
kvfs serves does that.) They were most of the noted reads in tests/test_stress.py,
and each made the WRITE wait out the limit on a page the writer itself held.

One page is special: the kernel keeps the last page of a WRITE locked until
the reply when the WRITE does not cover it whole and it was not up to date, so
dropping it before the reply would wait for itself. Such a page was not up to
date, so no reader cached older bytes in it unless it was dropped twice in the
window; it is dropped only if a noted read covered it. Every drop has a time
limit (kvfs/fuse/pagedrops.py) after which the reply goes out and the drop completes.
"""
from __future__ import annotations

import os
from typing import ContextManager

import trio

from .inodes import Handle, Inode
from .port import NativeExtents

PAGE = os.sysconf("SC_PAGE_SIZE")
READS_SETTLE_WAIT_S = 5.0        # a WRITE waits this long at most for the reads that raced it


class ReadsUnderPageWriters:
    """The reads of one file while a page-cache writer has it open (``Inode.page_reads``)."""

    __slots__ = ("started", "running", "ended", "writers")

    def __init__(self) -> None:
        self.started = 0                   # reads begun (their sequence numbers)
        self.running = set()               # sequence numbers of the reads not yet answered
        self.ended = None                  # a trio.Event while a WRITE waits for reads to end
        self.writers = []                  # the page-cache writers' handles


class KernelPages:
    """Mixed into :class:`~kvfs.namespace.Namespace` (``handles`` of :class:`Handle`)."""

    def _page_cache_mode(self, inode, flags, writable):
        """(direct_io, page_writer, keep_cache) for a new open of ``inode``; counts a page-cache writer."""
        # A write-only descriptor cannot be mmapped, so it bypasses the page
        # cache: the engines' one big write() goes to the daemon as 1 MiB
        # requests without a copy into kernel pages. (The kernel drops the
        # cached pages of the range before and after each direct_io write.) Everything else
        # uses the page cache, so MAP_SHARED mmap works on every file
        # (numpy.memmap, torch.load(mmap=True), safetensors).
        direct_io = (flags & os.O_ACCMODE) == os.O_WRONLY
        page_writer = writable and not direct_io
        if self._shielded(inode):
            keep = True                        # see the module doc: never under a page-cache writer
        else:
            # Pages are kept across opens only while nobody has written since
            # they were cached.
            keep = not writable and not inode.writers and inode.cached_version == inode.content_version
            inode.cached_version = inode.content_version
            if not keep:
                inode.filled_version = -1      # this open makes the kernel drop the pages
        if page_writer:
            if not inode.page_writers and inode.kernel_mtime is None:
                inode.kernel_mtime = inode.mtime
            inode.page_writers += 1
        return direct_io, page_writer, keep

    def page_fill_size(self, fh: int, most: int) -> int:
        """How many bytes of the file open at ``fh`` the FUSE layer should place in the
        kernel's page cache before it answers the open (kvfs/fuse/pagefill.py), or 0.

        Only a cold read-only open of a file nobody writes: its bytes are then fixed
        until a writer's open, or a truncate, which the FUSE layer holds back until
        the fill is done. A warm reopen (nothing to fetch) fills nothing: the
        kernel most likely still holds the pages, and another copy would only cost.
        A file made from the shared tier (``fill_on_open``) is warm here but was never
        in the kernel, so its first opens fill until one fills it whole.
        """
        h = self.handle(fh)
        inode = h.inode
        if (h.writable or h.view or h.o_direct or not (h.cold_blocks or inode.fill_on_open)
                or inode.writers or inode.page_writers
                or inode.pre_truncate is not None or inode.data.failed):
            return 0
        return min(inode.size, most)

    # -- readers outside Python: the native read plane (kvfs/fuse/readplane.c) ----
    # It answers READs of a published file from the device, verifying every
    # block against its key. ``content_watcher`` (set by the FUSE layer) is told
    # the inode number on every content change (Durability._content_changed)
    # and at the last close, before either is answered; it withdraws the file.

    def _native_ready(self, h: Handle) -> bool:
        """Whether every READ through ``h`` may be answered from the device under the file's keys."""
        inode = h.inode
        return not (h.view or h.writable or inode.writers or inode.page_writers or inode.content_dirty
                    or inode.pre_truncate is not None or inode.data.failed or inode.data.dirty_count)

    def native_extents(self, fh: int) -> NativeExtents | None:
        """The file open at ``fh`` as it lies on the device, or None if a READ of it needs Python."""
        h = self.handles.get(fh)
        if h is None or not self._native_ready(h):
            return None
        inode = h.inode
        blocks = self.cache.stored_extents(inode.data)
        if blocks is None:
            return None
        size = inode.data.size
        return NativeExtents(inode.ino, inode.content_version, size, self.block_size,
                             blocks[:-(-size // self.block_size)])     # none past the end

    def views_held(self) -> ContextManager[None]:
        """Views that :meth:`read` returns inside stay valid (BlockCache.views_held)."""
        return self.cache.views_held()

    # After a page fill stored a whole file, the kernel holds every page of it,
    # and kvfs's clean copy of its blocks is the same bytes a second time. The
    # blocks leave the clean cache at once: their buffers take the next device
    # reads, where a fresh buffer costs a page fault and a zeroing per 4 KiB
    # (about as much as the device read), and the RAM is not spent twice.
    # Until something says the kernel lost pages, a reopen then neither
    # prefetches nor fills. What says so: an open answered without keep_cache
    # (the kernel drops the pages), a content change (a new version), a new
    # mtime in an attribute reply (auto_inval_data), the kernel forgetting the
    # inode, a READ (the kernel found a page missing), and kvfs-admin
    # drop-caches (benchmarks and tests drop the kernel's cache with it). The
    # first read after a loss the daemon missed goes through READs and
    # readahead, as without page fills; the next open fills again.

    def page_fill_done(self, fh: int, size: int) -> None:
        """The FUSE layer stored the first ``size`` bytes of the file open at ``fh`` in the kernel."""
        inode = self.handle(fh).inode
        # Not while the kernel holds an older mtime: the next stat (Python's open()
        # makes one right after the open) gets the new one, and the kernel then
        # drops every page (auto_inval_data). The READs that follow are served
        # from the clean cache, so it keeps the blocks.
        if size == inode.size:
            inode.fill_on_open = False
        if size == inode.size and inode.cached_version == inode.content_version and \
                inode.kernel_mtime == inode.mtime:
            inode.filled_version = inode.content_version
            self.cache.forget_clean(inode.data)

    @staticmethod
    def pages_filled(inode: Inode) -> bool:
        """Whether the kernel holds every page of ``inode``'s content, as far as kvfs knows."""
        return inode.filled_version == inode.content_version

    @staticmethod
    def _page_cache_read(h):
        """A read on handle ``h``: returns where to note it (``page_reads``), or None."""
        if h.o_direct:
            return None                        # O_DIRECT caches no pages
        h.inode.filled_version = -1            # a READ: the kernel lacks a page
        return h.inode.page_reads

    def drop_caches(self) -> None:
        """kvfs-admin drop-caches: empty the clean cache and forget every page fill."""
        self.cache.drop_clean()
        for inode in self.tree.inodes.values():    # O(inodes): an operator's command, not a request path
            inode.filled_version = -1

    @staticmethod
    def _shielded(inode):
        return inode.page_writers and not inode.direct_writes_under_page_writers

    def mtime_for_kernel(self, inode: Inode) -> tuple[int, bool]:
        """(mtime, held back) for an attribute reply (see the module doc)."""
        if self._shielded(inode):              # the first page-cache writer's open set kernel_mtime
            return inode.kernel_mtime, inode.kernel_mtime != inode.mtime
        if inode.kernel_mtime != inode.mtime:
            inode.filled_version = -1          # a new mtime: the kernel drops the pages (auto_inval_data)
        inode.kernel_mtime = inode.mtime
        return inode.mtime, False

    def _page_cache_written(self, handle):
        if not handle.page_writer and handle.inode.page_writers:
            handle.inode.direct_writes_under_page_writers = True

    def _page_cache_closed(self, handle):
        inode = handle.inode
        if handle.page_writer:
            inode.page_writers -= 1
            reads = inode.page_reads
            if reads is not None and handle in reads.writers:
                reads.writers.remove(handle)
            if not inode.page_writers:
                inode.direct_writes_under_page_writers = False
                inode.page_reads = None

    # -- reads racing a page-cache writer's copy (see the module doc) -----------
    def _page_writer_opened(self, handle):
        inode = handle.inode
        if inode.page_reads is None:
            inode.page_reads = ReadsUnderPageWriters()
        inode.page_reads.writers.append(handle)

    async def _read_under_page_writers(self, reads, source, off, size):
        reads.started += 1
        seq = reads.started
        reads.running.add(seq)
        first, last = off // PAGE, (off + max(size, 1) - 1) // PAGE
        for h in reads.writers:
            h.pages_read = with_span(h.pages_read, first, last)
        try:
            return await self.cache.read(source, off, size)
        finally:
            reads.running.discard(seq)
            if reads.ended is not None:
                reads.ended.set()
                reads.ended = None

    async def stale_kernel_pages(self, fh: int, off: int, size: int) -> tuple[int | None, list[tuple[int, int, bool]]]:
        """After a WRITE of ``size`` bytes at ``off`` through ``fh`` is applied: what the
        kernel must drop before the reply: (ino, [(first page, last page,
        may_be_locked)...]), or (None, []) when no read raced the writer."""
        h = self.handles.get(fh)
        if h is None or not h.page_writer or h.pages_read is None or not size:
            return None, []
        spans, h.pages_read = h.pages_read, None
        reads = h.inode.page_reads
        if reads is not None:
            begun = reads.started
            with trio.move_on_after(READS_SETTLE_WAIT_S):
                while any(seq <= begun for seq in reads.running):
                    if reads.ended is None:
                        reads.ended = trio.Event()
                    await reads.ended.wait()
        # Only the pages this WRITE covers: those are what the kernel copied
        # before sending it. (Wider, it would also wait for pages another WRITE
        # holds under writeback, one that a shared mapping's writeback sends.)
        ranges = []
        for first, last in spans:
            first, last = max(first, off // PAGE), min(last, (off + size - 1) // PAGE)
            if first <= last:
                ranges.extend(pages_to_drop(first, last, off, size))
        return (h.inode.ino, ranges) if ranges else (None, [])


NOTED_SPANS = 16                 # spans kept per handle; more are merged into one


def with_span(spans: list[tuple[int, int]] | None, first: int, last: int) -> list[tuple[int, int]]:
    """The page spans ``spans`` (disjoint, sorted; None for none) with [first, last] added.

    Spans, not their hull: with one hull, reads of pages 0 and 60 named every page
    between, and a drop of the WRITE's last page, which the writer itself may hold
    locked, then waited out its limit on most WRITEs (kernel_page_drops_last_late).
    """
    merged = []
    for lo, hi in sorted([*(spans or ()), (first, last)]):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged if len(merged) <= NOTED_SPANS else [(merged[0][0], max(hi for _, hi in merged))]


def pages_to_drop(first: int, last: int, off: int, size: int) -> list[tuple[int, int, bool]]:
    """Split the pages [first, last] around the one page a WRITE of ``size`` bytes at
    ``off`` may hold locked: its last page, unless the WRITE covers that whole."""
    end = off + size
    locked = (end - 1) // PAGE
    if end % PAGE == 0 and off <= locked * PAGE:
        locked = None                      # covered whole: the kernel marked it up to date
    if locked is None or not first <= locked <= last:
        return [(first, last, False)]
    parts = [(first, locked - 1, False), (locked, locked, True), (locked + 1, last, False)]
    return [p for p in parts if p[0] <= p[1]]
