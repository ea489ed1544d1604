"""A random read/write/truncate/mmap exerciser, in the spirit of fsx, through a real mount.

Each file has an in-memory model of its bytes. Seeded random operations run on
a few files through one descriptor each: pwrite at random offsets and sizes
(past EOF, across block boundaries, some zeros and some repeated blocks),
pread, ftruncate up and down, MAP_SHARED mmap reads, MAP_SHARED mmap writes
(with msync, or left to munmap and close), fsync, a whole-file read through a
fresh descriptor, preads and mmap reads through a second read-only descriptor
held open while the first one writes, and close/reopen with O_RDWR, O_RDONLY
or O_WRONLY, sometimes with O_TRUNC. Every read, and the size after every operation, is compared with
the model. After each round the files are closed, ``kvfs-admin flush`` runs,
the filesystem is remounted and every file is compared again; the fixture ends
with a clean fsck. It runs with 1 MiB blocks, with 64 KiB blocks (block
boundaries every few operations), and with 64 KiB blocks under a 1 MiB cache
(writers wait on flushes, reads refetch evicted blocks).

KVFS_FSX_SEED and KVFS_FSX_OPS override the seed and the operations per round:
a failure names the seed, the operation number and the last operations.
"""
import collections
import mmap
import os
import random

import pytest

KiB, MiB = 1 << 10, 1 << 20
PAGE = mmap.PAGESIZE
FILES = 3
ROUNDS = 2
OPS = int(os.environ.get("KVFS_FSX_OPS", "1000"))       # per round, over all files
SEED = int(os.environ.get("KVFS_FSX_SEED", "20240611"))

ACCESS = {"O_RDWR": os.O_RDWR, "O_RDONLY": os.O_RDONLY, "O_WRONLY": os.O_WRONLY}


class Mismatch(AssertionError):
    pass


class File:
    def __init__(self, path):
        self.path = path
        self.model = bytearray()
        self.fd = None
        self.access = None
        self.reader = None            # a second, read-only descriptor kept open meanwhile

    @property
    def readable(self):
        return self.access in ("O_RDWR", "O_RDONLY")

    @property
    def writable(self):
        return self.access in ("O_RDWR", "O_WRONLY")


class Exerciser:
    def __init__(self, mnt, block_size, max_len, seed):
        self.rng = random.Random(seed)
        self.bs = block_size
        self.max_len = max_len
        self.seed = seed
        self.files = [File(mnt / f"fsx-{i}") for i in range(FILES)]
        self.log = collections.deque(maxlen=25)
        self.counts = collections.Counter()
        self.step = 0
        self.repeated = self.rng.randbytes(block_size)       # a block that recurs: dedup

    # -- helpers ------------------------------------------------------------
    def fail(self, what):
        raise Mismatch(f"seed {self.seed}, operation {self.step}: {what}\nlast operations:\n  "
                       + "\n  ".join(self.log))

    def compare(self, got, want, what):
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
            self.fail(f"{what}: {len(got)} bytes read, {len(want)} expected, "
                      f"first difference at +{first}")

    def offset(self, limit):
        """A random offset below ``limit``, near a block boundary a third of the time."""
        r = self.rng.random()
        if r < 0.33 and limit > self.bs:
            boundary = self.bs * self.rng.randrange(1, limit // self.bs + 1)
            return max(0, min(limit - 1, boundary + self.rng.randint(-300, 300)))
        return self.rng.randrange(max(1, limit))

    def length(self):
        r = self.rng.random()
        if r < 0.4:
            return self.rng.randint(1, 512)
        if r < 0.75:
            return self.rng.randint(1, 64 * KiB)
        if r < 0.9:
            return self.bs * self.rng.randint(1, 2)
        return self.rng.randint(1, 3 * self.bs)

    def payload(self, n):
        r = self.rng.random()
        if r < 0.1:
            return bytes(n)                                   # zeros: holes on the device
        if r < 0.2:
            return (self.repeated * (n // self.bs + 1))[:n]
        return self.rng.randbytes(n)

    def open(self, f, access, trunc=False):
        flags = ACCESS[access] | os.O_CREAT | (os.O_TRUNC if trunc else 0)
        f.fd = os.open(f.path, flags, 0o644)
        f.access = access
        if trunc:
            f.model.clear()

    def close(self, f):
        if f.fd is not None:
            os.close(f.fd)
            f.fd = f.access = None

    # -- operations -----------------------------------------------------------
    def op_pwrite(self, f):
        off = self.offset(self.max_len)
        data = self.payload(min(self.length(), self.max_len - off))
        self.log.append(f"pwrite {f.path.name} off={off} len={len(data)} (size {len(f.model)})")
        if os.pwrite(f.fd, data, off) != len(data):
            self.fail("short write")
        if off > len(f.model):
            f.model.extend(bytes(off - len(f.model)))
        f.model[off:off + len(data)] = data

    def op_pread(self, f):
        off = self.offset(len(f.model) + self.bs // 2)
        n = self.length()
        self.log.append(f"pread {f.path.name} off={off} len={n} (size {len(f.model)})")
        self.compare(os.pread(f.fd, n, off), bytes(f.model[off:off + n]), "pread")

    def op_ftruncate(self, f):
        r = self.rng.random()
        if r < 0.2:
            size = 0
        elif r < 0.5:
            size = self.rng.randrange(len(f.model) + 1)                    # down
        else:
            size = self.offset(self.max_len)                               # anywhere
        self.log.append(f"ftruncate {f.path.name} {len(f.model)} -> {size}")
        os.ftruncate(f.fd, size)
        if size < len(f.model):
            del f.model[size:]
        else:
            f.model.extend(bytes(size - len(f.model)))

    def _map_range(self, f):
        off = self.rng.randrange(len(f.model))
        n = min(self.length(), len(f.model) - off)
        start = off - off % PAGE
        return off, n, start

    def op_mmap_read(self, f):
        off, n, start = self._map_range(f)
        self.log.append(f"mmap-read {f.path.name} off={off} len={n} (size {len(f.model)})")
        with mmap.mmap(f.fd, off + n - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                       offset=start) as m:
            self.compare(m[off - start:off - start + n], bytes(f.model[off:off + n]), "mmap read")

    def op_mmap_write(self, f):
        off, n, start = self._map_range(f)
        data = self.payload(n)
        sync = self.rng.random() < 0.6
        self.log.append(f"mmap-write {f.path.name} off={off} len={n} msync={sync} "
                        f"(size {len(f.model)})")
        with mmap.mmap(f.fd, off + n - start, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start) as m:
            m[off - start:off - start + n] = data
            if sync:
                m.flush()
        f.model[off:off + n] = data

    def op_fsync(self, f):
        self.log.append(f"fsync {f.path.name}")
        os.fsync(f.fd)

    def op_read_other_fd(self, f):
        self.log.append(f"read-whole-via-new-fd {f.path.name} (size {len(f.model)})")
        fd = os.open(f.path, os.O_RDONLY)
        try:
            self.compare(read_all(fd), bytes(f.model), "read through a second descriptor")
        finally:
            os.close(fd)

    def op_second_fd_read(self, f):
        """pread or mmap-read through the long-lived second descriptor: caches stay coherent."""
        if f.reader is None:
            f.reader = os.open(f.path, os.O_RDONLY)
        if f.model and self.rng.random() < 0.5:
            off, n, start = self._map_range(f)
            self.log.append(f"second-fd-mmap-read {f.path.name} off={off} len={n}")
            with mmap.mmap(f.reader, off + n - start, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ, offset=start) as m:
                got = m[off - start:off - start + n]
        else:
            off, n = self.offset(len(f.model) + self.bs // 2), self.length()
            self.log.append(f"second-fd-pread {f.path.name} off={off} len={n}")
            got = os.pread(f.reader, n, off)
        self.compare(got, bytes(f.model[off:off + n]), "read through the second descriptor")
        if self.rng.random() < 0.1:
            os.close(f.reader)
            f.reader = None

    def op_reopen(self, f):
        access = self.rng.choice(list(ACCESS))
        trunc = access != "O_RDONLY" and self.rng.random() < 0.15
        self.log.append(f"reopen {f.path.name} {access}{'|O_TRUNC' if trunc else ''}")
        self.close(f)
        self.open(f, access, trunc)

    def choose(self, f):
        ops = [(self.op_reopen, 4), (self.op_read_other_fd, 2), (self.op_fsync, 1),
               (self.op_second_fd_read, 8)]
        if f.writable:
            ops += [(self.op_pwrite, 30), (self.op_ftruncate, 6)]
        if f.readable:
            ops += [(self.op_pread, 20)]
            if f.model:
                ops += [(self.op_mmap_read, 8)]
        if f.access == "O_RDWR" and f.model:
            ops += [(self.op_mmap_write, 12)]
        funcs, weights = zip(*ops)
        return self.rng.choices(funcs, weights)[0]

    def run(self, n):
        for f in self.files:
            if f.fd is None:
                self.open(f, "O_RDWR")
        for _ in range(n):
            self.step += 1
            f = self.rng.choice(self.files)
            op = self.choose(f)
            op(f)
            self.counts[op.__name__[3:]] += 1
            size = os.fstat(f.fd).st_size
            if size != len(f.model):
                self.fail(f"fstat size {size}, model {len(f.model)}")

    def close_all(self):
        for f in self.files:
            self.close(f)
            if f.reader is not None:
                os.close(f.reader)
                f.reader = None

    def verify_files(self, when):
        for f in self.files:
            with open(f.path, "rb") as fh:
                self.compare(fh.read(), bytes(f.model), f"{f.path.name} {when}")
            if f.path.stat().st_size != len(f.model):
                self.fail(f"{f.path.name} {when}: size {f.path.stat().st_size}")


def read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 4 * MiB)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


@pytest.mark.parametrize("block_size, max_len, options, seed_offset", [
    pytest.param(None, 4 * MiB + 333 * KiB, [], 0, id="1M-blocks"),
    pytest.param("64K", MiB + 5 * KiB, [], 1, id="64K-blocks"),
    # A 1 MiB cache holds 16 blocks: writes wait for flushes, and reads refetch evicted blocks.
    pytest.param("64K", MiB + 5 * KiB, ["cache_size=1M", "dirty_limit=512K"], 2,
                 id="64K-blocks-tiny-cache"),
    # The native read plane answers the READs of sealed files (kvfs/fuse/readplane.c).
    pytest.param(None, 4 * MiB + 333 * KiB, ["native_reads=on"], 3, id="1M-blocks-native"),
])
def test_fsx(kvfs_factory, block_size, max_len, options, seed_offset):
    fs = kvfs_factory(size="1G", block_size=block_size, mount_options=options)
    fs.mkfs()
    fs.mount()
    stats = fs.stats()
    bs = stats["block_size"]
    native = "native_reads=on" in options
    if options and not native:
        assert stats["cache_size"] == MiB, stats
    assert bs == (64 * KiB if block_size else MiB)
    x = Exerciser(fs.mnt, bs, max_len, SEED + seed_offset)
    served_natively = 0
    for round_ in range(ROUNDS):
        x.run(OPS)
        x.close_all()
        x.verify_files(f"after round {round_ + 1}")
        fs.flush()
        if native:
            served_natively += fs.stats()["native_reads"]
        fs.remount()
        x.verify_files(f"after flush and remount, round {round_ + 1}")
    # Every kind of operation ran often enough for the test to mean something.
    for kind in ("pwrite", "pread", "ftruncate", "mmap_read", "mmap_write", "reopen", "fsync",
                 "read_other_fd", "second_fd_read"):
        assert x.counts[kind] >= 20, dict(x.counts)
    assert any(f.model for f in x.files)
    if native:
        assert served_natively > 0, "the native read plane answered no READ"
    print(f"fsx seed {x.seed}: {sum(x.counts.values())} operations {dict(x.counts)}")
