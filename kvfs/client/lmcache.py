"""An LMCache 0.5.6 storage plugin that keeps KV chunks on a kvfs mount.

Configured in LMCache's own configuration, with no code change to LMCache::

    storage_plugins: ["kvfs"]
    extra_config:
      storage_plugin.kvfs.module_path: kvfs.client.lmcache
      storage_plugin.kvfs.class_name: KvfsBackend
      storage_plugin.kvfs.path: /mnt/kvfs/lmcache      # a directory on the mount
      storage_plugin.kvfs.put_threads: 8              # optional: chunk files written at once

What it does differently from LMCache's local disk backend:

- ``contains`` asks the mount (one ``stat``), not a RAM index, so after an engine
  restart every chunk already on kvfs is a hit;
- gets go through :func:`kvfs.client.read_many`, straight into the memory objects'
  buffers (no bounce buffer), one batched submission per retrieve;
- puts write each chunk through the mount (dedup, write-back and durability stay
  kvfs's), under a temporary name that is renamed into place, so a half-written
  chunk is never visible.

On-disk layout, one flat directory::

    <key>.kvc                                  symlink -> the data file (what contains stats)
    <key>~<fmt>~<dtype>~<d0>x<d1>x...kvd      the chunk's raw bytes, exactly what LMCache's
                                               local disk backend would write

``<key>`` is ``CacheEngineKey.to_string()`` with every byte outside ``[A-Za-z0-9_.@-]``
percent-encoded. A get needs the shape, dtype and memory format to allocate the memory
object before it reads; they live in the data file's name, reached through the link,
and are checked against the file's size before any byte is read. Keeping them out of
the file keeps the payload byte-identical to the stock backend's (so kvfs stores a
chunk once whichever of the two wrote it) and lets the read land in the memory
object's own buffer.
"""
from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvfs.client.bypass import read_into, read_many

log = logging.getLogger(__name__)

__all__ = ["KvfsBackend", "PATH_KEY", "PUT_THREADS_KEY"]

PREFIX = "storage_plugin.kvfs."
PATH_KEY = PREFIX + "path"
PUT_THREADS_KEY = PREFIX + "put_threads"

LINK_SUFFIX = ".kvc"
DATA_SUFFIX = ".kvd"
SEP = "~"
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.@-")
MAX_SAFE_KEY = 150          # leaves room for the metadata in a 255-byte name


def safe_key(key: CacheEngineKey) -> str:
    """A file-name-safe, reversible spelling of the key (hashed past MAX_SAFE_KEY)."""
    text = key.to_string()
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in text.encode())
    if out.startswith("."):
        out = "%2E" + out[1:]
    if len(out) > MAX_SAFE_KEY:
        out = out[:100] + "%" + hashlib.sha256(text.encode()).hexdigest()[:40]
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def data_name(safe: str, shape: torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> str:
    dims = "x".join(str(int(d)) for d in shape)
    return f"{safe}{SEP}{fmt.name}{SEP}{_dtype_name(dtype)}{SEP}{dims}{DATA_SUFFIX}"


def parse_data_name(safe: str, name: str) -> tuple[torch.Size, torch.dtype, MemoryFormat]:
    """The (shape, dtype, fmt) a data file name records; ValueError unless it is ``safe``'s."""
    if not name.startswith(safe + SEP) or not name.endswith(DATA_SUFFIX) or "/" in name:
        raise ValueError(f"{name!r} is not a data file of {safe!r}")
    fmt_name, dtype_name, dims = name[len(safe) + 1:-len(DATA_SUFFIX)].split(SEP)
    shape = torch.Size(int(d) for d in dims.split("x"))
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"{name!r}: bad shape")
    return shape, _dtype_of(dtype_name), MemoryFormat[fmt_name]


class KvfsBackend(StoragePluginInterface):
    """LMCache storage plugin: chunk files on a kvfs mount, read with kvfs.client."""

    def __init__(self, dst_device: str = "cpu", config=None, metadata=None,
                 local_cpu_backend=None, loop: Optional[asyncio.AbstractEventLoop] = None):
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        extra = (config.extra_config if config is not None else None) or {}
        path = extra.get(PATH_KEY)
        if not path:
            raise ValueError(f"the kvfs storage plugin needs extra_config[{PATH_KEY!r}]: "
                             "a directory on the kvfs mount")
        if local_cpu_backend is None:
            raise ValueError("the kvfs storage plugin allocates through LMCache's CPU "
                             "backend: set max_local_cpu_size > 0")
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        self._put_pool = ThreadPoolExecutor(int(extra.get(PUT_THREADS_KEY, 8)),
                                            thread_name_prefix="kvfs-put")
        self._lock = threading.Lock()
        self._put_tasks: set[CacheEngineKey] = set()
        self._pins: dict[CacheEngineKey, list] = {}      # key -> [fd, count]
        self._closed = False

    def __str__(self) -> str:
        return "KvfsBackend"

    # -- names -----------------------------------------------------------------
    def link_path(self, key: CacheEngineKey) -> str:
        return os.path.join(self.path, safe_key(key) + LINK_SUFFIX)

    def _resolve(self, key: CacheEngineKey) -> Optional[tuple[str, torch.Size, torch.dtype,
                                                               MemoryFormat]]:
        """(data path, shape, dtype, fmt) of the stored chunk, or None if there is none."""
        safe = safe_key(key)
        try:
            target = os.readlink(os.path.join(self.path, safe + LINK_SUFFIX))
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            shape, dtype, fmt = parse_data_name(safe, target)
        except (ValueError, KeyError) as exc:
            log.warning("kvfs plugin: ignoring %s: %s", safe, exc)
            return None
        return os.path.join(self.path, target), shape, dtype, fmt

    # -- lookups -----------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        try:
            os.stat(self.link_path(key))        # follows the link: the data file must exist
        except (FileNotFoundError, NotADirectoryError):
            return False
        if pin:
            self.pin(key)
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey],
                                     pin: bool = False) -> int:
        hits = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            hits += 1
        return hits

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._put_tasks

    # -- puts ----------------------------------------------------------------------
    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: List[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
                                ) -> Optional[List[Future]]:
        futures = []
        for key, obj in zip(keys, objs, strict=True):
            with self._lock:
                if key in self._put_tasks:
                    continue
                self._put_tasks.add(key)
            if self.contains(key):              # already on kvfs (this run or an earlier one)
                with self._lock:
                    self._put_tasks.discard(key)
                continue
            obj.ref_count_up()                  # the storage manager drops its own after we return
            futures.append(self._put_pool.submit(self._put, key, obj, on_complete_callback))
        return futures or None

    def _put(self, key: CacheEngineKey, obj: MemoryObj,
             on_complete: Optional[Callable[[CacheEngineKey], None]]) -> bool:
        try:
            meta = obj.metadata
            self.write_chunk(key, obj.byte_array, meta.shape, meta.dtype, meta.fmt)
        except Exception:
            log.exception("kvfs plugin: put of %s failed", key.to_string())
            return False
        finally:
            obj.ref_count_down()
            with self._lock:
                self._put_tasks.discard(key)
        if on_complete is not None:
            try:
                on_complete(key)
            except Exception:
                log.exception("kvfs plugin: on_complete_callback for %s failed", key.to_string())
        return True

    def write_chunk(self, key: CacheEngineKey, data, shape, dtype, fmt) -> str:
        """Write one chunk file and publish it; returns the data file's path."""
        safe = safe_key(key)
        view = memoryview(data).cast("B")
        expected = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        if view.nbytes != expected:
            raise ValueError(f"{safe}: {view.nbytes} bytes for shape {tuple(shape)} {dtype}")
        name = data_name(safe, shape, dtype, fmt)
        final = os.path.join(self.path, name)
        tag = uuid.uuid4().hex[:12]
        tmp = os.path.join(self.path, f".{safe}.{tag}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            done = 0
            while done < view.nbytes:
                n = os.write(fd, view[done:])
                if n <= 0:
                    raise OSError(errno.EIO, f"{tmp}: write returned {n}")
                done += n
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)                   # complete content under its final name
        link = os.path.join(self.path, safe + LINK_SUFFIX)
        try:
            old = os.readlink(link)
        except OSError:
            old = None
        tmp_link = os.path.join(self.path, f".{safe}.{tag}.lnk")
        os.symlink(name, tmp_link)
        os.rename(tmp_link, link)               # now contains() says yes
        if old is not None and old != name and "/" not in old:
            _unlink_quietly(os.path.join(self.path, old))   # same key, other shape: stale
        return final

    # -- gets -------------------------------------------------------------------------
    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        objs: List[Optional[MemoryObj]] = [None] * len(keys)
        items, where = [], []
        for i, key in enumerate(keys):
            found = self._resolve(key)
            if found is None:
                continue
            path, shape, dtype, fmt = found
            obj = self.local_cpu_backend.allocate(shape, dtype, fmt)
            if obj is None:
                log.warning("kvfs plugin: no CPU memory object for %s", key.to_string())
                continue
            objs[i] = obj
            items.append((path, obj.byte_array))
            where.append(i)
        if not items:
            return objs
        try:
            sizes = read_many(items)
        except (OSError, ValueError):
            # One bad file must not fail the rest: read them one by one.
            sizes = []
            for path, buf in items:
                try:
                    sizes.append(read_into(path, buf))
                except (OSError, ValueError) as exc:
                    log.warning("kvfs plugin: cannot read %s: %s", path, exc)
                    sizes.append(-1)
        for i, (path, buf), size in zip(where, items, sizes, strict=True):
            if size != memoryview(buf).nbytes:
                if size >= 0:
                    log.warning("kvfs plugin: %s holds %d bytes, its name says %d",
                                path, size, memoryview(buf).nbytes)
                objs[i].ref_count_down()
                objs[i] = None
        return objs

    def get_non_blocking(self, key: CacheEngineKey, location: Optional[str] = None) -> Optional[Future]:
        if not self.contains(key):
            return None
        return self._put_pool.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        loop = asyncio.get_running_loop()
        objs = await loop.run_in_executor(None, self.batched_get_blocking, list(keys))
        out = []
        for obj in objs:                        # a prefix: the first miss ends it
            if obj is None:
                break
            obj.pin()
            out.append(obj)
        for obj in objs[len(out):]:
            if obj is not None:
                obj.ref_count_down()
        return out

    # -- pins, removal ------------------------------------------------------------------
    def pin(self, key: CacheEngineKey) -> bool:
        """Hold the chunk file open: kvfs never evicts an open file."""
        with self._lock:
            held = self._pins.get(key)
            if held is not None:
                held[1] += 1
                return True
        found = self._resolve(key)
        if found is None:
            return False
        try:
            fd = os.open(found[0], os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
        except OSError:
            return False
        with self._lock:
            held = self._pins.get(key)
            if held is None:
                self._pins[key] = [fd, 1]
                return True
            held[1] += 1
        os.close(fd)
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            held = self._pins.get(key)
            if held is None:
                return False
            held[1] -= 1
            if held[1] > 0:
                return True
            del self._pins[key]
        os.close(held[0])
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        found = self._resolve(key)
        link = self.link_path(key)
        try:
            os.unlink(link)
        except FileNotFoundError:
            return False
        if found is not None:
            _unlink_quietly(found[0])
        with self._lock:
            held = self._pins.pop(key, None)
        if held is not None:
            os.close(held[0])
        return True

    def touch_cache(self) -> None:
        """kvfs keeps its own eviction order; nothing to update."""

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._put_pool.shutdown(wait=True)
        with self._lock:
            pins, self._pins = self._pins, {}
        for fd, _count in pins.values():
            os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
