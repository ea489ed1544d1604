"""An SGLang HiCache storage backend that keeps KV pages on a kvfs mount.

Loaded by SGLang's dynamic backend factory, with no code change to SGLang::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name":"kvfs",
            "module_path":"kvfs.client.sglang","class_name":"KvfsHiCacheStorage",
            "interface_v1":1, "path":"/mnt/kvfs/sglang"}'

``interface_v1`` makes SGLang call :meth:`KvfsHiCacheStorage.batch_get_v1` and
:meth:`~KvfsHiCacheStorage.batch_set_v1` with host-pool indices: pages are read with
one :func:`kvfs.client.read_many` call straight into the host memory pool's pages, and
written from them, with no staging copy.

Files, one flat directory, named like HiCacheFile's so they are found by one ``stat``
each (no directory listing, fast with 100k+ pages)::

    <page hash>_<model>_<tp rank>_<tp size>[...].bin        MHA, one file per page (layer_first)
    <page hash>_<model>_<tp rank>_<tp size>[...].k.bin/.v.bin   MHA page_first layouts: K and V
    <page hash>_<model>[...].bin                            MLA: no rank, all TP ranks share it

An MLA page is the same on every TP rank, so its name has no rank: the ranks find
one file, and kvfs stores identical bytes once in any case. In the page-first layouts
an MHA page is two regions of host memory (K and V), so it is two files, each read
in place. A page is written under a temporary name and renamed into place; a page
counts as present only when all its files are.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvfs.client.bypass import read_into, read_many

log = logging.getLogger(__name__)

__all__ = ["KvfsHiCacheStorage", "DEFAULT_PATH"]

DEFAULT_PATH = "/mnt/kvfs/sglang"
ZERO_COPY_MAX_SEGMENTS = 2          # K and V; layer_first would be 2 x layers small files


def _memory(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes of host memory at ``ptr``."""
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor; the caller keeps ``tensor`` alive meanwhile."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("a page must be a contiguous CPU tensor")
    return _memory(tensor.data_ptr(), tensor.numel() * tensor.element_size())


class KvfsHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage (v1 zero-copy interface) on a kvfs mount."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = storage_config.extra_config or {}
        self.path = os.path.abspath(extra.get("path") or DEFAULT_PATH)
        os.makedirs(self.path, exist_ok=True)
        self.config = storage_config
        model = "-".join((storage_config.model_name or "").split("/"))
        shard = ""
        if storage_config.pp_size > 1:
            shard += f"_{storage_config.pp_size}_{storage_config.pp_rank}"
        if storage_config.attn_cp_size > 1:
            shard += f"_cp{storage_config.attn_cp_rank}_{storage_config.attn_cp_size}"
        if storage_config.dcp_size > 1:
            shard += (f"_tp{storage_config.tp_size}_dcp{storage_config.dcp_rank}"
                      f"_{storage_config.dcp_size}_page{storage_config.logical_page_size}")
        if storage_config.is_mla_model:
            self.suffix = f"_{model}{shard}"        # the same page on every TP rank
        else:
            self.suffix = f"_{model}_{storage_config.tp_rank}_{storage_config.tp_size}{shard}"
        self._writers = ThreadPoolExecutor(int(extra.get("write_threads", 8)),
                                           thread_name_prefix="kvfs-hicache-put")
        self.mem_pool_host = None
        self.segments = 1                    # files per page
        self.zero_copy = False

    # -- the host pool ----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        try:
            ptrs, _sizes = mem_pool_host.get_page_buffer_meta(page)
        except (NotImplementedError, ValueError, AssertionError, AttributeError):
            ptrs = ()
        self.zero_copy = 0 < len(ptrs) <= ZERO_COPY_MAX_SEGMENTS
        self.segments = len(ptrs) if self.zero_copy else 1

    def _page_regions(self, host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page, the host memory its files are read into / written from."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = self.segments
        if len(ptrs) % n:
            raise ValueError(f"{len(ptrs)} buffers for pages of {n}")
        return [[_memory(ptrs[i + j], sizes[i + j]) for j in range(n)]
                for i in range(0, len(ptrs), n)]

    # -- names -------------------------------------------------------------------------
    def page_files(self, key: str) -> list[str]:
        base = os.path.join(self.path, key + self.suffix)
        if self.segments == 1:
            return [base + ".bin"]
        if self.segments == 2:
            return [base + ".k.bin", base + ".v.bin"]
        return [f"{base}.{j}.bin" for j in range(self.segments)]

    # -- existence -----------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        for path in self.page_files(key):
            try:
                os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                return False
        return True

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    # -- zero-copy batches (interface_v1) ---------------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        pool = self.mem_pool_host
        if host_indices.numel() != len(keys) * pool.page_size:
            log.error("kvfs hicache: %d host indices for %d pages of %d",
                      host_indices.numel(), len(keys), pool.page_size)
            return [False] * len(keys)
        if not self.zero_copy:
            return [self._get_flat(key, int(host_indices[i * pool.page_size]))
                    for i, key in enumerate(keys)]
        regions = self._page_regions(host_indices)
        items = [(path, region) for key, page in zip(keys, regions, strict=True)
                 for path, region in zip(self.page_files(key), page, strict=True)]
        try:
            sizes = read_many(items)
        except (OSError, ValueError):
            sizes = [self._read_one(path, region) for path, region in items]
        n = self.segments
        return [all(sizes[i * n + j] == items[i * n + j][1].nbytes for j in range(n))
                for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        pool = self.mem_pool_host
        if host_indices.numel() != len(keys) * pool.page_size:
            log.error("kvfs hicache: %d host indices for %d pages of %d",
                      host_indices.numel(), len(keys), pool.page_size)
            return [False] * len(keys)
        if self.zero_copy:
            pages = self._page_regions(host_indices)
        else:
            # Copies of the pages, held here until every write has finished.
            copies = [pool.get_data_page(int(host_indices[i * pool.page_size]),
                                         flat=True).contiguous() for i in range(len(keys))]
            pages = [[_tensor_bytes(t)] for t in copies]
        futures = [self._writers.submit(self._put_page, key, page)
                   for key, page in zip(keys, pages, strict=True)]
        return [f.result() for f in futures]

    # -- the generic (copying) interface ------------------------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        if not target_location.is_contiguous():
            raise ValueError("get() needs a contiguous target page")
        regions = self._split(_tensor_bytes(target_location))
        items = list(zip(self.page_files(key), regions))
        try:
            sizes = read_many(items)
        except (OSError, ValueError):
            return None
        if any(size != region.nbytes for size, (_, region) in zip(sizes, items)):
            return None
        return target_location

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        value = value.contiguous()          # held until the write is done
        return self._put_page(key, self._split(_tensor_bytes(value)))

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        futures = [self._writers.submit(self.set, key, value) for key, value in zip(keys, values)]
        return all([f.result() for f in futures])

    def clear(self) -> bool:
        """Remove this rank's pages (files with this rank's suffix) from the directory."""
        ends = tuple(self.suffix + tail for tail in (".bin", ".k.bin", ".v.bin"))
        for name in os.listdir(self.path):
            if name.endswith(ends):
                _unlink_quietly(os.path.join(self.path, name))
        return True

    def close(self) -> None:
        self._writers.shutdown(wait=True)

    # -- internals -----------------------------------------------------------------------------
    def _split(self, flat: memoryview) -> list[memoryview]:
        """A flat page as the regions its files hold (K then V for two segments)."""
        n = self.segments
        if flat.nbytes % n:
            raise ValueError(f"a page of {flat.nbytes} bytes does not split in {n}")
        part = flat.nbytes // n
        return [flat[j * part:(j + 1) * part] for j in range(n)]

    def _get_flat(self, key: str, index: int) -> bool:
        page = self.get(key, self.mem_pool_host.get_dummy_flat_data_page())
        if page is None:
            return False
        self.mem_pool_host.set_from_flat_data_page(index, page)
        return True

    @staticmethod
    def _read_one(path: str, region: memoryview) -> int:
        try:
            return read_into(path, region)
        except (OSError, ValueError):
            return -1

    def _put_page(self, key: str, regions: list[memoryview]) -> bool:
        if self.exists(key):
            return True                     # the same page (another rank, an earlier run)
        try:
            for path, region in zip(self.page_files(key), regions, strict=True):
                _write_file(path, region)
        except OSError:
            log.exception("kvfs hicache: writing page %s failed", key)
            return False
        return True


def _write_file(path: str, data: memoryview) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees it partly written."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        done = 0
        while done < data.nbytes:
            n = os.write(fd, data[done:])
            if n <= 0:
                raise OSError(errno.EIO, f"{tmp}: write returned {n}")
            done += n
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
