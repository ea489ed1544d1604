"""PageFiller (kvfs/fuse/pagefill.py) in-process: what it sends the kernel, and its fence.

The FUSE connection is a SOCK_SEQPACKET socket pair here, so each notification
the filler writes arrives as one record, which the test parses as the kernel
would (include/uapi/linux/fuse.h). The bytes come from a real namespace over a
store file. The mounted behaviour (no READ after a fill, coherence with writers,
EIO) is in tests/test_page_fill.py.
"""
import os
import socket
import struct

import trio
import trio.testing

from kvfs.namespace import ROOT_INO
from kvfs.fuse.pagedrops import FUSE_NOTIFY_INVAL_INODE, KernelPageDropper
from kvfs.fuse.pagefill import FILL_WAIT_S, FUSE_NOTIFY_STORE, PageFiller

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, running, wait_until, write_file

HEADER = struct.Struct("<IiQ")
STORE = struct.Struct("<QQII")
INVAL = struct.Struct("<QqQ")


class Connection:
    """The daemon's end is ``fd``; :meth:`messages` reads what was sent to the kernel's end."""

    def __init__(self):
        self.kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        daemon.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.daemon = daemon
        self.fd = daemon.fileno()

    def messages(self):
        out = []
        self.kernel.setblocking(False)
        while True:
            try:
                record = self.kernel.recv(4 << 20)
            except BlockingIOError:
                return out
            length, code, unique = HEADER.unpack_from(record)
            assert length == len(record) and unique == 0, (length, len(record), unique)
            if code == FUSE_NOTIFY_STORE:
                ino, off, size, pad = STORE.unpack_from(record, HEADER.size)
                payload = record[HEADER.size + STORE.size:]
                assert pad == 0 and size == len(payload)
                out.append(("store", ino, off, payload))
            else:
                assert code == FUSE_NOTIFY_INVAL_INODE, code
                out.append(("drop", *INVAL.unpack_from(record, HEADER.size)))

    def close(self):
        self.kernel.close()
        self.daemon.close()


async def a_file(fs, data):
    ino = await write_file(fs.ns, ROOT_INO, b"chunk", data)
    await fs.ns.flush_all()
    fs.ns.drop_caches()
    fh, _, keep = fs.ns.open(ino, os.O_RDONLY)
    return ino, fh, keep


def filler_on(conn):
    return PageFiller(conn.fd, KernelPageDropper(conn.fd), BS)


async def test_a_fill_sends_each_block_once_as_the_files_bytes(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    conn = Connection()
    data = pattern(1, 2 * BS + 1234)
    async with running(fs):
        ino, fh, _ = await a_file(fs, data)
        assert fs.ns.page_fill_size(fh, 1 << 30) == len(data)     # cold, read-only, no writer
        filler = filler_on(conn)
        kept = await filler.fill(ino, len(data), lambda off, n: fs.ns.read(fh, off, n), fs.ns.views_held, True)
        await fs.ns.release(fh)
    assert kept == (True, True)                                 # answered with keep_cache, whole
    stores = sorted(conn.messages())
    assert [(kind, i, off) for kind, i, off, _ in stores] == [("store", ino, 0), ("store", ino, BS),
                                                              ("store", ino, 2 * BS)]
    assert b"".join(payload for *_, payload in stores) == data
    s = filler.statistics()
    assert (s.page_fills, s.page_fill_bytes, s.page_fill_blocks_skipped) == (1, len(data), 0)
    conn.close()
    close_and_check(fs)


async def test_an_open_without_keep_cache_drops_the_pages_before_it_fills(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    conn = Connection()
    data = pattern(2, BS)
    async with running(fs):
        ino, fh, keep = await a_file(fs, data)
        assert keep is False                                    # the first open after a write
        kept = await filler_on(conn).fill(ino, len(data), lambda off, n: fs.ns.read(fh, off, n),
                                          fs.ns.views_held, keep)
        await fs.ns.release(fh)
    assert kept == (True, True)                                 # no stale page is left to keep
    messages = conn.messages()
    assert messages[0] == ("drop", ino, 0, 0)                   # the whole file, first
    assert messages[1:] == [("store", ino, 0, data)]
    conn.close()
    close_and_check(fs)


async def test_a_fence_waits_for_a_running_fill_and_no_fill_starts_inside_it(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    conn = Connection()
    data = pattern(3, 2 * BS)
    gate = trio.Event()
    events = []

    async def gated_read(off, n):
        await gate.wait()
        return await fs.ns.read(fh, off, n)

    async def fence():
        async with filler.fenced(ino):
            events.append("fenced")
            # A fill that starts now sends nothing and answers what the namespace said.
            assert await filler.fill(ino, len(data), gated_read, fs.ns.views_held, False) == (False, False)
            events.append("refused")

    async with running(fs):
        ino, fh, _ = await a_file(fs, data)
        filler = filler_on(conn)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(filler.fill, ino, len(data), gated_read, fs.ns.views_held, True)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(fence)
            await trio.testing.wait_all_tasks_blocked()
            assert events == []                                  # held back by the running fill
            events.append("released")
            gate.set()
        await fs.ns.release(fh)
    assert events == ["released", "fenced", "refused"]
    assert [m[:3] for m in sorted(conn.messages())] == [("store", ino, 0), ("store", ino, BS)]
    s = filler.statistics()
    assert s.page_fills == 1 and s.page_fill_fence_waits == 1, s
    conn.close()
    close_and_check(fs)


async def test_a_block_not_read_in_time_is_left_to_readahead(tmp_path, mock_clock):
    """FILL_WAIT_S is on trio's clock; here a MockClock that moves only when the test jumps it."""
    fs = open_fs(mkfs(tmp_path))
    conn = Connection()
    data = pattern(4, 2 * BS)
    never = trio.Event()
    answer = []

    async def second_block_hangs(off, n):
        if off:
            await never.wait()
        return await fs.ns.read(fh, off, n)

    async def fill():
        answer.append(await filler.fill(ino, len(data), second_block_hangs, fs.ns.views_held, True))

    async with running(fs):
        ino, fh, _ = await a_file(fs, data)
        filler = filler_on(conn)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill)
            # The first block reaches the kernel; the second waits, and so does the fill ...
            await wait_until(lambda: filler.statistics().page_fill_bytes == BS, what="the first block's store")
            mock_clock.jump(FILL_WAIT_S / 2)
            await trio.testing.wait_all_tasks_blocked()
            assert answer == [], "gave up before FILL_WAIT_S had passed"
            # ... until FILL_WAIT_S has passed on trio's clock: then it gives the second block up.
            mock_clock.jump(FILL_WAIT_S / 2)
            mock_clock.rate = 1                 # the rest of the test on a running clock
            await wait_until(lambda: answer, what="the fill to give up")
        # Kept, but not whole: the namespace must not take the kernel to hold the file.
        assert answer == [(True, False)]
        await fs.ns.release(fh)
    assert conn.messages() == [("store", ino, 0, data[:BS])]
    s = filler.statistics()
    assert (s.page_fills, s.page_fill_bytes, s.page_fill_blocks_skipped) == (1, BS, 1), s
    conn.close()
    close_and_check(fs)


async def test_warm_writable_and_o_direct_opens_are_not_filled(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    data = pattern(5, BS + 1)
    async with running(fs):
        ino, fh, _ = await a_file(fs, data)
        assert fs.ns.page_fill_size(fh, 100) == 100            # at most what the caller allows
        await fs.ns.read(fh, 0, len(data))
        warm, _, _ = fs.ns.open(ino, os.O_RDONLY)               # its blocks are in the clean cache now
        direct, _, _ = fs.ns.open(ino, os.O_RDONLY | os.O_DIRECT)
        fs.ns.drop_caches()
        writer, _, _ = fs.ns.open(ino, os.O_RDWR)
        reader, _, _ = fs.ns.open(ino, os.O_RDONLY)             # cold, but a writer has it open
        assert [fs.ns.page_fill_size(h, 1 << 30) for h in (warm, direct, writer, reader)] == [0, 0, 0, 0]
        for h in (fh, warm, direct, writer, reader):
            await fs.ns.release(h)
    close_and_check(fs)


async def test_a_whole_fill_hands_the_blocks_to_the_kernel_until_a_sign_it_lost_them(tmp_path):
    """After a whole file is stored in the kernel its blocks leave the clean cache and
    their buffers take the next device reads; reopens fetch nothing until an open
    without keep_cache, a READ, a write, a new mtime, the kernel's FORGET or
    drop-caches says the pages may be gone."""
    fs = open_fs(mkfs(tmp_path))
    conn = Connection()
    data, other = pattern(6, 3 * BS + 10), pattern(7, 3 * BS)
    async with running(fs):
        other_ino = await write_file(fs.ns, ROOT_INO, b"other", other)
        ino, fh, _ = await a_file(fs, data)
        cache = fs.ns.cache

        async def fill(handle, size):
            keep, whole = await filler_on(conn).fill(ino, size, lambda off, n: fs.ns.read(handle, off, n),
                                                     fs.ns.views_held, True)
            assert keep is True
            if whole:
                fs.ns.page_fill_done(handle, size)
            return whole

        # Not while the kernel holds an older mtime: its next stat drops the pages.
        inode = fs.ns.inode(ino)
        assert await fill(fh, len(data)) is True and inode.kernel_mtime != inode.mtime
        assert fs.ns.pages_filled(inode) is False and cache.statistics().cache_bytes > 0
        fs.ns.mtime_for_kernel(inode)                               # an attribute reply, as fuseops sends
        # A fill of only part of the file (FILL_MOST) hands nothing over.
        assert await fill(fh, BS) is True
        assert fs.ns.pages_filled(inode) is False and cache.statistics().cache_bytes > 0
        assert await fill(fh, len(data)) is True
        assert fs.ns.pages_filled(inode)
        assert cache.statistics().cache_bytes == 0                  # the kernel holds them; kvfs does not
        mapped = cache.statistics().read_buffers_mapped

        # The next cold read reuses those buffers: no fresh mapping.
        oh, _, _ = fs.ns.open(other_ino, os.O_RDONLY)
        assert bytes(await fs.ns.read(oh, 0, len(other))) == other
        assert cache.statistics().read_buffers_mapped == mapped
        await fs.ns.release(oh)

        # A reopen fetches nothing and is not filled again.
        fetched = cache.statistics().blocks_fetched
        again, _, keep = fs.ns.open(ino, os.O_RDONLY)
        assert keep is True and fs.ns.page_fill_size(again, 1 << 30) == 0
        assert cache.statistics().blocks_fetched == fetched

        # Each sign of lost pages ends it; the next open is cold and fills again.
        def lost(sign):
            assert fs.ns.pages_filled(inode) is False, sign
            inode.filled_version = inode.content_version             # as after another whole fill

        assert bytes(await fs.ns.read(again, 0, 10)) == data[:10]    # a READ
        lost("read")
        fs.ns.drop_caches()
        lost("drop-caches")
        inode.mtime += 1                                            # utimens
        fs.ns.mtime_for_kernel(inode)
        lost("a new mtime told to the kernel")
        direct, _, _ = fs.ns.open(ino, os.O_RDONLY | os.O_DIRECT)
        await fs.ns.read(direct, 0, BS)                             # O_DIRECT caches no pages: no sign
        assert fs.ns.pages_filled(inode)
        writer, _, _ = fs.ns.open(ino, os.O_RDWR)                   # answered without keep_cache
        lost("open without keep_cache")
        await fs.ns.write(writer, 0, b"x")                          # a new version
        assert fs.ns.pages_filled(inode) is False
        for h in (fh, again, direct, writer):
            await fs.ns.release(h)
        inode.filled_version = inode.content_version
        fs.ns.forget(ino, inode.lookups - 1)
        assert fs.ns.pages_filled(inode)                            # still looked up
        fs.ns.forget(ino, 1)                                        # the kernel let go of the inode
        lost("forget")
    conn.close()
    close_and_check(fs)
