"""Hunts the race behind tests/test_page_writer_opens.py: chunked O_TRUNC rewrites under buffered readers.

Not a test (pytest does not collect it): run it by hand, as root, from the repo root,

    .venv/bin/python tests/repro_otrunc_mix.py 600      # seconds

Two files, each with one O_TRUNC rewriter (O_RDWR or O_WRONLY at random, writing
in chunks) and two buffered readers, plus a stat loop and a cache dropper. Each
reader reads the whole file with read() calls of 64 KiB; every 4 KiB page it gets
must be, piece by piece, the bytes of one of the three contents at that offset,
cut only where one of the contents ends or where one read() call ended (a later
call may see a later state: that is POSIX). Zeros and a mix within one call's
page are the defect. Before kvfs/namespace/pagecache.py it met two in 212,187
reads (three runs): a page-cache writer's pages dropped (by another open, or by
a GETATTR reply with a new mtime) between its copy into them and its WRITE, and
a reader caching the daemon's older bytes in their place. With only the open
half of the fix, one in 560,808 (the GETATTR drop); with all of it, one in
818,143 (400 s and 700 s), by windows kvfs cannot close from the daemon.
See docs/reliability.md, "Concurrency": "The drops kvfs cannot foresee, repaired".
"""
import os, sys, threading, time, tempfile, random
sys.path.insert(0, "tests")
from pathlib import Path
from kvfsmount import KvfsMount
from stress_oracle import content
secs = float(sys.argv[1]) if len(sys.argv) > 1 else 20
root = Path(tempfile.mkdtemp(prefix="kvfs-repro-", dir="/tmp"))
fs = KvfsMount(root, size="1G", block_size="64K", mount_options=["cache_size=2M", "dirty_limit=1M", "eviction_policy=none"])
fs.mkfs(); fs.mount()
files = [fs.mnt / f"f{i}" for i in range(2)]
specs = [(9783, 276018), (5, 331779), (6, 196603)]
contents = {s: content(*s) for s in specs}
for f in files: f.write_bytes(contents[specs[0]])
stop = time.monotonic() + secs
bad, reads = [], [0]
def writer(f, seed):
    rng = random.Random(seed); i = 0
    while time.monotonic() < stop:
        data = contents[specs[i % 3]]; i += 1
        fd = os.open(f, rng.choice((os.O_RDWR, os.O_WRONLY)) | os.O_TRUNC)
        pos = 0
        while pos < len(data):
            n = rng.choice((200000, 65536, 12388, len(data)))
            pos += os.write(fd, data[pos:pos + n])
        os.close(fd)
def piece_ok(off, piece):
    return any(c[off:off + len(piece)] == piece for c in contents.values())
def check(d, call_ends):
    for off in range(0, len(d), 4096):
        piece = d[off:off + 4096]
        if piece_ok(off, piece):
            continue
        cuts = sorted({end - off for end in [s[1] for s in specs] + call_ends if 0 < end - off < len(piece)})
        if not cuts or not all(piece_ok(off + a, piece[a:b]) for a, b in zip([0] + cuts, cuts + [len(piece)])):
            return off
    return None
def reader(f):
    while time.monotonic() < stop:
        fd = os.open(f, os.O_RDONLY)
        parts, call_ends, pos = [], [], 0
        while p := os.read(fd, 65536):
            parts.append(p); pos += len(p); call_ends.append(pos)
        os.close(fd)
        d = b"".join(parts); reads[0] += 1
        off = check(d, call_ends)
        if off is not None: bad.append((f.name, len(d), off))
def statter(f):
    while time.monotonic() < stop: os.stat(f)
def dropper():
    while time.monotonic() < stop:
        time.sleep(0.5); os.setxattr(fs.mnt, "user.kvfs.control", b"drop-caches")
ts = [threading.Thread(target=r, args=(f, *( (hash(f.name),) if r is writer else ()))) for f in files for r in (writer, reader, reader, statter)] + [threading.Thread(target=dropper)]
[t.start() for t in ts]; [t.join() for t in ts]
print("reads", reads[0], "bad", len(bad), bad[:5])
fs.umount()
