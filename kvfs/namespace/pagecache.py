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
  write boundary); tests/repro_otrunc_mix.py hunts it.
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

Two narrow windows stay open (docs/reliability.md, "What is left"): a GETATTR
reply the kernel ignored leaves it an older mtime than the one held back, and
an open answered just before the writer's drops the pages in the kernel after
it. Closing them needs writeback_cache or explicit_inval_data.
"""
import os


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
        if page_writer:
            if not inode.page_writers and inode.kernel_mtime is None:
                inode.kernel_mtime = inode.mtime
            inode.page_writers += 1
        return direct_io, page_writer, keep

    @staticmethod
    def _shielded(inode):
        return inode.page_writers and not inode.direct_writes_under_page_writers

    def mtime_for_kernel(self, inode):
        """(mtime, held back) for an attribute reply (see the module doc)."""
        if self._shielded(inode):              # the first page-cache writer's open set kernel_mtime
            return inode.kernel_mtime, inode.kernel_mtime != inode.mtime
        inode.kernel_mtime = inode.mtime
        return inode.mtime, False

    def _page_cache_written(self, handle):
        if not handle.page_writer and handle.inode.page_writers:
            handle.inode.direct_writes_under_page_writers = True

    def _page_cache_closed(self, handle):
        inode = handle.inode
        if handle.page_writer:
            inode.page_writers -= 1
            if not inode.page_writers:
                inode.direct_writes_under_page_writers = False
