"""The real LMCache 0.5.6 engine with the kvfs storage plugin (kvfs/client/lmcache.py).

LMCache loads the plugin itself, from its configuration (storage_plugins + extra_config),
as in a deployment; the "GPU" is a CPU tensor (tools/lmcache_workload.py). Every chunk is
stored, retrieved bit-exact, and after an engine restart in a new process (and a kvfs
remount) found on the mount: all hits, nothing recomputed, nothing rewritten.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lmcache

TOOLS = Path(__file__).resolve().parents[1] / "tools"
try:
    sys.path.insert(0, str(TOOLS))
    import lmcache_workload as lw
except ImportError as e:  # only a missing lmcache (or torch) may skip this test
    if e.name not in ("lmcache", "torch") and not str(e.name).startswith(("lmcache.", "torch.")):
        raise
    pytest.skip(f"LMCache is not importable ({e}); install it with tools/install-lmcache VENV",
                allow_module_level=True)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "engines.md"
CHUNKS = 5                      # 5 x 4 MiB chunks
SHAPE = lw.SMALL


def data_bytes(stats: dict) -> int:
    return stats["data_bytes_written"]


def chunk_names(directory):
    names = sorted(os.listdir(directory))
    links = [n for n in names if n.endswith(".kvc")]
    data = [n for n in names if n.endswith(".kvd")]
    return names, links, data


# A second process: a new engine on the same directory. It must find every chunk on
# the mount (LMCache's lookup: no token to recompute), retrieve them bit-exact, and
# store the request again as LMCache does after a restart.
RESTART = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import lmcache_workload as lw
tokens, kv = lw.make_request(int(sys.argv[3]), lw.SMALL)
eng = lw.make_engine(sys.argv[2], False, lw.SMALL, plugin=True)
try:
    looked_up = eng.lookup(tokens)
    hit, out = lw.retrieve(eng, tokens, lw.SMALL)
    exact = lw.bit_equal(out, kv)
    eng.store(tokens, kv)
    files = eng.files()
finally:
    eng.close()
print(json.dumps({"lookup": looked_up, "hit": hit, "exact": exact, "tokens": len(tokens),
                  "files": files}))
"""


def test_plugin_store_retrieve_restart(kvfs):
    directory = str(kvfs.mnt / "lmcache")
    tokens, kv = lw.make_request(CHUNKS, SHAPE)

    eng = lw.make_engine(directory, False, SHAPE, plugin=True)
    try:
        assert eng.lookup(tokens) == 0, "an empty directory answered a lookup"
        eng.store(tokens, kv)
        hit, out = lw.retrieve(eng, tokens, SHAPE)
        assert hit == len(tokens), f"retrieved {hit} of {len(tokens)} tokens"
        assert lw.bit_equal(out, kv), "retrieved KV differs from what was stored"
        files = eng.files()
    finally:
        eng.close()

    # One link and one raw data file per chunk, each exactly the chunk's bytes; no
    # temporary name left behind.
    names, links, data = chunk_names(directory)
    assert len(links) == len(data) == CHUNKS and len(names) == 2 * CHUNKS, names
    assert all(os.path.getsize(f) == SHAPE.chunk_bytes for f in files)
    assert all(os.path.islink(os.path.join(directory, n)) for n in links)
    assert all(re.search(r"~KV_2LTD~bfloat16~2x4x256x1024\.kvd$", n) for n in data), data

    kvfs.remount()              # the daemon restarts too: the chunks come from the device
    before = kvfs.stats()       # (its counters start again at the mount)

    proc = subprocess.run([sys.executable, "-c", RESTART, str(TOOLS), directory, str(CHUNKS)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["lookup"] == result["tokens"], f"after a restart: {result}"
    assert result["hit"] == result["tokens"], f"after a restart: {result}"
    assert result["exact"], "bytes retrieved after a restart differ"
    assert sorted(result["files"]) == sorted(files)

    kvfs.flush()
    after = kvfs.stats()
    # The restarted engine stored the same request again: no chunk data reached the device.
    assert data_bytes(after) == data_bytes(before), (before, after)
    # Its gets went through kvfs.client's bypass (root may): a block map per chunk file.
    assert after["block_maps_served"] - before["block_maps_served"] >= CHUNKS, (before, after)
    assert chunk_names(directory)[0] == names


def test_plugin_and_local_disk_share_bytes(kvfs):
    """A chunk the stock local disk backend wrote costs nothing more when the plugin writes it."""
    tokens, kv = lw.make_request(3, SHAPE, seed=7)
    stock = lw.make_engine(str(kvfs.mnt / "stock"), False, SHAPE)
    try:
        stock.store(tokens, kv)
    finally:
        stock.close()
    kvfs.flush()
    before = kvfs.stats()

    eng = lw.make_engine(str(kvfs.mnt / "plugin"), False, SHAPE, plugin=True)
    try:
        eng.store(tokens, kv)
        hit, out = lw.retrieve(eng, tokens, SHAPE)
        assert hit == len(tokens) and lw.bit_equal(out, kv)
    finally:
        eng.close()
    kvfs.flush()
    after = kvfs.stats()
    assert kvfs.stats()["bytes_written"] - before["bytes_written"] >= 3 * SHAPE.chunk_bytes
    assert data_bytes(after) == data_bytes(before), "identical chunks were stored twice"


def test_plugin_never_returns_wrong_bytes(kvfs):
    """A missing, removed or mislabelled chunk is a miss (LMCache recomputes), never bad data."""
    directory = str(kvfs.mnt / "lmcache")
    tokens, kv = lw.make_request(3, SHAPE, seed=3)
    eng = lw.make_engine(directory, False, SHAPE, plugin=True)
    try:
        eng.store(tokens, kv)
        backend = eng.disk
        keys = [key for _, _, key in eng.engine.token_database.process_tokens(tokens)]
        assert [backend.contains(k) for k in keys] == [True] * 3

        # Chunk 2: its data file replaced by one of another size under the same name.
        target = os.path.join(directory, os.readlink(backend.link_path(keys[2])))
        with open(target, "wb") as f:
            f.write(b"x" * (SHAPE.chunk_bytes // 2))
        assert backend.get_blocking(keys[2]) is None
        # Chunk 1: removed through the backend (link and data file both go).
        removed = os.path.join(directory, os.readlink(backend.link_path(keys[1])))
        assert backend.remove(keys[1]) and not backend.remove(keys[1])
        assert not os.path.lexists(backend.link_path(keys[1])) and not os.path.exists(removed)
        assert not backend.contains(keys[1]) and backend.get_blocking(keys[1]) is None
        # Chunk 0 is intact: a pin holds it open, the get is bit-exact.
        assert backend.pin(keys[0]) and backend.unpin(keys[0]) and not backend.unpin(keys[0])
        obj = backend.get_blocking(keys[0])
        assert obj is not None
        assert lw.bit_equal(obj.tensor, kv[:, :, :lw.CHUNK_TOKENS, :])
        obj.ref_count_down()

        # The engine sees a one-chunk prefix and recomputes the rest.
        hit, out = lw.retrieve(eng, tokens, SHAPE)
        assert hit == lw.CHUNK_TOKENS
        assert lw.bit_equal(out[:, :, :hit], kv[:, :, :hit])
    finally:
        eng.close()


# -- the configuration documented for users ------------------------------------

def plugin_doc_yaml() -> str:
    section = DOCS.read_text().split("### LMCache with the kvfs storage plugin", 1)[1]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def test_documented_plugin_config_loads_the_plugin(kvfs, tmp_path):
    """The YAML in docs/engines.md, with its path pointed at this mount, loads the plugin."""
    text = plugin_doc_yaml()
    assert '"storage_plugin.kvfs.path": "/mnt/kvfs/lmcache"' in text
    path = tmp_path / "kvfs.yaml"
    path.write_text(text.replace("/mnt/kvfs/lmcache", str(kvfs.mnt / "lmcache")))
    config = lw.LMCacheEngineConfig.from_file(str(path))
    assert config.storage_plugins == ["kvfs"]
    assert config.local_disk is None
    assert config.extra_config["storage_plugin.kvfs.module_path"] == "kvfs.client.lmcache"
    assert config.extra_config["storage_plugin.kvfs.class_name"] == "KvfsBackend"

    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.metadata import LMCacheMetadata
    import uuid
    config.lmcache_instance_id = f"kvfs-doc-{uuid.uuid4().hex}"
    config.max_local_cpu_size = 0.25
    metadata = LMCacheMetadata(
        model_name=SHAPE.name, world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=SHAPE.dtype,
        kv_shape=(SHAPE.layers, 2, lw.CHUNK_TOKENS, SHAPE.kv_heads, SHAPE.head_dim),
        role="worker")
    engine = LMCacheEngineBuilder.get_or_create(
        config.lmcache_instance_id, config, metadata, lw.CpuTensorConnector(SHAPE),
        mock_up_broadcast_fn, mock_up_broadcast_object_fn)
    try:
        engine.post_init()
        backend = engine.storage_manager.storage_backends.get("kvfs")
        assert type(backend).__name__ == "KvfsBackend"
        assert backend.path == str(kvfs.mnt / "lmcache")
    finally:
        LMCacheEngineBuilder.destroy(config.lmcache_instance_id)
