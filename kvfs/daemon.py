"""Assemble the layers over one device and serve them through FUSE.

``Filesystem.open`` stacks device -> extent store -> block index -> block cache
-> namespace and replays the journal. ``serve`` mounts it, runs the background
tasks, and shuts down gracefully on SIGTERM/SIGINT, ``kvfs-admin umount`` or a
plain ``umount``: everything dirty is flushed and a checkpoint is written before
the process exits 0.
"""
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import signal
import time

import pyfuse3
import trio

from .blockcache import BlockCache
from .blockindex import BlockIndex
from .device import Device
from .errors import FormatError, KvfsError
from .extents import ExtentStore
from .fuseops import KvfsOperations
from .namespace import Namespace
from .opsstats import OpsStats
from .metrics import MetricsServer
from .sdnotify import Notifier

log = logging.getLogger(__name__)


@dataclasses.dataclass
class MountOptions:
    cache_size: int
    dirty_limit: int
    read_depth: int = 32
    flush_workers: int = 8
    commit_interval: float = 5.0
    max_tasks: int = 64
    allow_other: bool = False
    write_delay: float = 0.0          # test hook: a deliberately slow device
    read_ahead_kb: int = 32768
    by_hash: str = "root"             # who may use /.kvfs/by-hash: "root" or "owner" (fuseops)
    metrics_port: int = 0             # serve Prometheus /metrics on this port (0: not at all)
    metrics_addr: str = "127.0.0.1"

    @classmethod
    def defaults(cls):
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cache = min(max(ram // 8, 256 << 20), 16 << 30)
        return cls(cache_size=cache, dirty_limit=cache // 2)


def tune_malloc():
    """Keep freed 1 MiB buffers in the heap instead of returning them to the OS.

    Every FUSE write arrives as a fresh 1 MiB bytes object. With glibc's
    defaults such buffers are mmap'ed and unmapped each time, so every request
    paid 256 page faults; reusing heap memory removes them.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 16 << 20)   # glibc caps this at 32 MiB
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        log.info("mallopt unavailable; using the default allocator settings")


class Filesystem:
    """The layer stack over one open device."""

    def __init__(self, device, store, index, cache, namespace):
        self.device, self.store, self.index, self.cache, self.ns = device, store, index, cache, namespace
        self.mounted_at = time.time()
        self.mountpoint = None

    @classmethod
    def open(cls, path, options, *, readonly=False):
        device = Device.open(path, readonly=readonly, write_delay=options.write_delay)
        try:
            store = ExtentStore.open(device)
            if not readonly:
                store.reserve_metadata_space()
            index = BlockIndex(store)
            cache = BlockCache(index, cache_size=options.cache_size, dirty_limit=options.dirty_limit,
                               read_depth=options.read_depth, flush_workers=options.flush_workers)
            namespace = Namespace(cache, store)
            try:
                namespace.load(store.checkpoint_state, store.replay_records)
            except KvfsError:
                raise
            except Exception as exc:
                raise FormatError(f"the journal does not replay cleanly ({exc!r}): "
                                  f"run fsck.kvfs") from None
            replayed = store.replay_report
            store.finish_replay()
            store.set_snapshot_source(namespace.snapshot)
            fs = cls(device, store, index, cache, namespace)
            fs.replayed = replayed
            return fs
        except BaseException:
            device.close()
            raise

    def close(self):
        self.device.close()

    def stats(self):
        """Every component's statistics, flattened into one dict for kvfs-admin."""
        dev = self.device.statistics()
        store = self.store.statistics()
        idx = self.index.statistics()
        cache = self.cache.statistics()
        ns = self.ns.statistics()
        elapsed = max(time.time() - self.mounted_at, 1e-9)
        data_used = idx.used_bytes
        return {
            "pid": os.getpid(),
            "mountpoint": self.mountpoint,
            "device": dev.path,
            "device_kind": "block device" if self.device.is_block else "file",
            "direct_io": dev.direct_io,
            "block_size": self.index.block_size,
            "capacity_bytes": store.capacity_bytes,
            "free_bytes": max(0, self.index.available_bytes()),
            "used_bytes": data_used,
            "logical_bytes": ns.logical_bytes,
            "unique_blocks": idx.unique_blocks,
            "dedup_ratio": round(ns.logical_bytes / data_used, 4) if data_used else 1.0,
            "files": ns.files,
            "metadata_bytes": ns.metadata_bytes,
            "metadata_capacity": ns.metadata_capacity,
            "directories": ns.directories,
            "dirty_bytes": cache.dirty_bytes,
            "dirty_limit": cache.dirty_limit,
            "dirty_bytes_max": cache.dirty_bytes_max,
            "flush_backlog_bytes": cache.flush_backlog_bytes,
            "cache_size": cache.cache_size,
            "cache_bytes": cache.cache_bytes,
            "cache_hits": cache.cache_hits,
            "cache_misses": cache.cache_misses,
            "prefetch_inflight_max": cache.prefetch_inflight_max,
            "device_reads_inflight_max": dev.reads_in_flight_max,
            "device_bytes_written": dev.bytes_written,
            "device_bytes_read": dev.bytes_read,
            "data_bytes_written": idx.data_bytes_written,
            "blocks_written": idx.blocks_written,
            "dedup_hits": idx.dedup_hits,
            "zero_blocks": cache.zero_blocks,
            "writers_throttled": cache.writers_throttled,
            "corrupt_reads": idx.corrupt_reads,
            "read_bytes_per_s": round(cache.bytes_read / elapsed),
            "write_bytes_per_s": round(cache.bytes_written / elapsed),
            "bytes_read": cache.bytes_read,
            "bytes_written": cache.bytes_written,
            "read_requests": cache.read_requests,
            "write_requests": cache.write_requests,
            "journal_bytes": store.journal_bytes,
            "journal_capacity": store.journal_capacity,
            "generation": store.generation,
            "commits": store.commits,
            "checkpoints": store.checkpoints,
            "open_handles": ns.open_handles,
            "uptime_s": round(elapsed, 3),
        }


class Daemon:
    """Serves one Filesystem at a mountpoint; answers admin commands (the ``control``)."""

    def __init__(self, fs, mountpoint, options):
        self.fs = fs
        self.mountpoint = os.path.abspath(mountpoint)
        self.options = options
        fs.mountpoint = self.mountpoint
        self._nursery = None
        self._stopping = False

    def stats(self):
        return self._ops_stats.extend(self.fs.stats())

    async def command(self, name):
        if name == "flush":
            await self.fs.ns.flush_all()
        elif name == "drop-caches":
            self.fs.cache.drop_clean()
        elif name == "checkpoint":
            await self.fs.ns.flush_all()
            await self.fs.store.checkpoint()
        elif name == "umount":
            await self.fs.ns.flush_all()
            self._nursery.start_soon(self._stop)
        else:
            raise KvfsError(f"unknown control command {name!r}", 22)

    async def _stop(self):
        self._begin_stop()
        if not self._stopping:
            self._stopping = True
            pyfuse3.terminate()

    async def _watch_signals(self):
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %d: flushing and unmounting", signum)
                self._begin_stop()
                try:
                    await self.fs.ns.flush_all()
                except KvfsError as exc:
                    log.error("flush before stopping failed: %s", exc)
                await self._stop()

    async def serve(self, ready=lambda: None):
        tune_malloc()
        self._start_ops()
        fuse_options = set(pyfuse3.default_options)       # default_permissions
        fuse_options |= {"fsname=kvfs:" + self.fs.device.path, "subtype=kvfs"}
        if self.options.allow_other:
            fuse_options.add("allow_other")
        ops = KvfsOperations(self.fs.ns, self, by_hash=self.options.by_hash)
        pyfuse3.init(ops, self.mountpoint, fuse_options)
        unmounted = False
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.fs.cache.run)
                await nursery.start(self.fs.ns.run, self.options.commit_interval)
                nursery.start_soon(self._watch_signals)
                if self.fs.replayed.get("records"):
                    try:
                        await self.fs.store.checkpoint()   # fold the replayed journal away
                    except KvfsError as exc:
                        # The journal still holds everything: serve on, and
                        # fold it once deletions have made room.
                        log.error("could not checkpoint after replay, serving from the journal: %s", exc)
                nursery.start_soon(self._after_mount, ready)
                await pyfuse3.main(min_tasks=4, max_tasks=self.options.max_tasks)
                self._begin_stop()
                pyfuse3.close(unmount=True)
                unmounted = True
                await self.fs.ns.flush_all()
                try:
                    await self.fs.store.checkpoint()
                except KvfsError as exc:
                    log.error("final checkpoint failed; the journal holds what was committed: %s", exc)
                    raise KvfsError(f"unmounted, but the final checkpoint failed: {exc}", exc.errno) from None
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if not unmounted:
                pyfuse3.close(unmount=True)
            self._end_ops()

    async def _after_mount(self, ready):
        # Runs once pyfuse3.main is serving: stat() of the mountpoint needs the daemon.
        await trio.to_thread.run_sync(self._raise_read_ahead)
        ready()
        await self._serve_ops()

    def _raise_read_ahead(self):
        """Widen the kernel readahead window for this mount (128 KiB by default)."""
        try:
            dev = os.stat(self.mountpoint).st_dev
            path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
            with open(path, "w") as f:
                f.write(str(self.options.read_ahead_kb))
        except OSError as exc:
            log.info("could not raise read_ahead_kb: %s", exc)

    # -- operations: systemd notify, the watchdog, /metrics, recent rates -----
    def _start_ops(self):
        """Before mounting: read $NOTIFY_SOCKET and bind the metrics port (a busy port fails the mount)."""
        self._notify = Notifier.from_environ()
        self._ops_stats = OpsStats(self.fs)
        self._metrics = None
        if self.options.metrics_port:
            self._metrics = MetricsServer(self.options.metrics_addr, self.options.metrics_port, self.stats)

    async def _serve_ops(self):
        """Once the mount is live: READY=1, then the watchdog, the rate sampler and /metrics until cancelled."""
        try:
            if self._metrics:
                self._metrics.start(trio.lowlevel.current_trio_token())
                log.info("serving metrics on http://%s:%d/metrics", self.options.metrics_addr, self._metrics.port)
            self._notify.once("READY=1", f"STATUS=serving {self.mountpoint}")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._notify.watchdog)
                nursery.start_soon(self._ops_stats.sample_forever)
        finally:
            if self._metrics:
                with trio.CancelScope(shield=True):
                    await self._metrics.aclose()

    def _begin_stop(self):
        self._notify.once("STOPPING=1", f"STATUS=flushing and unmounting {self.mountpoint}")

    def _end_ops(self):
        if self._metrics:
            self._metrics.close()
        self._notify.close()
