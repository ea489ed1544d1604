"""Repro of issue 12's open stress defect: chunked O_TRUNC rewrites under buffered readers.

Not a test (pytest does not collect it): run it by hand, as root, from the repo root,

    .venv/bin/python tests/repro_otrunc_mix.py 120      # seconds

Two files, each with one O_TRUNC rewriter (O_RDWR or O_WRONLY at random, writing
in chunks) and two buffered readers, a stat loop and a cache dropper. Every 4 KiB
page a reader gets must be one of the three contents at that offset. On main at
the end of session 3 it printed 8 bad reads of 124,772 in 120 s (pages mixing the
previous and the new content at a write-chunk boundary); without
kvfs/namespace/truncation.py, 44 of 124,098 (zero-filled pages). See
docs/reliability.md, "Concurrency", "Open defect".
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
for f in files: f.write_bytes(content(*specs[0]))
stop = time.monotonic() + secs
bad, reads = [], [0]
def writer(f, seed):
    rng = random.Random(seed); i = 0
    while time.monotonic() < stop:
        data = content(*specs[i % 3]); i += 1
        fd = os.open(f, rng.choice((os.O_RDWR, os.O_WRONLY)) | os.O_TRUNC)
        pos = 0
        while pos < len(data):
            n = rng.choice((200000, 65536, 12388, len(data)))
            pos += os.write(fd, data[pos:pos + n])
        os.close(fd)
def check(d):
    for off in range(0, len(d), 4096):
        piece = d[off:off + 4096]
        if not any(content(*s)[off:off + len(piece)] == piece for s in specs):
            return off
    return None
def reader(f):
    while time.monotonic() < stop:
        fd = os.open(f, os.O_RDONLY)
        parts = []
        while p := os.read(fd, 65536): parts.append(p)
        os.close(fd)
        d = b"".join(parts); reads[0] += 1
        off = check(d)
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
