"""Drive SGLang 0.5.23's real HiCache host memory pools and storage backends on CPU.

Used by tests/test_sglang_backend.py and the `sglang` rows of kvfs-bench netdev.
The pools are SGLang's own MHATokenToKVPoolHost / MLATokenToKVPoolHost, built from
its own device pools (on "cpu"), and the storage backends are created the way
SGLang's cache controller creates them: StorageBackendFactory.create_backend, then
register_mem_pool_host and on_host_pools_registered.

sglang is installed by tools/install-sglang (--no-deps beside the CPU torch).
"""
from __future__ import annotations

import enum
import importlib.machinery
import logging
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch

logging.getLogger("sglang").setLevel(logging.WARNING)


def _import_sglang_pools():
    """Import SGLang's memory pool modules on a machine with a CPU-only torch.

    ``sglang.srt.configs`` (reached from the memory pools) imports
    ``torchvision.transforms`` for a few multimodal model configs. The only
    torchvision wheels for torch 2.13 on the package index are CUDA builds, whose
    extension cannot load beside a CPU torch. Unless a working torchvision is
    installed, those imports get an empty stand-in for as long as the import takes:
    it is removed again afterwards, transformers is imported first (so it decides
    torchvision is absent), and no HiCache code path touches it.
    """
    try:
        import torchvision  # noqa: F401
        stand_in = False
    except Exception:
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        stand_in = True
    if stand_in:
        import transformers.image_processing_utils  # noqa: F401
        import transformers.image_utils  # noqa: F401

        class InterpolationMode(enum.Enum):
            NEAREST = "nearest"
            BILINEAR = "bilinear"
            BICUBIC = "bicubic"

        modules = {}
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            modules[name] = mod
        modules["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
        modules["torchvision.transforms"].InterpolationMode = InterpolationMode
        modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]
        modules["torchvision"].transforms = modules["torchvision.transforms"]
        sys.modules.update(modules)
    try:
        import sglang.srt.configs  # noqa: F401
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    finally:
        if stand_in:
            for name in ("torchvision", "torchvision.transforms",
                         "torchvision.transforms.functional"):
                sys.modules.pop(name, None)
    return MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPoolHost


(MHATokenToKVPool, MLATokenToKVPool,
 MHATokenToKVPoolHost, MLATokenToKVPoolHost) = _import_sglang_pools()

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

MODEL = "kvfs-test/tiny-model"


def kvfs_extra_config(directory: str) -> dict:
    """The extra config of `--hicache-storage-backend dynamic` that loads the kvfs backend."""
    return {"backend_name": "kvfs", "module_path": "kvfs.client.sglang",
            "class_name": "KvfsHiCacheStorage", "interface_v1": 1, "path": directory}


@dataclass(frozen=True)
class PoolShape:
    """Geometry of the KV cache whose host pool we build (small for tests)."""
    mla: bool = False
    layers: int = 4
    heads: int = 2                 # MHA
    head_dim: int = 128            # MHA
    kv_lora_rank: int = 448        # MLA: kv_lora_rank + rope dims per token
    rope_dim: int = 64
    page_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    layout: str = "page_first"

    @property
    def page_bytes(self) -> int:
        per_token = (self.kv_lora_rank + self.rope_dim if self.mla
                     else 2 * self.heads * self.head_dim)
        return self.layers * per_token * self.page_size * torch.tensor([], dtype=self.dtype).element_size()


def make_host_pool(shape: PoolShape, pages: int):
    """SGLang's own host pool for ``pages`` pages, mirroring a device pool on the CPU."""
    tokens = pages * shape.page_size
    if shape.mla:
        device = MLATokenToKVPool(tokens, shape.page_size, shape.dtype,
                                  kv_lora_rank=shape.kv_lora_rank, qk_rope_head_dim=shape.rope_dim,
                                  layer_num=shape.layers, device="cpu", enable_memory_saver=False,
                                  start_layer=0, end_layer=shape.layers - 1)
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 1.0, 0, shape.page_size, shape.layout,
            pin_memory=False, device_capacity_tokens=device.size,
            start_layer=device.start_layer, end_layer=device.end_layer,
            target_layer_num=device.layer_num, override_kv_cache_dim=device.kv_cache_dim)
    else:
        device = MHATokenToKVPool(tokens, shape.page_size, shape.dtype, head_num=shape.heads,
                                  head_dim=shape.head_dim, layer_num=shape.layers, device="cpu",
                                  enable_memory_saver=False, start_layer=0,
                                  end_layer=shape.layers - 1)
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 1.0, 0, shape.page_size, shape.layout,
            pin_memory=False, device_capacity_tokens=device.size,
            start_layer=device.start_layer, end_layer=device.end_layer,
            write_back_staging=device.hicache_write_back_staging)
    return host


def storage_config(shape: PoolShape, extra: Optional[dict], tp_rank: int = 0,
                   tp_size: int = 1) -> HiCacheStorageConfig:
    """What SGLang's cache controller builds for one TP rank (no PP, CP or DCP)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=shape.mla, enable_storage_metrics=False,
        is_page_first_layout=shape.layout == "page_first", model_name=MODEL,
        extra_config=dict(extra) if extra is not None else None)


def attach(backend_name: str, config: HiCacheStorageConfig, host_pool):
    """Create and attach a storage backend as the cache controller does."""
    backend = StorageBackendFactory.create_backend(backend_name, config, host_pool)
    backend.register_mem_pool_host(host_pool)
    backend.on_host_pools_registered()
    return backend


def kvfs_backend(directory: str, shape: PoolShape, host_pool, tp_rank=0, tp_size=1):
    return attach("dynamic", storage_config(shape, kvfs_extra_config(directory), tp_rank, tp_size),
                  host_pool)


def file_backend(directory: str, shape: PoolShape, host_pool, tp_rank=0, tp_size=1):
    """Stock HiCacheFile on ``directory`` (its extra config key, not the environment)."""
    extra = {"file_storage_path": directory}
    return attach("file", storage_config(shape, extra, tp_rank, tp_size), host_pool)


def fill_random(host_pool, indices: torch.Tensor, seed: int) -> None:
    """Random bits in the pages at ``indices`` (every bit pattern, NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    page = host_pool.page_size
    for i in range(0, len(indices), page):
        flat = host_pool.get_data_page(int(indices[i]), flat=True)
        raw = torch.randint(0, 256, (flat.numel() * flat.element_size(),), generator=gen,
                            dtype=torch.uint8)
        host_pool.set_from_flat_data_page(int(indices[i]), raw.view(flat.dtype))


def page_bytes(host_pool, indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes (for bit-exact comparisons)."""
    page = host_pool.page_size
    return [host_pool.get_data_page(int(indices[i]), flat=True).contiguous()
            .view(torch.uint8).numpy().tobytes() for i in range(0, len(indices), page)]


def keys_for(n: int, seed: int = 0) -> list[str]:
    """Page keys shaped like SGLang's (sha256 hex of the token chain)."""
    import hashlib
    return [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest() for i in range(n)]


def file_page_get(backend, host_pool, keys, indices) -> list[bool]:
    """How SGLang's cache controller reads pages from a backend without interface_v1."""
    dummies = [host_pool.get_dummy_flat_data_page() for _ in keys]
    pages = backend.batch_get(keys, dummies)
    ok = []
    for i, data in enumerate(pages):
        if data is None:
            ok.append(False)
            continue
        host_pool.set_from_flat_data_page(int(indices[i * host_pool.page_size]), data)
        ok.append(True)
    return ok


def run(directory: str, *, backend: str, pages: int, shape: PoolShape,
        cold_hook: Optional[Callable[[], None]] = None, batch: int = 128) -> dict:
    """Store ``pages`` pages, make the cache cold, read them back; report bandwidth.

    ``backend``: "kvfs" (batch_set_v1 / batch_get_v1, zero copy) or "file" (stock
    HiCacheFile through the controller's generic page path).
    """
    os.makedirs(directory, exist_ok=True)
    pool = make_host_pool(shape, 2 * pages)
    src = pool.alloc(pages * shape.page_size)
    dst = pool.alloc(pages * shape.page_size)
    fill_random(pool, src, seed=1)
    keys = keys_for(pages, seed=int(time.time_ns()))
    store = kvfs_backend(directory, shape, pool) if backend == "kvfs" else \
        file_backend(directory, shape, pool)
    try:
        for i in range(0, pages, batch):
            k = keys[i:i + batch]
            idx = src[i * shape.page_size:(i + len(k)) * shape.page_size]
            if backend == "kvfs":
                assert all(store.batch_set_v1(k, idx))
            else:
                assert store.batch_set(k, [pool.get_data_page(int(idx[j * shape.page_size]))
                                           for j in range(len(k))])
        if cold_hook is not None:
            cold_hook()
        cpu0 = _cpu_busy_seconds()
        t0 = time.perf_counter()
        ok = []
        for i in range(0, pages, batch):
            k = keys[i:i + batch]
            idx = dst[i * shape.page_size:(i + len(k)) * shape.page_size]
            ok += (store.batch_get_v1(k, idx) if backend == "kvfs"
                   else file_page_get(store, pool, k, idx))
        seconds = time.perf_counter() - t0
        cpu = _cpu_busy_seconds() - cpu0
    finally:
        if hasattr(store, "close"):
            store.close()
    if not all(ok) or page_bytes(pool, src) != page_bytes(pool, dst):
        raise AssertionError(f"SGLang {backend}: {ok.count(False)} pages missing or wrong bytes")
    nbytes = pages * shape.page_bytes
    return {"backend": backend, "pages": pages, "page_bytes": shape.page_bytes,
            "get_bytes": nbytes, "get_seconds": seconds, "get_gbps": nbytes / seconds / 1e9,
            "get_cpu_seconds": cpu, "get_cpu_s_per_gb": cpu / (nbytes / 1e9)}


def _cpu_busy_seconds() -> float:
    """Whole-machine busy CPU-seconds from /proc/stat (as benchlib.cpu_busy_seconds)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
