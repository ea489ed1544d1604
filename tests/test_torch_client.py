"""kvfs.torch: load/save/key round trips on a plain directory and on a kvfs mount."""
import os

import pytest

torch = pytest.importorskip("torch", reason="kvfs.torch needs the torch extra")

import kvfs.torch as kt  # noqa: E402

MiB = 1 << 20

# Realistic KV chunk shapes (256-token chunks, raw bytes, no header).
KV_CASES = {
    # Llama-3-8B, bf16: [2, 32 layers, 256, 8 heads * 128] = 32 MiB (LMCache local disk)
    "bf16-llama3-8b": (torch.bfloat16, (2, 32, 256, 1024)),
    # Llama-3-70B at TP=4, fp16: [2, 80, 256, 2 heads * 128] = 20 MiB per rank
    "fp16-llama3-70b-tp4": (torch.float16, (2, 80, 256, 256)),
}
if hasattr(torch, "float8_e4m3fn"):
    # DeepSeek-V3 MLA latent cache in fp8: [61 layers, 256, 576] = 8.6 MiB, not MiB-aligned
    KV_CASES["fp8-deepseek-v3-mla"] = (torch.float8_e4m3fn, (61, 256, 576))


def random_tensor(dtype, shape, seed=0):
    """Random bit patterns (NaNs and infs included), viewed as ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * torch.Size(shape).numel()
    raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same_bytes(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@pytest.fixture(params=["plain", "kvfs"])
def target(request, tmp_path):
    """An empty directory to save into: plain tmp, or on a fresh kvfs mount."""
    root = tmp_path if request.param == "plain" else request.getfixturevalue("kvfs").mnt
    d = root / "tensors"      # not the mount root, which holds kvfs's .kvfs directory
    d.mkdir()
    return d


@pytest.mark.parametrize("case", list(KV_CASES))
def test_roundtrip_kv_chunk(target, case):
    dtype, shape = KV_CASES[case]
    t = random_tensor(dtype, shape)
    path = target / f"model@1@0@{case}@chunk.pt"
    kt.save(t, path)

    # Raw bytes only, nothing else left behind (the temp file was renamed away).
    assert path.stat().st_size == t.numel() * t.element_size()
    assert sorted(p.name for p in target.iterdir()) == [path.name]

    back = kt.load(path, dtype=dtype, shape=shape)
    assert same_bytes(back, t)
    assert kt.load(path).numel() == path.stat().st_size  # default: flat uint8


def test_load_into_preallocated_out(target):
    t = random_tensor(torch.bfloat16, (2, 4, 256, 1024), seed=1)
    path = target / "chunk.pt"
    kt.save(t, path)
    out = torch.zeros_like(t)
    assert kt.load(path, out=out) is out
    assert same_bytes(out, t)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, MiB - 1, MiB + 1, 3 * MiB + 12345, 17 * MiB + 3])
def test_odd_sizes(target, nbytes):
    """Range splitting must cover every byte whatever the size (tails, < 1 range, empty)."""
    t = random_tensor(torch.uint8, (nbytes,), seed=nbytes)
    path = target / f"odd-{nbytes}.bin"
    kt.save(t, path)
    assert same_bytes(kt.load(path), t)


def test_save_replaces_atomically(target):
    """A reader that opened the old file keeps the old bytes; new opens see the new ones."""
    old = random_tensor(torch.float16, (2, 8, 256, 128), seed=2)
    new = random_tensor(torch.float16, (2, 8, 256, 128), seed=3)
    path = target / "chunk.pt"
    kt.save(old, path)
    with open(path, "rb") as f:
        kt.save(new, path, fsync=True)
        old_bytes = f.read()
    assert torch.equal(torch.frombuffer(bytearray(old_bytes), dtype=torch.uint8),
                       old.view(torch.uint8).reshape(-1))
    assert same_bytes(kt.load(path, dtype=torch.float16, shape=new.shape), new)
    assert [p.name for p in target.iterdir()] == ["chunk.pt"]


def test_load_reads_in_parallel_ranges_and_survives_short_reads(target, monkeypatch):
    """load issues many preads at distinct offsets and loops when one comes back short."""
    monkeypatch.setenv("KVFS_CLIENT_BYPASS", "off")     # the preads are the subject, not the bypass
    t = random_tensor(torch.bfloat16, (2, 32, 256, 1024), seed=4)  # 32 MiB
    path = target / "chunk.pt"
    kt.save(t, path)

    real_preadv = os.preadv
    calls = []

    def short_preadv(fd, buffers, offset):
        # Deliver at most 300 KiB per call, as a slow or interrupted read might.
        (buf,) = buffers
        calls.append(offset)
        return real_preadv(fd, [buf[:300 * 1024]], offset)

    monkeypatch.setattr(os, "preadv", short_preadv)
    back = kt.load(path, dtype=torch.bfloat16, shape=t.shape)
    assert same_bytes(back, t)
    starts = {off for off in calls if off % MiB == 0}
    assert len(starts) >= 8, "load should split a 32 MiB file into several ranges"
    assert len(calls) > len(starts), "short reads must be retried, not accepted"


def test_pread_full_raises_on_eof(tmp_path):
    """A file shorter than expected is an error, never a silently short tensor."""
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    buf = memoryview(bytearray(4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError):
            kt._pread_full(fd, buf, 0, path)
    finally:
        os.close(fd)


def test_load_rejects_mismatched_geometry(target):
    path = target / "chunk.pt"
    kt.save(torch.zeros(1001, dtype=torch.uint8), path)
    with pytest.raises(ValueError, match="shape"):
        kt.load(path, dtype=torch.uint8, shape=(10, 10))       # 100 bytes != 1001
    with pytest.raises(ValueError, match="multiple"):
        kt.load(path, dtype=torch.float16)                     # 1001 bytes: no whole fp16s
    with pytest.raises(ValueError, match="out holds"):
        kt.load(path, out=torch.empty(1000, dtype=torch.uint8))


def test_pin_memory(target):
    path = target / "chunk.pt"
    t = random_tensor(torch.bfloat16, (2, 2, 256, 128))
    kt.save(t, path)
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.is_available():
        back = kt.load(path, dtype=t.dtype, shape=t.shape, pin_memory=True)
        assert back.is_pinned() and same_bytes(back, t)
    else:
        # Asking for pinned memory where none exists must fail loudly, not degrade.
        with pytest.raises(RuntimeError):
            kt.load(path, dtype=t.dtype, shape=t.shape, pin_memory=True)


def test_key_off_kvfs_is_a_clear_error(tmp_path):
    path = tmp_path / "chunk.pt"
    kt.save(torch.zeros(16, dtype=torch.uint8), path)
    with pytest.raises(kt.NotOnKvfsError, match="not a file on a kvfs mount"):
        kt.key(path)


def test_key_opens_same_bytes_by_hash(kvfs):
    dtype, shape = KV_CASES["bf16-llama3-8b"]
    t = random_tensor(dtype, shape, seed=5)
    a, b, c = kvfs.mnt / "rank0.pt", kvfs.mnt / "rank1.pt", kvfs.mnt / "other.pt"
    kt.save(t, a)
    kt.save(t, b)
    kt.save(random_tensor(dtype, shape, seed=6), c)

    ka = kt.key(a)
    assert len(ka) >= 16 and int(ka, 16) >= 0       # a hex string
    assert kt.key(b) == ka                          # same bytes, same key
    assert kt.key(c) != ka

    by_hash = kt.by_hash_path(kvfs.mnt, ka)
    assert by_hash.stat().st_size == a.stat().st_size
    assert same_bytes(kt.load(by_hash, dtype=dtype, shape=shape), t)
    with open(by_hash, "rb") as f1, open(a, "rb") as f2:
        assert f1.read() == f2.read()
