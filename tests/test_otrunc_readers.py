"""Buffered readers of a file that is rewritten in place with O_TRUNC never read zeros.

The race (kvfs/namespace/truncation.py): a READ the kernel sent before it knew
of an O_TRUNC reaches the daemon after the truncation; answered from the
emptied file, it comes back short, the kernel zero-fills its pages, and with
an attribute update in between (other readers' GETATTRs here) it keeps its
old i_size, so read() returns the old length of zeros, or, once the writer's
first write has grown the file, the new length. Found by tests/test_stress.py;
this loop (two files, each with an O_TRUNC rewriter, two readers and a
stat()er) hit it several times in its 8 s on a 2-CPU machine before the fix.
"""
import os
import threading
import time

from stress_oracle import content

SECONDS = 8.0


def test_readers_of_a_file_rewritten_with_o_trunc_never_read_zeros(kvfs_factory):
    fs = kvfs_factory(size="1G", block_size="64K", mount_options=["cache_size=2M", "dirty_limit=1M"])
    fs.mkfs()
    fs.mount()
    contents = (content(1, 65535), content(2, 2611))     # a shorter one: its end is inside the old
    legit = set(contents)
    files = [fs.mnt / f"f{i}" for i in range(2)]
    for f in files:
        f.write_bytes(contents[0])
    stop = time.monotonic() + SECONDS
    bad, counts, lock = [], {"reads": 0, "rewrites": 0}, threading.Lock()

    def rewriter(f):
        i = 0
        while time.monotonic() < stop:
            i += 1
            fd = os.open(f, os.O_WRONLY | os.O_TRUNC)
            try:
                assert os.write(fd, contents[i % 2]) == len(contents[i % 2])
            finally:
                os.close(fd)
            with lock:
                counts["rewrites"] += 1

    def reader(f):
        while time.monotonic() < stop:
            fd = os.open(f, os.O_RDONLY)
            try:
                for _ in range(5):
                    data = os.pread(fd, 1 << 20, 0)
                    # A read may see the empty file, or a content cut at a page (a
                    # rewrite in progress: old pages, then the new file's end).
                    if data and data not in legit and not any(c.startswith(data) for c in contents):
                        first = next((i for i in range(0, len(data), 8) if not any(data[i:i + 8])), None)
                        bad.append(f"{f.name}: {len(data)} bytes, zeros from offset {first}")
                    with lock:
                        counts["reads"] += 1
            finally:
                os.close(fd)

    def statter(f):
        while time.monotonic() < stop:
            os.stat(f)

    threads = [threading.Thread(target=role, args=(f,)) for f in files
               for role in (rewriter, reader, reader, statter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not bad, f"{len(bad)} of {counts['reads']} reads were no content: {bad[:5]}"
    assert counts["rewrites"] > 100 and counts["reads"] > 1000, counts
