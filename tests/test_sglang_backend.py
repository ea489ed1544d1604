"""SGLang 0.5.23's HiCache with the kvfs storage backend (kvfs/client/sglang.py).

The host memory pools are SGLang's own (MHA and MLA, built from its device pools on
the CPU), and the backend is created the way SGLang's cache controller creates a
`--hicache-storage-backend dynamic` backend (tools/sglang_workload.py). sglang is
installed by tools/install-sglang (tools/setup --test), so CI runs these tests.
"""
import os
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

TOOLS = Path(__file__).resolve().parents[1] / "tools"
try:
    sys.path.insert(0, str(TOOLS))
    import sglang_workload as sw
except ImportError as e:  # only a missing sglang (or torch) may skip this test
    if e.name not in ("sglang", "torch") and not str(e.name).startswith(("sglang.", "torch.")):
        raise
    pytest.skip(f"sglang is not importable ({e}); install it with tools/install-sglang VENV",
                allow_module_level=True)

PAGES = 24


def no_temp_files(directory):
    return not [n for n in os.listdir(directory) if n.startswith(".")]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_mha_pages_zero_copy_bit_exact(kvfs, layout):
    directory = str(kvfs.mnt / "sglang")
    shape = sw.PoolShape(mla=False, layout=layout)
    pool = sw.make_host_pool(shape, 3 * PAGES)
    src = pool.alloc(PAGES * shape.page_size)
    dst = pool.alloc(PAGES * shape.page_size)
    sw.fill_random(pool, src, seed=11)
    keys = sw.keys_for(PAGES, seed=1)
    backend = sw.kvfs_backend(directory, shape, pool)
    try:
        assert type(backend).__name__ == "KvfsHiCacheStorage"
        # page_first layouts: each page is K and V regions of host memory, read in place.
        assert backend.zero_copy == (layout != "layer_first")
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys[:PAGES // 2], src[:PAGES // 2 * shape.page_size]) \
            == [True] * (PAGES // 2)
        assert backend.batch_exists(keys) == PAGES // 2
        assert backend.batch_set_v1(keys, src) == [True] * PAGES
        assert backend.batch_exists(keys) == PAGES
        assert backend.exists(keys[-1]) and not backend.exists(sw.keys_for(1, seed=99)[0])

        kvfs.flush()
        maps = kvfs.stats()["block_maps_served"]
        assert backend.batch_get_v1(keys, dst) == [True] * PAGES
        assert sw.page_bytes(pool, dst) == sw.page_bytes(pool, src)
        # The pages came through kvfs.client's bypass (root may): a block map per file.
        assert kvfs.stats()["block_maps_served"] - maps >= PAGES * (2 if backend.zero_copy else 1)

        # The generic interface reads the same pages into a flat page.
        flat = backend.get(keys[3], pool.get_dummy_flat_data_page())
        assert flat is not None
        assert flat.view(sw.torch.uint8).numpy().tobytes() == sw.page_bytes(pool, src)[3]

        # A page that is not there fails alone; the others still land.
        missing = list(keys)
        missing[5] = sw.keys_for(1, seed=98)[0]
        other = pool.alloc(PAGES * shape.page_size)
        ok = backend.batch_get_v1(missing, other)
        assert ok == [i != 5 for i in range(PAGES)]
        assert sw.page_bytes(pool, other)[6] == sw.page_bytes(pool, src)[6]
    finally:
        backend.close()
    per_page = 2 if layout != "layer_first" else 1
    names = os.listdir(directory)
    assert len(names) == per_page * PAGES and no_temp_files(directory)
    assert all(os.path.getsize(os.path.join(directory, n)) == shape.page_bytes // per_page
               for n in names)


def test_mla_tp8_pages_stored_once(kvfs):
    """Eight TP ranks of an MLA model write the same pages at once: kvfs stores them once."""
    directory = str(kvfs.mnt / "sglang")
    shape = sw.PoolShape(mla=True, page_size=128)          # 512 KiB pages
    keys = sw.keys_for(PAGES, seed=2)
    ranks = []
    for rank in range(8):
        pool = sw.make_host_pool(shape, 2 * PAGES)
        src = pool.alloc(PAGES * shape.page_size)
        sw.fill_random(pool, src, seed=5)                 # the same KV on every rank
        ranks.append((pool, src, sw.kvfs_backend(directory, shape, pool, rank, 8)))
    kvfs.flush()
    before = kvfs.stats()
    results = [None] * 8
    start = threading.Barrier(8)

    def store(rank):
        pool, src, backend = ranks[rank]
        start.wait()
        results[rank] = backend.batch_set_v1(keys, src)

    threads = [threading.Thread(target=store, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[True] * PAGES] * 8
    kvfs.flush()
    after = kvfs.stats()

    # One file per page, named without a rank (HiCacheFile's MLA naming).
    names = sorted(os.listdir(directory))
    assert len(names) == PAGES and no_temp_files(directory), names
    assert all(n.endswith("_kvfs-test-tiny-model.bin") for n in names)
    # Stored once: the device received one copy of the pages, however many ranks wrote.
    one_copy = PAGES * shape.page_bytes
    written = after["data_bytes_written"] - before["data_bytes_written"]
    assert written <= one_copy, f"{written} bytes written for {one_copy} bytes of pages"
    assert after["unique_blocks"] - before["unique_blocks"] == PAGES   # a page is one block here

    for pool, src, backend in ranks:
        dst = pool.alloc(PAGES * shape.page_size)
        assert backend.batch_get_v1(keys, dst) == [True] * PAGES
        assert sw.page_bytes(pool, dst) == sw.page_bytes(pool, src)
        backend.close()


def test_exists_is_one_lookup_per_file_in_a_large_directory(kvfs):
    """batch_exists stats each page's files: no listing, however many pages the directory has."""
    directory = kvfs.mnt / "sglang"
    shape = sw.PoolShape(mla=True)
    pool = sw.make_host_pool(shape, 2 * 64)
    src = pool.alloc(64 * shape.page_size)
    sw.fill_random(pool, src, seed=4)
    backend = sw.kvfs_backend(str(directory), shape, pool)
    try:
        keys = sw.keys_for(64, seed=3)
        assert backend.batch_set_v1(keys, src) == [True] * 64
        # 100,000 other pages in the same directory (empty files: only their names matter).
        for i in range(100_000):
            os.close(os.open(directory / f"{i:064x}{backend.suffix}.bin",
                             os.O_CREAT | os.O_WRONLY, 0o644))
        kvfs.flush()
        probe = keys[:40] + sw.keys_for(24, seed=5)            # 40 hits, then misses
        before = kvfs.stats()["kernel_lookup_requests"]
        assert backend.batch_exists(probe) == 40
        assert [backend.exists(k) for k in sw.keys_for(24, seed=5)] == [False] * 24
        lookups = kvfs.stats()["kernel_lookup_requests"] - before
        # 41 names in batch_exists, 24 in exists: at most one lookup each (plus the directory).
        assert lookups <= 41 + 24 + 2, lookups
    finally:
        backend.close()


def test_stock_hicache_file_and_kvfs_backend_on_one_mount(kvfs):
    """An MLA page HiCacheFile wrote is the same file the kvfs backend reads (same name, bytes)."""
    directory = str(kvfs.mnt / "sglang")
    shape = sw.PoolShape(mla=True)
    pool = sw.make_host_pool(shape, 3 * 8)
    src, dst = pool.alloc(8 * shape.page_size), pool.alloc(8 * shape.page_size)
    sw.fill_random(pool, src, seed=6)
    keys = sw.keys_for(8, seed=6)
    stock = sw.file_backend(directory, shape, pool)
    assert stock.batch_set(keys, [pool.get_data_page(int(src[i * shape.page_size]))
                                  for i in range(8)])
    backend = sw.kvfs_backend(directory, shape, pool)
    try:
        assert backend.batch_exists(keys) == 8
        assert backend.batch_get_v1(keys, dst) == [True] * 8
        assert sw.page_bytes(pool, dst) == sw.page_bytes(pool, src)
    finally:
        backend.close()


def test_documented_extra_config_is_what_loads_the_backend():
    """The JSON in docs/engines.md is the config the test backends are created from."""
    import json
    import re
    text = (Path(__file__).resolve().parents[1] / "docs" / "engines.md").read_text()
    section = text.split("### SGLang with the kvfs HiCache backend", 1)[1].split("\n### ", 1)[0]
    documented = json.loads(re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'",
                                      section, re.S).group(1))
    assert documented == sw.kvfs_extra_config("/mnt/kvfs/sglang")
    assert "--hicache-storage-backend dynamic" in section
