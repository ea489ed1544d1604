"""Drive the real LMCache 0.5.6 engine (CPU-only) against a local-disk directory.

Used by tests/test_lmcache.py and by the `lmcache` workload of tools/kvfs-bench.
Nothing here is a re-implementation of LMCache's file I/O: chunks reach the
directory through LMCache's own LocalDiskBackend (one write() per chunk, one
readinto per chunk, O_DIRECT when asked), exactly as in a vLLM deployment.

The "GPU" is a CPU tensor laid out like LMCache's KV_2LTD memory objects,
[2, layers, tokens, heads*head_dim]; the connector copies token slices between
it and LMCache's memory objects.
"""
from __future__ import annotations

import gc
import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# LMCache logs every store and retrieve at INFO; keep benchmark and test output readable.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

CHUNK_TOKENS = 256  # LMCache's default chunk_size: one file per 256 tokens


@dataclass(frozen=True)
class ModelShape:
    """KV geometry of the model whose cache we pretend to hold."""
    name: str = "meta-llama/Meta-Llama-3-8B"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk file: [2, layers, 256, heads*dim] raw, no header."""
        return (2 * self.layers * CHUNK_TOKENS * self.kv_heads * self.head_dim
                * torch.tensor([], dtype=self.dtype).element_size())


LLAMA3_8B = ModelShape()                                  # 32 MiB chunks
SMALL = ModelShape(name="kvfs-test/tiny-llama", layers=4)  # 4 MiB chunks, for tests


class CpuTensorConnector(GPUConnectorInterface):
    """Copies token ranges between a CPU "GPU KV cache" and LMCache memory objects.

    The KV cache is passed per call as ``kvcaches=`` (like vLLM passes its
    paged buffers) and must have shape [2, layers, total_tokens, hidden].
    """

    def __init__(self, shape: ModelShape):
        self.shape = shape

    def get_shape(self, num_tokens: int) -> torch.Size:
        s = self.shape
        return torch.Size([2, s.layers, num_tokens, s.kv_heads * s.head_dim])

    def from_gpu(self, memory_obj, start, end, **kwargs):
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end, :])

    def to_gpu(self, memory_obj, start, end, **kwargs):
        kwargs["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)


class Engine:
    """One LMCacheEngine with a local-disk backend on ``directory``."""

    def __init__(self, directory: str, *, use_odirect: bool, shape: ModelShape = SMALL,
                 disk_io_threads: int = 8, cpu_pool_gb: float = 0.25, disk_gb: float = 64.0,
                 plugin: bool = False):
        self.shape = shape
        self.plugin = plugin
        self.instance_id = f"kvfs-{uuid.uuid4().hex}"
        # local_cpu False: the CPU pool is only a staging area, so every retrieve
        # is served by the disk backend (the path this workload exists to measure).
        if plugin:
            # The kvfs storage plugin (kvfs/client/lmcache.py) instead of the local disk
            # backend, configured exactly as docs/engines.md shows.
            self.config = LMCacheEngineConfig.from_defaults(
                chunk_size=CHUNK_TOKENS,
                local_cpu=False,
                max_local_cpu_size=cpu_pool_gb,
                storage_plugins=["kvfs"],
                extra_config=plugin_extra_config(directory, disk_io_threads),
                lmcache_instance_id=self.instance_id,
            )
        else:
            self.config = LMCacheEngineConfig.from_defaults(
                chunk_size=CHUNK_TOKENS,
                local_cpu=False,
                max_local_cpu_size=cpu_pool_gb,
                local_disk=f"file://{directory}",
                max_local_disk_size=disk_gb,
                extra_config={"use_odirect": use_odirect, "disk_io_threads": disk_io_threads},
                lmcache_instance_id=self.instance_id,
            )
        metadata = LMCacheMetadata(
            model_name=shape.name, world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=shape.dtype,
            kv_shape=(shape.layers, 2, CHUNK_TOKENS, shape.kv_heads, shape.head_dim),
            role="worker",
        )
        self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, self.config, metadata, CpuTensorConnector(shape),
            mock_up_broadcast_fn, mock_up_broadcast_object_fn)
        self.engine.post_init()

        if plugin and "kvfs" not in self.engine.storage_manager.storage_backends:
            # LMCache logs a plugin that fails to load and carries on without it.
            LMCacheEngineBuilder.destroy(self.instance_id)
            raise RuntimeError("LMCache did not load the kvfs storage plugin")

    @property
    def disk(self):
        """The backend chunks go to: LMCache's LocalDiskBackend, or the kvfs plugin."""
        backends = self.engine.storage_manager.storage_backends
        return backends["kvfs"] if self.plugin else backends["LocalDiskBackend"]

    def store(self, tokens: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` for ``tokens`` and wait until every chunk file is written.

        LMCache's put is asynchronous (its disk worker writes in the background and
        publishes the key afterwards), so a store is complete once no put task is
        pending and every chunk key is in the backend's index.
        """
        self.engine.store(tokens, kvcaches=kv)
        keys = [key for _, _, key in self.engine.token_database.process_tokens(tokens)]
        self.wait_written(keys)

    def wait_written(self, keys, timeout: float = 300.0) -> None:
        disk = self.disk
        deadline = time.monotonic() + timeout
        def pending():
            if self.plugin:
                return any(disk.exists_in_put_tasks(k) for k in keys)
            return bool(disk.disk_worker.put_tasks)

        while not all(disk.contains(k) for k in keys) or pending():
            if time.monotonic() > deadline:
                raise TimeoutError("LMCache local-disk puts did not finish")
            time.sleep(0.01)

    def retrieve(self, tokens: torch.Tensor, kv: torch.Tensor) -> int:
        """Load the KV for ``tokens`` into ``kv``; return how many tokens hit."""
        mask = self.engine.retrieve(tokens, kvcaches=kv, req_id=uuid.uuid4().hex)
        return int(mask.sum())

    def lookup(self, tokens: torch.Tensor) -> int:
        """How many leading tokens LMCache would load instead of recomputing."""
        return int(self.engine.lookup(tokens))

    def files(self) -> list[str]:
        """Chunk file paths LMCache holds in its (RAM-only) index."""
        if self.plugin:
            return sorted(os.path.join(self.disk.path, os.readlink(self.disk.link_path(k)))
                          for k in self.disk_keys())
        with self.disk.disk_lock:
            return [meta.path for meta in self.disk.dict.values()]

    def disk_keys(self) -> list:
        """The keys of every chunk file under the plugin's directory."""
        from lmcache.utils import CacheEngineKey
        keys = []
        for name in os.listdir(self.disk.path):
            if name.endswith(".kvc"):
                text = _unquote(name[:-len(".kvc")])
                keys.append(CacheEngineKey.from_string(text))
        return keys

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.instance_id)
        gc.collect()  # drop the CPU staging pool before the next engine allocates one


def plugin_extra_config(directory: str, put_threads: int = 8) -> dict:
    """The extra_config that loads the kvfs storage plugin on ``directory``."""
    return {
        "storage_plugin.kvfs.module_path": "kvfs.client.lmcache",
        "storage_plugin.kvfs.class_name": "KvfsBackend",
        "storage_plugin.kvfs.path": directory,
        "storage_plugin.kvfs.put_threads": put_threads,
    }


def _unquote(text: str) -> str:
    from urllib.parse import unquote
    return unquote(text)


def make_engine(directory: str, use_odirect: bool, shape: ModelShape = SMALL, **kw) -> Engine:
    return Engine(directory, use_odirect=use_odirect, shape=shape, **kw)


def make_request(chunks: int, shape: ModelShape = SMALL, seed: int = 0):
    """Token ids and a random KV cache for a request of ``chunks`` full chunks."""
    gen = torch.Generator().manual_seed(seed)
    ntok = chunks * CHUNK_TOKENS
    tokens = torch.randint(0, 128_000, (ntok,), generator=gen, dtype=torch.long)
    kv_shape = (2, shape.layers, ntok, shape.kv_heads * shape.head_dim)
    # Random bits, not random floats: every bit pattern of the dtype can appear,
    # so a bit-exact comparison catches any corruption (NaN patterns included).
    nbytes = chunks * shape.chunk_bytes
    raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    return tokens, raw.view(shape.dtype).reshape(kv_shape)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (torch.equal would call NaN != NaN)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def store(engine: Engine, tokens, kv) -> None:
    engine.store(tokens, kv)


def retrieve(engine: Engine, tokens, shape: ModelShape = SMALL) -> tuple[int, torch.Tensor]:
    """Retrieve into a fresh zeroed KV buffer; return (tokens hit, buffer)."""
    out = torch.zeros(2, shape.layers, len(tokens), shape.kv_heads * shape.head_dim,
                      dtype=shape.dtype)
    return engine.retrieve(tokens, out), out


def run(directory: str, *, chunks: int, use_odirect: bool,
        cold_hook: Optional[Callable[[], None]] = None,
        shape: ModelShape = LLAMA3_8B, disk_io_threads: int = 8, plugin: bool = False) -> dict:
    """Store ``chunks`` chunks, make the cache cold, retrieve them, report bandwidth.

    ``plugin``: through the kvfs storage plugin instead of the local disk backend.

    With local_cpu off, LMCache's CPU pool only stages transfers, so the retrieve
    is served by LocalDiskBackend: ``disk_io_threads`` concurrent readinto calls,
    one per chunk file. ``cold_hook`` should drop every cache between the two.
    """
    os.makedirs(directory, exist_ok=True)
    tokens, kv = make_request(chunks, shape)
    pool_gb = max(1.0, 1.25 * chunks * shape.chunk_bytes / 2**30)
    eng = make_engine(directory, use_odirect, shape, disk_io_threads=disk_io_threads,
                      cpu_pool_gb=pool_gb, plugin=plugin)
    try:
        t0 = time.perf_counter()
        eng.store(tokens, kv)
        store_seconds = time.perf_counter() - t0
        if cold_hook is not None:
            cold_hook()
        out = torch.zeros_like(kv)
        cpu0 = _cpu_busy_seconds()
        t0 = time.perf_counter()
        hit = eng.retrieve(tokens, out)
        retrieve_seconds = time.perf_counter() - t0
        retrieve_cpu = _cpu_busy_seconds() - cpu0
    finally:
        eng.close()
    if hit != len(tokens) or not bit_equal(out, kv):
        raise AssertionError(f"LMCache retrieved {hit}/{len(tokens)} tokens or wrong bytes")
    nbytes = chunks * shape.chunk_bytes
    return {
        "chunks": chunks,
        "chunk_bytes": shape.chunk_bytes,
        "use_odirect": use_odirect,
        "plugin": plugin,
        "store_seconds": store_seconds,
        "retrieve_bytes": nbytes,
        "retrieve_seconds": retrieve_seconds,
        "retrieve_gbps": nbytes / retrieve_seconds / 1e9,
        "retrieve_cpu_seconds": retrieve_cpu,
        "retrieve_cpu_s_per_gb": retrieve_cpu / (nbytes / 1e9),
    }


def _cpu_busy_seconds() -> float:
    """Whole-machine busy CPU-seconds from /proc/stat (as benchlib.cpu_busy_seconds):
    user + nice + system + irq + softirq + steal, over all CPUs."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
