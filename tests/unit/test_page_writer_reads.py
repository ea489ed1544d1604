"""Reads that race an O_RDWR (page-cache) writer, in-process (kvfs/namespace/pagecache.py):
which pages a WRITE must have the kernel drop before its reply, and when none.
tests/test_page_writer_races.py shows the kernel side through a real mount."""
import os

import trio

from kvfs.namespace import ROOT_INO
from kvfs.namespace.pagecache import NOTED_SPANS, PAGE, pages_to_drop, with_span

from .helpers import BS, close_and_check, mkfs, open_fs, pattern, running, write_file


def test_the_last_page_of_a_write_is_set_apart_unless_the_write_covers_it_whole():
    # A write of whole pages: nothing can be locked, one range.
    assert pages_to_drop(0, 15, 0, 16 * PAGE) == [(0, 15, False)]
    # It ends inside page 3: page 3 may be locked by the WRITE itself.
    assert pages_to_drop(0, 15, 0, 3 * PAGE + 100) == [(0, 2, False), (3, 3, True), (4, 15, False)]
    # Inside one page, from its middle to its end: not covered whole either.
    assert pages_to_drop(2, 2, 2 * PAGE + 10, PAGE - 10) == [(2, 2, True)]
    # The reads did not reach the page the write may hold: all in one go.
    assert pages_to_drop(0, 1, 0, 3 * PAGE + 100) == [(0, 1, False)]
    assert pages_to_drop(5, 9, 0, 3 * PAGE + 100) == [(5, 9, False)]
    # The reads start at that page.
    assert pages_to_drop(3, 6, 0, 3 * PAGE + 100) == [(3, 3, True), (4, 6, False)]


def test_reads_are_noted_as_spans_not_as_their_hull():
    spans = with_span(None, 5, 6)
    assert spans == [(5, 6)]
    assert with_span(spans, 0, 0) == [(0, 0), (5, 6)]
    assert with_span(with_span(spans, 0, 0), 7, 9) == [(0, 0), (5, 9)]      # adjacent: one span
    assert with_span(with_span(spans, 0, 0), 1, 5) == [(0, 6)]              # overlapping: merged
    many = None
    for page in range(0, 2 * (NOTED_SPANS + 1), 2):
        many = with_span(many, page, page)
    assert many == [(0, 2 * NOTED_SPANS)]                  # past the bound: one span, never fewer pages


async def test_a_write_names_the_pages_read_since_its_last_reply_and_only_those(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    old = pattern(1, 2 * BS)
    async with running(fs):
        ino = await write_file(ns, ROOT_INO, b"f", old)
        writer, _, _ = ns.open(ino, os.O_RDWR)
        reader, _, _ = ns.open(ino, os.O_RDONLY)
        # No read since the open: nothing to drop.
        await ns.write(writer, 0, b"a" * PAGE)
        assert await ns.stale_kernel_pages(writer, 0, PAGE) == (None, [])
        # A read of pages 2-5, then a write of pages 0-4 ending inside page 4:
        # the pages both cover, page 4 set apart.
        assert bytes(await ns.read(reader, 2 * PAGE, 4 * PAGE)) == old[2 * PAGE:6 * PAGE]
        await ns.write(writer, 0, b"b" * (4 * PAGE + 1))
        assert await ns.stale_kernel_pages(writer, 0, 4 * PAGE + 1) == (ino, [(2, 3, False), (4, 4, True)])
        # An O_DIRECT read puts no page in the kernel's cache: nothing to drop for it.
        direct_reader, _, _ = ns.open(ino, os.O_RDONLY | os.O_DIRECT)
        await ns.read(direct_reader, 0, 4 * PAGE)
        await ns.write(writer, 0, b"o" * (4 * PAGE + 1))
        assert await ns.stale_kernel_pages(writer, 0, 4 * PAGE + 1) == (None, [])
        await ns.release(direct_reader)
        # Two reads far apart: only the pages they read, not those between them.
        await ns.read(reader, 0, PAGE)
        await ns.read(reader, 7 * PAGE, PAGE)
        await ns.write(writer, 0, b"e" * (4 * PAGE + 1))
        assert await ns.stale_kernel_pages(writer, 0, 4 * PAGE + 1) == (ino, [(0, 0, False)])
        # Pages read that the write does not cover are left alone.
        await ns.read(reader, 8 * PAGE, PAGE)
        await ns.write(writer, 0, b"b")
        assert await ns.stale_kernel_pages(writer, 0, 1) == (None, [])
        # Answered: the next write starts afresh.
        await ns.write(writer, 0, b"c")
        assert await ns.stale_kernel_pages(writer, 0, 1) == (None, [])
        # A read-only descriptor and a write-only (direct_io) one never have
        # anything to drop: the kernel does not copy their writes into pages.
        direct, _, _ = ns.open(ino, os.O_WRONLY)
        await ns.read(reader, 0, PAGE)
        await ns.write(direct, 0, b"d")
        assert await ns.stale_kernel_pages(direct, 0, 1) == (None, [])
        assert await ns.stale_kernel_pages(reader, 0, 1) == (None, [])
        await ns.release(direct)
        await ns.release(writer)
        assert ns.inode(ino).page_reads is None, "no page-cache writer is open: reads go untracked"
        await ns.read(reader, 0, PAGE)
        await ns.release(reader)
    close_and_check(fs)


async def test_a_write_waits_for_the_reads_that_began_before_it(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    ns = fs.ns
    async with running(fs):
        ino = await write_file(ns, ROOT_INO, b"f", pattern(1, BS))
        writer, _, _ = ns.open(ino, os.O_RDWR)
        reader, _, _ = ns.open(ino, os.O_RDONLY)
        await ns.read(reader, 0, PAGE)
        # Stand in for a READ still being answered (one waiting for the device):
        # begun, not yet ended.
        reads = ns.inode(ino).page_reads
        reads.started += 1
        in_flight = reads.started
        reads.running.add(in_flight)
        await ns.write(writer, 0, b"x" * PAGE)
        answered = []

        async def answer_the_write():
            answered.append(await ns.stale_kernel_pages(writer, 0, PAGE))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_the_write)
            await trio.sleep(0.2)
            assert answered == [], "the write named its pages before an older read had ended"
            await ns.read(reader, 0, PAGE)            # a younger read ending does not release it
            await trio.sleep(0.2)
            assert answered == []
            reads.running.discard(in_flight)
            reads.ended.set()
        assert answered == [(ino, [(0, 0, False)])]
        await ns.release(writer)
        await ns.release(reader)
    close_and_check(fs)
