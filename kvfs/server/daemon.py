"""Serve a layer stack (``kvfs.server.stack.Filesystem``) through FUSE.

``serve`` mounts it, runs the background
tasks, and shuts down gracefully on SIGTERM/SIGINT, ``kvfs-admin umount`` or a
plain ``umount``: everything dirty is flushed and a checkpoint is written before
the process exits 0 (and ``Filesystem.close`` then releases the multi-mount
protection record). A store fenced by multi-mount protection (another host took
it over) is unmounted without writing anything, and the process exits 1.
"""
import ctypes
import ctypes.util
import dataclasses
import json
import logging
import os
import signal

import pyfuse3
import trio

from ..base.gcpolicy import FreezeAfterFullCollections
from ..errors import Fenced, InvalidArgument, KvfsError
from ..fuse.blockmaps import BlockMaps, BypassDevice
from ..fuse.frontend import NativeReads
from ..fuse.loop import RequestWait
from ..fuse.ops import KvfsOperations
from ..fuse.pagedrops import KernelPageDropper
from ..fuse.pagefill import PageFiller, PageFillStatistics
from ..fuse.tierlookup import TierOperations
from .metrics import MetricsServer
from .opsstats import OpsStats
from .sdnotify import Notifier
from .stack import Filesystem

__all__ = ["Daemon", "Filesystem", "MountOptions", "tune_malloc"]

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
    read_ahead_kb: int = 32768
    by_hash: str = "root"             # who may use /.kvfs/by-hash: "root" or "owner" (fuseops)
    high_watermark: float = 0.9       # eviction starts above this fraction of the data region used
    low_watermark: float = 0.8        # ... and stops below this one
    eviction_policy: str = "s3fifo"   # kvfs/namespace/policy.py
    io_retry: float = 10.0            # seconds a failing device transfer is retried (a path reconnect)
    io_timeout: float = 60.0          # seconds a caller waits for any device call (then EIO); > io_retry
    metrics_port: int = 0             # serve Prometheus /metrics on this port (0: not at all)
    metrics_addr: str = "127.0.0.1"
    dedup_groups: object = None       # None: dedup per uid; "all"; or uid sets (blockindex.DedupDomains)
    dedup_verify: bool = False        # compare bytes on every dedup hit (dedup_verify=bytes)
    mmp_interval: float = None        # multi-mount protection heartbeat, seconds; None: mmp_interval_for
    page_fill: bool = True            # fill the kernel's page cache at a cold open (kvfs/fuse/pagefill.py)
    request_poll: bool = True         # take queued FUSE requests without an epoll round trip (kvfs/fuse/loop.py)
    # READs of sealed files answered in C beside pyfuse3 (kvfs/fuse/frontend.py). None
    # (auto, the default): on when the daemon runs as root, which it needs to mount(2)
    # /dev/fuse itself; otherwise pyfuse3 mounts alone (through fusermount3).
    native_reads: bool = None
    native_threads: int = 4           # its threads, each on its own /dev/fuse descriptor
    native_direct_io: bool = False    # its read-only opens bypass the kernel's page cache
    tier: object = None               # kvfs.tier.options.TierOptions with tier=rados, else None
    lease_seconds: float = 5.0        # a bypass reader's block-map lease ends by then (kvfs/namespace/leases.py)
    bypass_group: int = None          # gid whose members get block maps besides root (kvfs/fuse/blockmaps.py)

    force: bool = False               # take over a store whose MMP record is in use, without waiting

    @classmethod
    def defaults(cls):
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cache = min(max(ram // 8, 256 << 20), 16 << 30)
        return cls(cache_size=cache, dirty_limit=cache // 2)


def tune_malloc():
    """Give back what loading freed, then keep freed 1 MiB buffers in the heap.

    Loading a store decodes its checkpoint: at a million files about 30 MB of
    the C heap is free afterwards, in holes between what stays. One
    ``malloc_trim`` returns those pages to the OS (measured: the daemon's RSS
    after mounting a million files fell by that much).

    Every FUSE write arrives as a fresh 1 MiB bytes object. With glibc's
    defaults such buffers are mmap'ed and unmapped each time, so every request
    paid 256 page faults; reusing heap memory removes them.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim(0)
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 16 << 20)   # glibc caps this at 32 MiB
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        log.info("mallopt unavailable; using the default allocator settings")


class Daemon:
    """Serves one Filesystem at a mountpoint; answers admin commands (the ``control``)."""

    def __init__(self, fs, mountpoint, options):
        self.fs = fs
        self.mountpoint = os.path.abspath(mountpoint)
        self.options = options
        fs.mountpoint = self.mountpoint
        self._nursery = None
        self._stopping = False
        self._gc = FreezeAfterFullCollections()
        self._commands_running = 0
        self._page_dropper = None
        self._page_filler = None
        self._request_wait = None       # kvfs/fuse/loop.py, once pyfuse3 is initialised
        self._ops = None                # the KvfsOperations being served
        self._native = None             # kvfs/fuse/frontend.py's NativeReads, with native_reads on

    def stats(self):
        stats = self._ops_stats.extend(self.fs.stats())
        gc_stats = self._gc.statistics()
        stats["gc_full_collections"] = gc_stats.full_collections
        stats["gc_full_collection_max_ms"] = round(gc_stats.full_collection_max_s * 1000, 3)
        stats["gc_frozen_objects"] = gc_stats.frozen_objects
        stats["gc_frozen_counted_s_ago"] = gc_stats.frozen_counted_s_ago
        stats["control_commands_running"] = self._commands_running
        ops = self._ops
        stats["kernel_read_requests"] = ops.kernel_reads if ops is not None else 0
        stats["kernel_lookup_requests"] = ops.kernel_lookups if ops is not None else 0
        stats["kernel_getattr_requests"] = ops.kernel_getattrs if ops is not None else 0
        stats["kernel_entry_invalidations"] = ops.entry_invalidations if ops is not None else 0
        for kernel_pages in (self._page_dropper, self._page_filler, self._request_wait, self._native):
            if kernel_pages is not None:
                stats.update(dataclasses.asdict(kernel_pages.statistics()))
        if self._page_filler is None:
            # Not filling (page_fill=off, or the native plane serves the READs): the
            # counters stay, at 0, so that tools and dashboards read one schema.
            stats.update(dict.fromkeys((f.name for f in dataclasses.fields(PageFillStatistics)), 0))
        if ops is not None and ops.block_maps is not None:      # bypass readers (kvfs.client)
            stats.update(dataclasses.asdict(ops.block_maps.statistics()))
        stats.update(dataclasses.asdict(self.fs.ns.leases.statistics()))
        if self._native is not None:
            # What applications read and what the device delivered, whichever path served it.
            stats["bytes_read"] += stats["native_read_bytes"]
            stats["read_requests"] += stats["native_reads"]
            stats["device_bytes_read"] += stats["native_device_bytes"]
        return stats

    async def command(self, text):
        """Run an admin command; returns a JSON-able result for the caller (or None)."""
        self._commands_running += 1
        try:
            return await self._command(text)
        finally:
            self._commands_running -= 1

    async def _command(self, text):
        name, _, arg = text.partition(" ")
        try:
            args = json.loads(arg) if arg else {}
            if name == "evict":
                return await self.fs.ns.admin.evict(**args)
            if name in ("pin", "unpin"):
                return await self.fs.ns.admin.pin(list(args["inos"]), pinned=name == "pin")
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidArgument(f"malformed {name} command: {exc}") from None
        if name == "flush":
            await self.fs.ns.flush_all()
        elif name == "count-frozen":
            self._gc.collect_and_count()
        elif name == "drop-caches":
            self.fs.ns.drop_caches()
        elif name == "checkpoint":
            await self.fs.ns.flush_all()
            await self.fs.ns.checkpoint()
        elif name == "umount":
            if not self.fs.fenced:              # fenced: nothing can be written any more
                await self.fs.ns.flush_all()
            self._nursery.start_soon(self._stop)
        else:
            raise InvalidArgument(f"unknown control command {name!r}")

    async def _stop(self):
        self._begin_stop()
        if not self._stopping:
            self._stopping = True
            if self._request_wait is not None:
                self._request_wait.terminate()
            else:
                pyfuse3.terminate()

    async def _watch_signals(self):
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %d: flushing and unmounting", signum)
                self._begin_stop()
                try:
                    if not self.fs.fenced:
                        await self.fs.ns.flush_all()
                except KvfsError as exc:
                    log.error("flush before stopping failed: %s", exc)
                await self._stop()

    async def serve(self, ready=lambda: None):
        tune_malloc()
        self._gc.install()              # the loaded namespace is frozen: see kvfs/base/gcpolicy.py
        self._start_ops()
        fuse_options = set(pyfuse3.default_options)       # default_permissions
        fuse_options |= {"fsname=kvfs:" + self.fs.device.path, "subtype=kvfs"}
        if self.options.allow_other:
            fuse_options.add("allow_other")
        tier = self._attach_tier()
        ops = self._ops = (TierOperations if tier else KvfsOperations)(self.fs.ns, self, by_hash=self.options.by_hash)
        self.fs.ns.leases.seconds = self.options.lease_seconds
        ops.block_maps = BlockMaps(self.fs.ns, BypassDevice(self.fs.device.path, self.fs.store.hash_seed,
                                                            self.fs.store.key_secret), self.options.bypass_group)
        native = self._native = self._mount_native(ops, fuse_options)
        self.fs.ns.evictor.entry_removed = ops.entry_removed       # eviction tells the kernel
        if native is not None:
            ops.page_dropper = self._page_dropper = KernelPageDropper(native.dev_fd)
            session_fd = native.session_fd
        else:
            ops.page_dropper = self._page_dropper = KernelPageDropper.of_this_process()
            session_fd = None if self._page_dropper is None else self._page_dropper.fd
        if session_fd is not None and self.options.request_poll:
            self._request_wait = RequestWait.install(session_fd)
        # The native plane answers READs itself: filling the page cache at open
        # would read every file through Python first (about 1 CPU-s/GB).
        if self._page_dropper is not None and self.options.page_fill and native is None:
            ops.page_filler = self._page_filler = PageFiller(self._page_dropper.fd, self._page_dropper,
                                                             self.fs.ns.block_size)
        unmounted = False
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.fs.cache.run)
                await nursery.start(self.fs.ns.run, self.options.commit_interval)
                nursery.start_soon(self.fs.store.keep_heartbeat)
                if tier is not None:            # an unreachable cluster: a warning, the mount goes on
                    await tier.connect_at_mount()
                    await nursery.start(tier.run)
                nursery.start_soon(self._watch_signals)
                if native is not None:
                    nursery.start_soon(self._watch_connection_end, native)
                    nursery.start_soon(native.keep_collecting)
                if self.fs.replayed.get("records"):
                    try:
                        await self.fs.ns.checkpoint()      # fold the replayed journal away
                    except KvfsError as exc:
                        # The journal still holds everything: serve on, and
                        # fold it once deletions have made room.
                        log.error("could not checkpoint after replay, serving from the journal: %s", exc)
                nursery.start_soon(self._after_mount, ready)
                await pyfuse3.main(min_tasks=4, max_tasks=self.options.max_tasks)
                self._begin_stop()
                self._unmount()
                unmounted = True
                if self.fs.fenced:
                    raise Fenced(f"unmounted without writing back what was not yet on the device: "
                                 f"{self.fs.fenced}")
                await self.fs.ns.flush_all()
                try:
                    await self.fs.ns.checkpoint_unless_folded()
                except KvfsError as exc:
                    log.error("final checkpoint failed; the journal holds what was committed: %s", exc)
                    raise type(exc)(f"unmounted, but the final checkpoint failed: {exc}") from None
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if not unmounted:
                self._unmount()
            self._end_ops()
            self._gc.uninstall()
            if self.fs.tier is not None:
                self.fs.tier.close()        # librados aborts at exit under an open connection

    def _attach_tier(self):
        """The shared tier of ``tier=`` (kvfs/tier/), wired into the namespace; None without."""
        if self.options.tier is None:
            return None
        from ..tier import make_tier
        tier = self.fs.tier = self.fs.ns.tier = make_tier(self.options.tier)
        return tier

    def _mount_native(self, ops, fuse_options):
        """Mount with the native read plane in front of pyfuse3 (None: pyfuse3 mounts alone)."""
        wanted = self.options.native_reads
        if wanted is None:                      # auto: only root may mount(2) /dev/fuse itself
            wanted = os.geteuid() == 0
            if not wanted:
                log.info("native_reads=auto: not root, so pyfuse3 serves every READ")
        if not wanted or hasattr(self.fs.device, "injected"):
            # A fault-injecting test device (kvfs/device/testfaults.py) fails reads in
            # Python; native reads of the same descriptor would not see its faults.
            pyfuse3.init(ops, self.mountpoint, fuse_options)
            return None
        store = self.fs.store
        native = NativeReads(self.mountpoint, fuse_options, device_fd=os.dup(self.fs.device.fd),
                             seed=store.hash_seed, secret=store.key_secret, pins=self.fs.ns,
                             threads=self.options.native_threads)
        native.mount()
        try:
            pyfuse3.init(ops, native.session_path, fuse_options)
            native.start()
        except BaseException:
            native.unmount()
            raise
        ops.native = native
        ops.native_direct_io = self.options.native_direct_io
        self.fs.ns.content_watcher = native.withdraw
        return native

    def _unmount(self):
        pyfuse3.close(unmount=True)
        if self._native is not None:
            self._native.unmount()

    async def _watch_connection_end(self, native):
        """The kernel ended the connection (umount from outside, an abort): stop as pyfuse3 would."""
        await native.wait_ended()
        log.info("the kernel ended the FUSE connection: stopping")
        await self._stop()

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
