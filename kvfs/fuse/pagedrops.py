"""Drop a range of pages from the kernel's page cache of one file (FUSE_NOTIFY_INVAL_INODE).

Part of the FUSE layer: kvfs/fuse/ops.py calls it before it answers a WRITE
that raced reads of the same file (kvfs/namespace/pagecache.py says why).

pyfuse3.invalidate_inode can only drop a whole file, and a whole-file drop
would wait for the one page the WRITE being answered may hold locked. So the
notification goes to the FUSE device directly: one write() of a message whose
layout is the kernel's ABI (include/uapi/linux/fuse.h, unchanged since Linux
2.6.31)::

    struct fuse_out_header            { u32 len; s32 error; u64 unique; }   unique 0, error = the code
    struct fuse_notify_inval_inode_out { u64 ino; s64 off; s64 len; }

The kernel handles it inside that write() (invalidate_inode_pages2_range),
waiting for each page's lock, so it runs in a thread and the trio loop goes on
answering the READs whose pages it waits for. Every drop has a time limit
(below); one that runs over finishes in its thread after the reply.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import struct
from typing import Iterable, Optional

import trio

log = logging.getLogger(__name__)

FUSE_NOTIFY_INVAL_INODE = 2
_OUT_HEADER = struct.Struct("<IiQ")
_INVAL_INODE = struct.Struct("<QqQ")
assert _OUT_HEADER.size == 16 and _INVAL_INODE.size == 24
# A drop waits for each page's lock and for its writeback. A page-cache
# write's pages are neither (but the last, which the WRITE may hold locked),
# unless the WRITE is a shared mapping's writeback (pyfuse3 does not say which
# kind a WRITE is), whose pages stay under writeback until its reply. So every
# drop has a limit, after which the reply goes out and the drop completes.
LOCKED_PAGE_WAIT_S = 0.2         # the page the WRITE itself may hold locked
UNLOCKED_WAIT_S = 0.2            # the others
# A drop that ran over keeps its thread (and its limiter token) until the page
# it waits for is unlocked. With 4 threads, late drops under load could hold
# every token, and the next WRITE's drops could then not even start before its
# reply (about half the drops ran over in loaded stress runs).
DROP_THREADS = 16


@dataclasses.dataclass(frozen=True)
class PageDropStatistics:
    kernel_page_drops: int           # ranges dropped before a WRITE's reply
    kernel_page_drops_late: int      # drops still waiting for a page lock when the reply went out
    kernel_page_drops_failed: int    # drops the kernel refused (logged)
    kernel_page_drops_last_late: int  # of the late ones, drops of a WRITE's partly written last page


class KernelPageDropper:
    """Sends page drops for the FUSE connection on ``fd`` (the daemon's /dev/fuse descriptor)."""

    def __init__(self, fd: int, page_size: int = os.sysconf("SC_PAGE_SIZE")) -> None:
        self.fd = fd
        self.page_size = page_size
        self._limiter = trio.CapacityLimiter(DROP_THREADS)
        self._drops = 0
        self._late = 0
        self._failed = 0
        self._last_late = 0

    @classmethod
    def of_this_process(cls) -> Optional[KernelPageDropper]:
        """The dropper for this process's one FUSE connection, or None (and a warning)."""
        fds = []
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                    fds.append(int(name))
            except OSError:
                continue                   # the descriptor listdir itself used
        if len(fds) != 1:
            log.warning("found %d /dev/fuse descriptors, not one: reads racing an O_RDWR writer "
                        "are not repaired", len(fds))
            return None
        return cls(fds[0])

    def _send(self, ino: int, off: int, length: int) -> Optional[OSError]:
        body = _INVAL_INODE.pack(ino, off, length)
        message = _OUT_HEADER.pack(_OUT_HEADER.size + len(body), FUSE_NOTIFY_INVAL_INODE, 0) + body
        try:
            os.write(self.fd, message)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the kernel holds nothing of that inode
                return exc
        return None

    async def drop(self, ino: int, ranges: Iterable[tuple[int, int, bool]]) -> None:
        """Drop pages [first, last] of inode ``ino`` for each (first, last, may_be_locked).

        The WRITE's partly written last page (``may_be_locked``) goes first. It is
        the page the writer's next write() copies into: left stale, that copy makes
        a page of old and new bytes (tests/test_stress.py saw them). The kernel drops
        a range's pages in order and waits at each locked one, so behind the
        others it would wait for their locks too.
        """
        for first, last, may_be_locked in sorted(ranges, key=lambda r: not r[2]):
            off, length = first * self.page_size, (last - first + 1) * self.page_size
            failed, late = await self._drop(ino, off, length,
                                            LOCKED_PAGE_WAIT_S if may_be_locked else UNLOCKED_WAIT_S)
            if failed is not None:
                # The WRITE itself succeeded: it is answered as such, and the
                # pages stay as the kernel has them.
                log.warning("could not drop pages %d-%d of inode %d from the kernel: %s", first, last, ino, failed)
            self._last_late += late and may_be_locked

    async def drop_file(self, ino: int) -> bool:
        """Drop every cached page of ``ino``, as an open without keep_cache would; False if
        the kernel refused or the drop ran over its limit (it then finishes in its thread)."""
        failed, late = await self._drop(ino, 0, 0, UNLOCKED_WAIT_S)      # length 0: to the end
        if failed is not None:
            log.warning("could not drop the cached pages of inode %d from the kernel: %s", ino, failed)
        return not late and failed is None

    async def _drop(self, ino: int, off: int, length: int, limit: float) -> tuple[Optional[OSError], bool]:
        """One drop, waited for at most ``limit`` s: (the error the kernel answered or None, ran over)."""
        failed = None
        with trio.move_on_after(limit) as waited:
            failed = await trio.to_thread.run_sync(self._send, ino, off, length,
                                                   limiter=self._limiter, abandon_on_cancel=True)
        self._drops += 1
        self._failed += failed is not None
        self._late += waited.cancelled_caught
        return failed, waited.cancelled_caught

    def statistics(self) -> PageDropStatistics:
        return PageDropStatistics(self._drops, self._late, self._failed, self._last_late)
