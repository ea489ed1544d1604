"""kvfs.device._readcore.read_into: blocks straight into caller buffers, on several threads.

A "device" is a plain file with blocks at sector-aligned offsets, keyed as kvfs keys
them (tests/unit/test_readcore.py does the same for read_verified). What must hold:
bit-exact bytes wherever the destination lies (aligned: in place; not: through a
bounce buffer), zeros past a block's length, a bad block reported by index and no
other block affected, bounds checked before anything is read, read errors as OSError.
"""
import errno
import mmap
import os

import pytest
import xxhash

from kvfs.device import _readcore

S = 4096
SEED = 0xC0FFEE_15_600D
SECRET = bytes(range(7, 39))
SALT = (0x1234_5678_9ABC_DEF1).to_bytes(8, "little")


def _key(data, salt=SALT):
    return xxhash.xxh3_128(SECRET + salt + data, seed=SEED).digest()


@pytest.fixture
def device(tmp_path):
    """Blocks of assorted lengths, some adjacent and some not; (fd, [(off, data)])."""
    lengths = [64 << 10, 64 << 10, 100, 64 << 10, 5000, S, 3 * S + 1, 64 << 10]
    path = tmp_path / "dev"
    placed, off = [], 0
    with open(path, "wb") as f:
        for i, n in enumerate(lengths):
            data = os.urandom(n)
            if i == 4:
                off += 8 * S                    # a gap: a new run
            f.seek(off)
            f.write(data)
            placed.append((off, data))
            off += -(-n // S) * S
        f.truncate(off + S)
    fd = os.open(path, os.O_RDONLY)
    yield fd, placed, path
    os.close(fd)


def _blocks(placed, dest=0, start=0, copy=None):
    out, pos = [], start
    for off, data in placed:
        n = len(data) if copy is None else copy
        out.append((off, len(data), _key(data), SALT, dest, pos, n))
        pos += n
    return out


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("shift", [0, 1, S])
def test_blocks_land_bit_exact_aligned_or_not(device, threads, shift):
    fd, placed, _ = device
    want = b"".join(d for _, d in placed)
    buf = mmap.mmap(-1, len(want) + 2 * S)          # page aligned: shift 0 and S land in place
    assert _readcore.read_into(fd, SEED, _blocks(placed, start=shift), [buf], SECRET, threads=threads) == []
    assert buf[shift:shift + len(want)] == want
    assert buf[:shift] == bytes(shift)             # nothing before the destination written


def test_zeros_past_a_block_and_short_copies(device):
    fd, placed, _ = device
    off, data = placed[2]                            # 100 bytes
    buf = bytearray(b"\xff" * 300)
    blocks = [(off, len(data), _key(data), SALT, 0, 0, 250), (off, len(data), _key(data), SALT, 0, 250, 40)]
    assert _readcore.read_into(fd, SEED, blocks, [buf], SECRET) == []
    assert buf[:100] == data and buf[100:250] == bytes(150) and buf[250:290] == data[:40]
    assert buf[290:] == b"\xff" * 10


def test_several_buffers_and_a_bad_block_fails_alone(device):
    fd, placed, _ = device
    bufs = [bytearray(len(d)) for _, d in placed]
    blocks = [(off, len(d), _key(d), SALT, i, 0, len(d)) for i, (off, d) in enumerate(placed)]
    blocks[3] = blocks[3][:2] + (bytes(16),) + blocks[3][3:]        # a wrong key
    blocks[5] = blocks[5][:3] + (b"",) + blocks[5][4:]               # the salt left out
    assert _readcore.read_into(fd, SEED, blocks, bufs, SECRET, threads=4) == [3, 5]
    for i, (_, data) in enumerate(placed):
        if i not in (3, 5):
            assert bytes(bufs[i]) == data
    assert _readcore.read_into(fd, SEED, blocks, bufs, b"") != []    # another secret: other keys


def test_bounds_and_arguments_are_checked_before_reading(device):
    fd, placed, _ = device
    off, data = placed[0]
    good = (off, len(data), _key(data), SALT, 0, 0, len(data))
    buf = bytearray(len(data))
    for bad, exc in [((off + 1,) + good[1:], ValueError),                       # not a sector
                     (good[:4] + (1,) + good[5:], ValueError),                  # no such buffer
                     (good[:5] + (1, len(data)), ValueError),                   # past its end
                     (good[:2] + (b"short",) + good[3:], ValueError),
                     (good[:6], TypeError)]:
        with pytest.raises(exc):
            _readcore.read_into(fd, SEED, [bad], [buf], SECRET)
    with pytest.raises(BufferError):
        _readcore.read_into(fd, SEED, [good], [bytes(len(data))], SECRET)      # read-only
    assert _readcore.read_into(fd, SEED, [], [], SECRET) == []


def test_read_errors_are_oserrors(device, tmp_path):
    fd, placed, path = device
    off, data = placed[-1]
    size = os.path.getsize(path)
    past = (size + S, len(data), _key(data), SALT, 0, 0, len(data))
    with pytest.raises(OSError) as caught:
        _readcore.read_into(fd, SEED, [past], [bytearray(len(data))], SECRET)
    assert caught.value.errno == errno.EIO
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)
    with pytest.raises(OSError) as caught:
        _readcore.read_into(closed, SEED, [past[:0] + (off,) + past[1:]], [bytearray(len(data))], SECRET)
    assert caught.value.errno == errno.EBADF
