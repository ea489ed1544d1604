"""The real LMCache 0.5.6 engine with its local disk backend pointed at a kvfs mount.

LMCache is installed by tools/install-lmcache (CPU torch, lmcache --no-deps). The
engine runs unmodified; only the "GPU" is a CPU tensor (see tools/lmcache_workload.py).
"""
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lmcache

try:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import lmcache_workload as lw
except ImportError as e:  # only a missing lmcache (or torch) may skip this test
    if e.name not in ("lmcache", "torch") and not str(e.name).startswith(("lmcache.", "torch.")):
        raise
    pytest.skip(f"LMCache is not importable ({e}); install it with tools/install-lmcache VENV",
                allow_module_level=True)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "engines.md"
CHUNKS = 6                      # 6 x 4 MiB chunk files
SHAPE = lw.SMALL


def data_bytes_written(stats: dict) -> int:
    """Bytes of file data (not metadata) written to the device so far."""
    for field in ("data_bytes_written", "device_data_bytes_written",
                  "device_bytes_written_data"):
        if field in stats:
            return stats[field]
    raise AssertionError(f"kvfs-admin stats has no data-bytes-written field: {sorted(stats)}")


def store_and_check(engine, tokens, kv):
    engine.store(tokens, kv)
    hit, out = lw.retrieve(engine, tokens, SHAPE)
    assert hit == len(tokens), f"LMCache retrieved {hit} of {len(tokens)} tokens"
    assert lw.bit_equal(out, kv), "retrieved KV differs from what was stored"


@pytest.mark.parametrize("use_odirect", [False, True], ids=["buffered", "odirect"])
def test_lmcache_local_disk_on_kvfs(kvfs, use_odirect):
    mnt = str(kvfs.mnt / "lmcache")         # LMCache creates its directory
    if use_odirect:
        # LMCache silently drops O_DIRECT unless statvfs().f_bsize divides the chunk.
        assert SHAPE.chunk_bytes % os.statvfs(kvfs.mnt).f_bsize == 0
    tokens, kv = lw.make_request(CHUNKS, SHAPE)

    engine = lw.make_engine(mnt, use_odirect, SHAPE)
    try:
        store_and_check(engine, tokens, kv)
        files = sorted(engine.files())
    finally:
        engine.close()

    # One flat directory, one raw file per 256-token chunk, named by LMCache.
    assert len(files) == CHUNKS
    assert sorted(os.listdir(mnt)) == sorted(os.path.basename(f) for f in files)
    assert all(os.path.getsize(f) == SHAPE.chunk_bytes for f in files)
    assert all(os.path.basename(f).startswith(SHAPE.name.replace("/", "-") + "@1@0@")
               for f in files)
    mtimes = {f: os.stat(f).st_mtime_ns for f in files}

    kvfs.flush()
    before = kvfs.stats()

    # A restart: LMCache's index is RAM-only, so a fresh engine rewrites every chunk
    # it is asked to store, byte for byte. kvfs must write no new data for it.
    engine = lw.make_engine(mnt, use_odirect, SHAPE)
    try:
        store_and_check(engine, tokens, kv)
        assert sorted(engine.files()) == files
    finally:
        engine.close()
    assert all(os.stat(f).st_mtime_ns > mtimes[f] for f in files), "LMCache did not rewrite"

    kvfs.flush()
    after = kvfs.stats()
    assert after["bytes_written"] - before["bytes_written"] >= CHUNKS * SHAPE.chunk_bytes, \
        "the rewrite never reached kvfs"
    assert data_bytes_written(after) == data_bytes_written(before)
    # Whatever else moved is metadata (journal records for the rewritten files).
    metadata = after["device_bytes_written"] - before["device_bytes_written"]
    assert metadata < SHAPE.chunk_bytes, f"{metadata} bytes written for an identical rewrite"
    assert after["used_bytes"] <= before["used_bytes"] + SHAPE.chunk_bytes // 4


# -- the configuration lines documented for users ------------------------------

def doc_block(lang: str) -> str:
    """The first ```lang block of the LMCache section of docs/engines.md."""
    section = DOCS.read_text().split("### LMCache", 1)[1].split("\n### ", 1)[0]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def check_documented_config(config):
    assert config.chunk_size == 256
    assert config.local_disk == "/mnt/kvfs/lmcache"
    assert config.max_local_disk_size == 900
    assert config.extra_config == {"use_odirect": True, "disk_io_threads": 8}


def test_documented_yaml_config_parses(tmp_path):
    path = tmp_path / "kvfs.yaml"
    path.write_text(doc_block("yaml"))
    check_documented_config(lw.LMCacheEngineConfig.from_file(str(path)))


def test_documented_env_config_parses(monkeypatch):
    for line in doc_block("bash").splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        monkeypatch.setenv(name, shlex.split(value)[0])
    check_documented_config(lw.LMCacheEngineConfig.from_env())
