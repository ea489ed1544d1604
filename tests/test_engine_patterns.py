"""The other engines' file patterns, replayed syscall for syscall through a real mount.

Each test reproduces what one engine's storage code does (names, open flags, write
and read shapes, renames, existence checks), then checks that every byte comes back
and that no call returned short: the engines never check byte counts, so a short
write or read would silently corrupt the KV cache.
"""
import hashlib
import mmap
import os
import random
import secrets
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from threads import Workers

MiB = 1 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)


# -- helpers ----------------------------------------------------------------

def payload(nbytes: int, seed) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def random_hashes(n: int, seed, signed=True) -> list[int]:
    """``n`` distinct random 64-bit hashes (signed like Python's hash(), or unsigned)."""
    rng, out = random.Random(seed), set()
    while len(out) < n:
        h = rng.getrandbits(64)
        out.add(h - 2**63 if signed else h)
    return sorted(out, key=lambda h: rng.random())


def aligned_buffer(data: bytes) -> mmap.mmap:
    """A page-aligned copy of ``data``: what O_DIRECT users allocate (posix_memalign)."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return buf


def write_once(fd: int, data) -> None:
    """One write() of the whole buffer, as the engines do; a short count is a bug."""
    n = os.write(fd, data)
    assert n == len(data), f"short write: {n} of {len(data)}"


def run_threads(fn, items, threads=4):
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def regular_files(root):
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, _, names in os.walk(root) for n in names)


# -- LMCache fs:// connector --------------------------------------------------

def lmcache_fs_name(key: str) -> str:
    # FSConnector._get_file_name: CacheEngineKey.to_string() with '/' made safe.
    return key.replace("/", "-SEP-") + ".data"


def lmcache_fs_put(base, key: str, data: bytes, odirect: bool) -> None:
    final = base / lmcache_fs_name(key)
    tmp = final.with_suffix(".tmp")                      # FSConnector's temp name
    if odirect:
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | O_DIRECT, 0o644)
        try:
            write_once(fd, aligned_buffer(data))
        finally:
            os.close(fd)
    else:
        with open(tmp, "wb") as f:                        # aiofiles.open(tmp, "wb")
            assert f.write(data) == len(data)
    os.replace(tmp, final)                                # aiofiles.os.replace


def lmcache_fs_get(base, key: str, size: int, odirect: bool) -> bytes:
    path = base / lmcache_fs_name(key)
    buf = mmap.mmap(-1, size)
    if odirect:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
        with os.fdopen(fd, "rb", buffering=0) as f:
            n = f.readinto(buf)
    else:
        with open(path, "rb") as f:
            n = f.readinto(buf)
    assert n == size, f"short read: {n} of {size}"
    return bytes(buf)


@pytest.mark.parametrize("odirect", [False, True], ids=["buffered", "odirect"])
def test_lmcache_fs_connector(kvfs, odirect):
    base = kvfs.mnt / "lmcache-fs"
    base.mkdir()
    size = 4 * MiB
    keys = [f"meta-llama/Meta-Llama-3.1-8B@1@0@{h:x}@bfloat16"
            for h in random_hashes(8, 1)]
    data = {k: payload(size, k) for k in keys}

    run_threads(lambda k: lmcache_fs_put(base, k, data[k], odirect), keys)

    # Existence checks are stat() calls; absent keys must say no.
    assert all(os.path.exists(base / lmcache_fs_name(k)) for k in keys)
    assert not os.path.exists(base / lmcache_fs_name("meta-llama/absent@1@0@0@bfloat16"))
    # list(): glob("*.data"); no temp file may survive a replace.
    assert sorted(p.name for p in base.glob("*.data")) == sorted(map(lmcache_fs_name, keys))
    assert not list(base.glob("*.tmp"))
    for k in keys:
        assert lmcache_fs_get(base, k, size, odirect) == data[k]

    # remove_sync: os.remove.
    os.remove(base / lmcache_fs_name(keys[0]))
    assert not os.path.exists(base / lmcache_fs_name(keys[0]))


def test_replace_is_atomic_under_concurrent_readers(kvfs):
    """Readers racing os.replace see the old file or the new one, never a mix."""
    base = kvfs.mnt
    key = "meta-llama/Meta-Llama-3-8B@1@0@7c90e754c24a955f@bfloat16"
    versions = [payload(2 * MiB, f"v{i}") for i in range(2)]
    lmcache_fs_put(base, key, versions[0], odirect=False)
    seen = []

    def reader(stop):
        while not stop.is_set():
            got = lmcache_fs_get(base, key, 2 * MiB, odirect=False)     # asserts a full read
            seen.append(versions.index(got) if got in versions else -1)

    # Leaving the block stops and joins the reader, and re-raises its failure
    # (a short read, an OSError): a reader that died must not pass the test.
    with Workers() as workers:
        workers.start(reader, workers.stop)
        for i in range(30):
            if workers.failed:
                break
            lmcache_fs_put(base, key, versions[i % 2], odirect=False)
    assert seen and -1 not in seen, "a reader saw a torn or mixed file"


# -- SGLang HiCacheFile -------------------------------------------------------

class HiCacheFile:
    """SGLang's file storage backend for HiCache, reduced to its file operations."""

    def __init__(self, root, model: str, tp_rank: int, tp_size: int):
        self.root = root
        os.makedirs(root, exist_ok=True)
        model = "-".join(model.split("/"))
        self.suffix = f"_{model}_{tp_rank}_{tp_size}"

    def path(self, key: str) -> str:
        return os.path.join(self.root, f"{key}{self.suffix}.bin")

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def set(self, key: str, value) -> bool:
        if self.exists(key):
            return True
        path = self.path(key)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        value.tofile(tmp)            # numpy: fopen("wb") + one fwrite of the array
        os.replace(tmp, path)
        return True

    def get(self, key: str, target):
        with open(self.path(key), "rb", buffering=0) as f:
            n = f.readinto(memoryview(target).cast("B"))
        assert n == target.nbytes, f"short read for {key}: {n} of {target.nbytes}"
        return target


def sglang_page_keys(tokens, page_size):
    """SGLang's chained sha256 page hashes (hex), one per page of token ids."""
    keys, prior = [], None
    for i in range(0, len(tokens), page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        for t in tokens[i:i + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        keys.append(prior)
    return keys


def test_sglang_hicache_file(kvfs):
    np = pytest.importorskip("numpy")
    page_size, layers, hidden = 64, 36, 512          # Qwen3-8B at TP=2, bf16 as uint16
    tokens = random.Random(2).choices(range(150_000), k=16 * page_size)
    keys = sglang_page_keys(tokens, page_size)
    rng = np.random.default_rng(2)

    for tp_rank in range(2):
        store = HiCacheFile(str(kvfs.mnt / "hicache"), "Qwen/Qwen3-8B", tp_rank, 2)
        pages = {k: rng.integers(0, 2**16, size=(2, layers, page_size, hidden), dtype=np.uint16)
                 for k in keys}
        run_threads(lambda k: store.set(k, pages[k]), keys)
        assert store.set(keys[0], pages[keys[0]])     # already there: no rewrite
        assert all(store.exists(k) for k in keys)
        assert not store.exists("0" * 64)
        for k in keys:
            target = np.empty_like(pages[k])           # preallocated host buffer
            assert np.array_equal(store.get(k, target), pages[k])

    names = os.listdir(kvfs.mnt / "hicache")
    assert len(names) == 2 * len(keys)
    assert all(n.endswith(("_Qwen-Qwen3-8B_0_2.bin", "_Qwen-Qwen3-8B_1_2.bin")) for n in names)


# -- vLLM file tier -----------------------------------------------------------

class VllmFileTier:
    """vLLM's offloading file tier: hashed nested dirs, O_DIRECT, temp then rename."""

    def __init__(self, root, model: str, rank: int, config: str):
        digest = hashlib.sha256(config.encode()).hexdigest()[:16]
        self.base = os.path.join(root, f"{model.replace('/', '-')}_{digest}_r{rank}")

    def path(self, block_hash: int) -> str:
        h = f"{block_hash & (2**64 - 1):016x}"
        return os.path.join(self.base, h[:3], h[3:5], f"{h}.bin")

    def store(self, block_hash: int, data: bytes) -> None:
        path = self.path(block_hash)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}_{secrets.randbits(32)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
        try:
            write_once(fd, aligned_buffer(data))
        finally:
            os.close(fd)
        os.rename(tmp, path)

    def load(self, block_hash: int) -> bytes:
        fd = os.open(self.path(block_hash), os.O_RDONLY | O_DIRECT)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)       # file size the way ifstream(ate) gets it
            os.lseek(fd, 0, os.SEEK_SET)
            buf = mmap.mmap(-1, size)
            n = os.readv(fd, [buf])
            assert n == size, f"short read: {n} of {size}"
            return bytes(buf)
        finally:
            os.close(fd)

    def touch(self, block_hash: int) -> None:
        """Bump atime only, keep mtime (LRU bookkeeping for external cleanup)."""
        path = self.path(block_hash)
        st = os.stat(path)
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))


def test_vllm_file_tier(kvfs):
    size = 2 * MiB                                   # 16 blocks x 16 tokens, aligned
    hashes = random_hashes(48, 3, signed=False)
    data = {h: payload(size, h) for h in hashes}
    root = kvfs.mnt / "vllm"
    tiers = [VllmFileTier(root, "meta-llama/Llama-3.1-8B", r, "tp=2,bs=16") for r in range(2)]

    for tier in tiers:
        run_threads(lambda h: tier.store(h, data[h]), hashes)
        run_threads(lambda h: tier.store(h, data[h]), hashes[:8])    # re-offload: rename over
    for tier in tiers:
        for h in hashes:
            assert tier.load(h) == data[h]

    files = regular_files(root)
    assert len(files) == 2 * len(hashes)
    assert not [f for f in files if f.endswith(".tmp")]
    for f in files:
        model_dir, hhh, hh, name = f.split(os.sep)
        assert name.startswith(hhh + hh) and len(hhh) == 3 and len(hh) == 2

    h = hashes[0]
    before = os.stat(tiers[0].path(h))
    time.sleep(0.01)
    tiers[0].touch(h)
    after = os.stat(tiers[0].path(h))
    assert after.st_mtime_ns == before.st_mtime_ns
    assert after.st_atime_ns > before.st_atime_ns


# -- llama.cpp slot save / restore --------------------------------------------

LLAMA_STATE_SEQ_MAGIC = 0x67677371   # 'ggsq'
LLAMA_STATE_SEQ_VERSION = 2


def llama_slot_state(n_tokens: int, layers: int, row_bytes: int, seed) -> list[bytes]:
    """The pieces llama_state_seq_get_data writes, in order (cell meta, then K, V per layer)."""
    rng = random.Random(seed)
    pieces = [n_tokens.to_bytes(4, "little")]
    pieces += [i.to_bytes(4, "little") + (1).to_bytes(4, "little") + (0).to_bytes(4, "little")
               for i in range(n_tokens)]
    for kv in ("k", "v"):
        pieces.append(layers.to_bytes(4, "little"))
        for _ in range(layers):
            pieces.append((1).to_bytes(4, "little"))                 # ggml type (f16)
            pieces.append(row_bytes.to_bytes(8, "little"))           # row size
            pieces.append(rng.randbytes(n_tokens * row_bytes))       # rows for this seq
    return pieces


def llama_slot_save(path, tokens, state_pieces) -> None:
    with open(path, "wb") as f:                     # fopen(path, "wb"): O_TRUNC, stdio buffer
        for word in (LLAMA_STATE_SEQ_MAGIC, LLAMA_STATE_SEQ_VERSION, len(tokens)):
            f.write(word.to_bytes(4, "little"))
        f.write(b"".join(t.to_bytes(4, "little") for t in tokens))
        for piece in state_pieces:
            f.write(piece)


def llama_slot_restore(path):
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        magic, version, n = (int.from_bytes(f.read(4), "little") for _ in range(3))
        assert (magic, version) == (LLAMA_STATE_SEQ_MAGIC, LLAMA_STATE_SEQ_VERSION)
        tokens = [int.from_bytes(f.read(4), "little") for _ in range(n)]
        state_size = size - f.tell()
        state = f.read(state_size)                  # one read of the rest
        assert len(state) == state_size
    return tokens, state


def test_llama_cpp_slot_save_restore(kvfs):
    slots = kvfs.mnt / "slots"
    slots.mkdir()
    path = slots / "slot0.bin"
    rng = random.Random(4)

    first_tokens = rng.choices(range(128_000), k=1237)
    first = llama_slot_state(1237, layers=8, row_bytes=2048, seed=4)
    llama_slot_save(path, first_tokens, first)
    assert llama_slot_restore(path) == (first_tokens, b"".join(first))

    # Saving a shorter conversation to the same slot truncates the old file.
    second_tokens = rng.choices(range(128_000), k=301)
    second = llama_slot_state(301, layers=8, row_bytes=2048, seed=5)
    llama_slot_save(path, second_tokens, second)
    assert llama_slot_restore(path) == (second_tokens, b"".join(second))
    assert path.stat().st_size == 12 + 4 * 301 + sum(map(len, second))


# -- scale: 100k files in one flat directory -----------------------------------

# The engines put 100k+ chunk files in one directory (docs/engines.md). 200,000 made
# this the suite's longest test (220 s of a 30-minute CI run), and 100,000 still
# took 97 s of it (50,000: 55-70 s); the 100,000- to million-file figures come from tools/kvfs-bench
# meta instead. A directory has no size thresholds (DirEntries in
# kvfs/namespace/inodes.py: a dict and two arrays), so 25,000 entries run the same code.
SCALE_FILES = 25_000


def lmcache_names(n, seed=5):
    """Unique LMCache local-disk names; signed hashes, so many begin '-'-prefixed fields."""
    hashes = random_hashes(n, seed)
    return [f"meta-llama-Meta-Llama-3-8B@1@0@{h:x}@bfloat16.pt" for h in hashes]


def timed(record_property, op, n, fn):
    t0 = time.perf_counter()
    result = fn()
    dt = time.perf_counter() - t0
    record_property(f"{op}_per_s", round(n / dt))
    print(f"scale {op:>8}: {n:>7} in {dt:6.2f} s = {n / dt:9.0f}/s")
    return result


def in_slices(fn, names, threads=4):
    """Run fn over names with ``threads`` threads (LMCache runs four disk workers)."""
    slices = [names[i::threads] for i in range(threads)]
    return sum(run_threads(lambda s: sum(fn(n) for n in s), slices, threads), 0)


@pytest.mark.slow
def test_scale_flat_directory(kvfs, record_property):
    d = kvfs.mnt / "flat"
    d.mkdir()
    names = lmcache_names(SCALE_FILES + 20_000)
    present, absent = names[:SCALE_FILES], names[SCALE_FILES:]
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)

    def create(name):
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dfd))
        return 1

    def is_empty_file(name):
        st = os.stat(name, dir_fd=dfd)
        return int(stat.S_ISREG(st.st_mode) and st.st_size == 0)

    def exists(name):
        return int(os.path.exists(d / name))

    def unlink(name):
        os.unlink(name, dir_fd=dfd)
        return 1

    try:
        assert timed(record_property, "create", SCALE_FILES,
                     lambda: in_slices(create, present)) == SCALE_FILES
        assert timed(record_property, "stat", SCALE_FILES,
                     lambda: in_slices(is_empty_file, present)) == SCALE_FILES
        assert timed(record_property, "exists", SCALE_FILES,
                     lambda: in_slices(exists, present)) == SCALE_FILES
        assert timed(record_property, "absent", len(absent),
                     lambda: in_slices(exists, absent)) == 0
        listed = timed(record_property, "listdir", SCALE_FILES,
                       lambda: [e.name for e in os.scandir(d)])
        assert len(listed) == SCALE_FILES and set(listed) == set(present)
        assert timed(record_property, "unlink", SCALE_FILES,
                     lambda: in_slices(unlink, present)) == SCALE_FILES
        assert os.listdir(d) == []
    finally:
        os.close(dfd)


# -- MLA dedup: 8 TP ranks write identical chunk files -------------------------

MLA_CHUNK = 61 * 256 * 576 * 2    # DeepSeek-V3 latent KV, 256 tokens, bf16 (~17 MiB)


def lmcache_disk_write(path, data: bytes) -> None:
    """LMCache LocalDiskBackend.write_file without O_DIRECT: open "wb", one write."""
    with open(path, "wb") as f:
        assert f.write(data) == len(data)


def test_mla_ranks_dedup(kvfs):
    chunks = [payload(MLA_CHUNK, f"mla{c}") for c in range(3)]
    hashes = [f"{h:x}" for h in random_hashes(len(chunks), 6)]
    kvfs.flush()
    before = kvfs.stats()

    def rank(r):
        for h, data in zip(hashes, chunks):
            lmcache_disk_write(kvfs.mnt / f"deepseek-ai-DeepSeek-V3@8@{r}@{h}@bfloat16.pt", data)

    barrier = threading.Barrier(8)                      # all ranks write at once
    run_threads(lambda r: (barrier.wait(), rank(r)), range(8), threads=8)
    kvfs.flush()
    after = kvfs.stats()

    for r in range(8):
        for h, data in zip(hashes, chunks):
            with open(kvfs.mnt / f"deepseek-ai-DeepSeek-V3@8@{r}@{h}@bfloat16.pt", "rb") as f:
                assert f.read() == data

    unique = len(chunks) * MLA_CHUNK
    logical = after["logical_bytes"] - before["logical_bytes"]
    used = after["used_bytes"] - before["used_bytes"]
    assert logical == 8 * unique
    # Stored once: one copy plus at most a partial block per chunk and some metadata.
    assert used <= unique * 1.05 + 4 * MiB, f"used grew {used} for {unique} unique bytes"
    assert after["dedup_ratio"] >= 7.9
