"""The C read core (kvfs/device/readcore.c) through kvfs.device._readcore, on real files.

A "device" here is a plain file with blocks written at sector-aligned offsets,
keyed as kvfs keys them (kvfs/blockindex/__init__.py, BlockIndex.key_of): the
seeded xxh3-128 of secret + salt + data. The native read plane and the bypass
client use the same C code; these tests pin it to what Python computes and reads.
"""
import errno
import os
import shutil
import tempfile
import threading

import pytest
import xxhash

from kvfs.device import Device
from kvfs.device import _readcore
from kvfs.device.verified import BlockCheck, read_run_verified_sync

from kvfs.namespace import ROOT_INO

from .helpers import DEV_SIZE, assert_fsck_clean, close_and_check, mkfs, open_fs, pattern, running

S = 4096
SEED = 0x5EED_0F_C0FFEE
SECRET = bytes(range(100, 132))
IOV_MAX = os.sysconf("SC_IOV_MAX")


ALICE, BOB = 1000, 1001


def span(length):
    return (max(length, 1) + S - 1) // S * S


def key(data, salt=b"", seed=SEED, secret=b""):
    return xxhash.xxh3_128(secret + salt + data, seed=seed).digest()


def layout(base=0):
    """(dev_off, length, salt) of each block: runs of adjacent blocks, gaps between them.

    Lengths: 1 byte, exactly a sector, not a multiple of a sector, 1 MiB."""
    runs = [
        [(1, b""), (S, b""), (5000, b"\x01" * 8), (1 << 20, b""), (S - 1, (7).to_bytes(8, "little"))],
        [(12345, (12345).to_bytes(8, "little")), (S, b"\xff" * 8), (70000, b"")],
        [(2 * S + 100, b"saltsalt")],
    ]
    out, off = [], base
    for run in runs:
        for length, salt in run:
            out.append((off, length, salt))
            off += span(length)
        off += 3 * S                                    # a gap: the next run is not adjacent
    return out


class Store:
    """A device file holding the blocks of ``layout()`` and their keys."""

    def __init__(self, path, *, secret=b"", base=0):
        self.path, self.secret = path, secret
        self.blocks, self.data = [], []
        with open(path, "wb") as f:
            for i, (off, length, salt) in enumerate(layout(base)):
                data = pattern(i + 1, length)
                f.seek(off)
                f.write(data)
                self.blocks.append((off, length, key(data, salt, secret=secret), salt))
                self.data.append(data)
            self.end = off + span(length)
            f.truncate(self.end)                        # the last block's padding is there too

    def flip(self, i, at=0):
        """Corrupt byte ``at`` of block ``i`` on the "disk"."""
        off = self.blocks[i][0] + at
        with open(self.path, "r+b") as f:
            f.seek(off)
            old = f.read(1)
            f.seek(off)
            f.write(bytes([old[0] ^ 0x5A]))


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "dev")


@pytest.fixture
def fd(store):
    fd = os.open(store.path, os.O_RDONLY)
    yield fd
    os.close(fd)


def read_syscalls():
    """Read system calls made by this thread so far (preadv counts as one)."""
    if not os.path.exists("/proc/thread-self/io"):
        pytest.skip("this kernel keeps no per-task I/O accounting (/proc/thread-self/io)")
    with open("/proc/thread-self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["syscr"])


def test_reads_every_block_exactly(store, fd):
    assert _readcore.read_verified(fd, SEED, store.blocks) == store.data
    # Any order, any subset: blocks out of device order are read, just not in one preadv.
    order = [6, 0, 3, 2, 8]
    assert _readcore.read_verified(fd, SEED, [store.blocks[i] for i in order]) == [store.data[i] for i in order]
    assert _readcore.read_verified(fd, SEED, []) == []


def test_a_secret_is_hashed_before_salt_and_data(tmp_path):
    store = Store(tmp_path / "dev", secret=SECRET)
    fd = os.open(store.path, os.O_RDONLY)
    try:
        assert _readcore.read_verified(fd, SEED, store.blocks, secret=SECRET) == store.data
        assert _readcore.read_verified(fd, SEED, store.blocks) == [None] * len(store.blocks)
        assert _readcore.read_verified(fd, SEED, store.blocks, secret=bytes(32)) == [None] * len(store.blocks)
    finally:
        os.close(fd)


def test_one_preadv_per_run_of_adjacent_blocks(store, fd):
    _readcore.read_verified(fd, SEED, [])                   # warm up: nothing is read
    before = read_syscalls()
    _readcore.read_verified(fd, SEED, [])
    idle = read_syscalls() - before                         # what measuring itself costs
    before = read_syscalls()
    _readcore.read_verified(fd, SEED, store.blocks)
    assert read_syscalls() - before - idle == 3             # three runs in layout()


def test_a_run_longer_than_iov_max_is_split(tmp_path):
    n = IOV_MAX + 5
    data = [bytes([i % 251 + 1]) for i in range(n)]         # 1-byte blocks, one sector each
    path = tmp_path / "dev"
    with open(path, "wb") as f:
        for i, d in enumerate(data):
            f.seek(i * S)
            f.write(d)
        f.truncate(n * S)
    blocks = [(i * S, 1, key(d), b"") for i, d in enumerate(data)]
    fd = os.open(path, os.O_RDONLY)
    try:
        before = read_syscalls()
        _readcore.read_verified(fd, SEED, [])
        idle = read_syscalls() - before
        before = read_syscalls()
        assert _readcore.read_verified(fd, SEED, blocks) == data
        assert read_syscalls() - before - idle == 2
    finally:
        os.close(fd)


def test_a_corrupt_block_fails_alone(store, fd):
    store.flip(2, at=4999)                                  # the last byte of the 5000-byte block
    store.flip(3, at=1 << 19)                               # the middle of the 1 MiB one
    got = _readcore.read_verified(fd, SEED, store.blocks)
    assert got[2] is None and got[3] is None
    assert [g for i, g in enumerate(got) if i not in (2, 3)] == [d for i, d in enumerate(store.data)
                                                                 if i not in (2, 3)]


def test_padding_is_not_hashed(store, fd):
    off, length, _, _ = store.blocks[2]
    with open(store.path, "r+b") as f:                      # garbage after the block's bytes
        f.seek(off + length)
        f.write(b"\xaa" * (span(length) - length))
    assert _readcore.read_verified(fd, SEED, store.blocks) == store.data


def test_a_key_from_another_seed_fails(store, fd):
    assert _readcore.read_verified(fd, SEED + 1, store.blocks) == [None] * len(store.blocks)
    wrong_salt = [(off, length, k, b"" if salt else b"\0" * 8) for off, length, k, salt in store.blocks]
    assert _readcore.read_verified(fd, SEED, wrong_salt) == [None] * len(store.blocks)


def test_the_largest_seed_agrees_with_python(store, fd):
    seed = 2 ** 64 - 1
    blocks = [(off, length, key(d, salt, seed=seed), salt) for (off, length, _, salt), d in zip(store.blocks, store.data)]
    assert _readcore.read_verified(fd, seed, blocks) == store.data


def test_reading_past_the_end_is_eio(store, fd):
    last_off, last_len, last_key, last_salt = store.blocks[-1]
    beyond = (store.end, 10, key(b"x" * 10), b"")
    with pytest.raises(OSError) as info:
        _readcore.read_verified(fd, SEED, store.blocks[:2] + [beyond])
    assert info.value.errno == errno.EIO
    # A block cut short by the end of the file: EIO too, never a short "verified" block.
    os.truncate(store.path, last_off + last_len - 1)
    with pytest.raises(OSError) as info:
        _readcore.read_verified(fd, SEED, [store.blocks[-1]])
    assert info.value.errno == errno.EIO
    # Only its padding missing: the block is whole, and it reads.
    with open(store.path, "r+b") as f:
        f.seek(last_off + last_len - 1)
        f.write(store.data[-1][-1:])
    assert os.path.getsize(store.path) == last_off + last_len < store.end
    assert _readcore.read_verified(fd, SEED, store.blocks) == store.data


def test_a_read_error_is_oserror_with_its_errno(store):
    fd = os.open(store.path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError) as info:
        _readcore.read_verified(fd, SEED, store.blocks)
    assert info.value.errno == errno.EBADF
    fd = os.open(store.path, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as info:
            _readcore.read_verified(fd, SEED, store.blocks)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


K = bytes(16)


@pytest.mark.parametrize("args, error, message", [
    ((-1, SEED, [(0, 1, K, b"")]), ValueError, "fd must not be negative"),
    (("3", SEED, []), TypeError, "fd must be an int, not str"),
    ((0, -1, []), ValueError, "seed must not be negative"),
    ((0, 2 ** 64, []), ValueError, "seed is too large"),
    ((0, 1.5, []), TypeError, "seed must be an int, not float"),
    ((0, SEED, 5), TypeError, r"blocks must be a list of \(dev_off, length, key, salt\) tuples"),
    ((0, SEED, [[0, 1, K, b""]]), TypeError, r"blocks\[0\] must be a \(dev_off, length, key, salt\) tuple, not list"),
    ((0, SEED, [(0, 1, K)]), TypeError, r"blocks\[0\] must be a \(dev_off, length, key, salt\) tuple"),
    ((0, SEED, [(0, 1, K, b""), (100, 1, K, b"")]), ValueError, r"blocks\[1\] dev_off must be a multiple of 4096, got 100"),
    ((0, SEED, [(-S, 1, K, b"")]), ValueError, r"blocks\[0\] dev_off must not be negative"),
    ((0, SEED, [(0, -1, K, b"")]), ValueError, r"blocks\[0\] length must not be negative"),
    ((0, SEED, [(0, 2 ** 32, K, b"")]), ValueError, r"blocks\[0\] length is too large"),
    ((0, SEED, [(2 ** 63 - S, S + 1, K, b"")]), ValueError, r"blocks\[0\] ends beyond the largest device offset"),
    ((0, SEED, [(0, 1, K[:15], b"")]), ValueError, r"blocks\[0\] key must be 16 bytes, got 15"),
    ((0, SEED, [(0, 1, K.hex(), b"")]), TypeError, r"blocks\[0\] key must be bytes, not str"),
    ((0, SEED, [(0, 1, K, b"1234")]), ValueError, r"blocks\[0\] salt must be 0 or 8 bytes, got 4"),
    ((0, SEED, [(0, 1, K, None)]), TypeError, r"blocks\[0\] salt must be bytes, not NoneType"),
])
def test_bad_arguments_are_refused_before_anything_is_read(args, error, message):
    with pytest.raises(error, match=message):
        _readcore.read_verified(*args)


def test_a_bad_secret_is_refused():
    with pytest.raises(ValueError, match="secret must be 0 or 32 bytes, got 16"):
        _readcore.read_verified(0, SEED, [], secret=bytes(16))
    with pytest.raises(ValueError, match="secret must be 0 or 32 bytes, got 16"):
        _readcore.matches(SEED, b"", K, secret=bytes(16))


def test_matches_agrees_with_xxhash():
    for data in (b"", b"x", pattern(1, S), pattern(2, 100_000)):      # 100 kB: hashed without the GIL
        for salt in (b"", (12345).to_bytes(8, "little")):
            for secret in (b"", SECRET):
                k = key(data, salt, secret=secret)
                assert _readcore.matches(SEED, data, k, salt, secret=secret)
                assert _readcore.matches(SEED, memoryview(bytearray(data)), k, salt=salt, secret=secret)
                assert not _readcore.matches(SEED + 1, data, k, salt, secret=secret)
                assert not _readcore.matches(SEED, data + b"\0", k, salt, secret=secret)
    with pytest.raises(ValueError, match="key must be 16 bytes, got 8"):
        _readcore.matches(SEED, b"x", bytes(8))
    with pytest.raises(TypeError, match="data must be bytes-like, not str"):
        _readcore.matches(SEED, "x", K)


def test_threads_read_and_verify_at_once(store, fd):
    results, errors = [], []

    def reader():
        try:
            for _ in range(20):
                results.append(_readcore.read_verified(fd, SEED, store.blocks) == store.data)
        except BaseException as exc:            # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [True] * 80


def test_agrees_with_the_python_read_path(tmp_path):
    """Blocks written through a kvfs Device into a formatted store's unused tail, read both ways."""
    path = mkfs(tmp_path)
    base = DEV_SIZE - 4 * (1 << 20)                         # the tail of the data region, unused
    dev = Device.open(str(path))
    try:
        blocks, data = [], []
        for i, (off, length, salt) in enumerate(layout(base)):
            d = pattern(100 + i, length)
            dev.pwrite_sync(off, d)
            blocks.append((off, length, key(d, salt), salt))
            data.append(d)
        dev.sync_sync()
        assert blocks[-1][0] + span(blocks[-1][1]) <= DEV_SIZE
        flip = blocks[3][0] + 77
        with open(path, "r+b") as f:
            f.seek(flip)
            old = f.read(1)
            f.seek(flip)
            f.write(bytes([old[0] ^ 1]))
        got = _readcore.read_verified(dev.fd, SEED, blocks)
        keyed = xxhash.xxh3_128(seed=SEED)
        run_starts = [0, 5, 8, len(blocks)]
        for start, end in zip(run_starts, run_starts[1:]):
            checks = [BlockCheck(length, k, salt) for _, length, k, salt in blocks[start:end]]
            views = read_run_verified_sync(dev, blocks[start][0], checks, [None] * len(checks), keyed)
            assert [None if v is None else bytes(v) for v in views] == got[start:end]
        assert got[3] is None and got[:3] + got[4:] == data[:3] + data[4:]
        with open(path, "r+b") as f:                        # put the byte back: fsck checks the whole file
            f.seek(flip)
            f.write(old)
    finally:
        dev.close()
    assert_fsck_clean(path)


async def write_as(ns, uid, name, data):
    ino = ns.make(ROOT_INO, name, 0o100600, uid, uid)
    fh, _, _ = ns.open(ino, os.O_WRONLY)
    await ns.write(fh, 0, data)
    await ns.release(fh)


async def test_reads_a_real_stores_blocks_as_the_index_does(tmp_path):
    """Files written through the whole stack (two uids: two dedup domains, a key secret)."""
    fs = open_fs(mkfs(tmp_path))
    async with running(fs):
        await write_as(fs.ns, ALICE, b"a", pattern(1, 5 * 64 * 1024 + 1000))
        await write_as(fs.ns, BOB, b"b", pattern(2, 3 * 64 * 1024))
    assert len(fs.store.key_secret) == _readcore.SECRET_MAX
    entries = fs.index.entries
    runs = fs.index.adjacent_runs(list(entries), 64)
    assert max(len(run) for run in runs) > 1
    for run in runs:
        blocks = [(entries[k].off, entries[k].length, k,
                   entries[k].domain.to_bytes(8, "little") if entries[k].domain else b"") for k in run]
        assert all(salt for *_, salt in blocks)             # a version 2 store salts every domain
        got = _readcore.read_verified(fs.device.fd, fs.store.hash_seed, blocks, secret=fs.store.key_secret)
        expected = await fs.index.read_run(run, [None] * len(run))
        assert got == [bytes(v) for v in expected]
    close_and_check(fs)


def test_o_direct(tmp_path):
    """With O_DIRECT (the device's normal mode): on the VM's disk, since tmpfs refuses it."""
    where = tempfile.mkdtemp(prefix="kvfs-readcore-", dir="/var/tmp")
    try:
        store = Store(os.path.join(where, "dev"), secret=SECRET)
        try:
            fd = os.open(store.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                pytest.skip(f"{where}: the filesystem refuses O_DIRECT")
            raise
        try:
            assert _readcore.read_verified(fd, SEED, store.blocks, secret=SECRET) == store.data
            store.flip(4)
            got = _readcore.read_verified(fd, SEED, store.blocks, secret=SECRET)
            assert got[4] is None and got[:4] + got[5:] == store.data[:4] + store.data[5:]
            # The file ends mid-sector: O_DIRECT returns a short transfer, then 0 (ext4) or
            # EINVAL (a filesystem that checks alignment first) for the unaligned offset
            # that would continue it. A block that is all there reads...
            last_off, last_len = store.blocks[-1][:2]
            os.truncate(store.path, last_off + last_len + 10)
            assert _readcore.read_verified(fd, SEED, store.blocks[-1:], secret=SECRET) == store.data[-1:]
            # ...one cut short is EIO.
            os.truncate(store.path, last_off + last_len - 10)
            with pytest.raises(OSError) as info:
                _readcore.read_verified(fd, SEED, store.blocks[-1:], secret=SECRET)
            assert info.value.errno == errno.EIO
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(where)
