"""Build the layer stack in one place: device -> extent store -> block index -> block cache -> namespace.

The daemon, fsck and the tests all assemble kvfs here. Each layer is handed
the layer below it; the namespace is also handed the block index as its
journal port (kvfs/schema/port.py): records, commits, checkpoints, block
references and space, which do not pass through the block cache. fsck loads
the durable namespace without a block cache (:func:`load_tree`): its tree has
the same journal port, and no cache to pin live contents in.
"""
import dataclasses
import logging
import os
import stat
import time

from ..base.gcpolicy import collections_paused
from ..blockcache import BlockCache
from ..blockindex import BlockIndex
from ..device import testfaults as faults
from ..device import Device
from ..errors import DeviceFailed, FormatError, KvfsError
from ..namespace import Namespace, Tree
from ..store import ExtentStore, probe_mountable

log = logging.getLogger(__name__)


def open_device(path, *, readonly=False, retry_window=0.0, timeout=60.0):
    """The device at ``path``; under a test fault plan ($KVFS_TEST_FAULTS, kvfs/device/testfaults.py) wrapped in it."""
    device = Device.open(path, readonly=readonly, retry_window=retry_window, timeout=timeout)
    try:
        return faults.from_environment(device)
    except BaseException:
        device.close()
        raise


def _open_device_for(path, options, readonly):
    return open_device(path, readonly=readonly, retry_window=getattr(options, "io_retry", 0.0),
                       timeout=getattr(options, "io_timeout", 60.0))


def _rss_bytes():
    """The daemon's resident memory (what a host's memory budget sees)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _warn_if_readable_by_others(path):
    """A store file others can read gives them every tenant's data and the key secret."""
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
        log.warning("%s is accessible to users other than its owner (mode %o): they can read every "
                    "file's data and the content-key secret; chmod 600 it", path, st.st_mode & 0o777)


def _replay(store, index, load, *, consume=False):
    """Enter the checkpoint's blocks, apply the journal, and let the store reuse frees again.

    ``consume`` (mount): the checkpoint's rows are dropped as they are loaded.
    """
    loaded = store.loaded
    try:
        index.load(loaded.state.blocks, consume=consume)
        try:
            result = load(loaded.state, loaded.records)
        except KvfsError:
            raise
        except Exception as exc:
            raise FormatError(f"the journal does not replay cleanly ({exc!r}): run fsck.kvfs") from None
    except Exception:
        # Rows a child is still checking were built unchecked (kvfs/store/childcheck.py):
        # its refusal, if any, is what went wrong.
        loaded.confirm_checked()
        raise
    loaded.confirm_checked()
    store.finish_replay()
    return result


def check_mountable(path, options, mmp):
    """What mount.kvfs checks before it forks the daemon, reading only: the
    superblock, the checkpoints' checksums, the journal, and that no live owner
    holds the multi-mount protection record (store.probe_mountable).

    The checkpoint payload is decoded and validated once, by the daemon, while
    its claim waits; what it refuses comes back to mount.kvfs as the same one
    line (kvfs/cli/mount.py, daemonize). Decoding it here too cost a remount
    about a third of its time (1.5 s at 100,000 files on a slow VM). So a
    checkpoint that passes its checksum but does not decode (a crafted store)
    is refused after the daemon has written its claim to the MMP sector."""
    device = _open_device_for(path, options, readonly=True)
    try:
        probe_mountable(device, mmp)
    finally:
        device.close()


def load_tree(device, *, salvage=False, now=time.time_ns):
    """(store, index, tree, what loading found, records skipped) of the store on ``device``, for fsck."""
    with collections_paused():          # as in Filesystem.open
        store = ExtentStore.open(device, salvage=salvage)
        loaded = store.loaded
        index = BlockIndex(store)
        tree = Tree(index, now)
        skipped = _replay(store, index, lambda state, records: tree.load(state, records, skip_failures=salvage))
    return store, index, tree, loaded, skipped


class Filesystem:
    """The layer stack over one open device."""

    def __init__(self, device, store, index, cache, namespace, replayed):
        self.device, self.store, self.index, self.cache, self.ns = device, store, index, cache, namespace
        self.replayed = replayed          # what the journal replay did (frames, records, where it stopped)
        self.mounted_at = time.time()
        self.mountpoint = None
        self.tier = None                  # the shared tier (kvfs/tier/), with tier= only

    @classmethod
    def open(cls, path, options, *, readonly=False, now=time.time_ns, mmp=None):
        """Open ``path`` and stack the layers on it; the journal is replayed.

        ``options`` needs the cache settings of MountOptions (cache_size,
        dirty_limit, read_depth, flush_workers). ``now``
        is the clock of every timestamp the namespace writes (tests pass a
        deterministic one). ``mmp`` (kvfs.store.MmpSettings): claim the store's
        multi-mount protection record first (only check it, when ``readonly``);
        the daemon passes it, in-process users leave it out.
        """
        device = _open_device_for(path, options, readonly)
        store = None
        try:
            if not readonly:            # warnings go to the daemon's log, once (not mount.kvfs's check)
                _warn_if_readable_by_others(path)
            # Loading makes a few objects per file and frees none of them: the
            # collector would walk the growing heap again and again for nothing
            # (a third of a remount's time at 100,000 files). The daemon then
            # freezes what was loaded (kvfs/base/gcpolicy.py), so no collection walks it.
            def build(store):
                # Runs while the multi-mount claim waits (kvfs/store/opening.py): it only
                # reads what was loaded. Loaded again, it is built again.
                index = BlockIndex(store, dedup_groups=getattr(options, "dedup_groups", None),
                                   dedup_verify=getattr(options, "dedup_verify", False))
                cache = BlockCache(index, cache_size=options.cache_size, dirty_limit=options.dirty_limit,
                                   read_depth=options.read_depth, flush_workers=options.flush_workers)
                namespace = Namespace(cache, index, now=now,
                                      eviction_policy=getattr(options, "eviction_policy", "s3fifo"),
                                      high_watermark=getattr(options, "high_watermark", 0.9),
                                      low_watermark=getattr(options, "low_watermark", 0.8))
                replayed = store.loaded.replay_report
                _replay(store, index, namespace.load, consume=True)
                return index, cache, namespace, replayed

            with collections_paused():
                store, (index, cache, namespace, replayed) = ExtentStore.open_and_build(
                    device, mmp=mmp, claim=not readonly, then=build, stream_inodes=True)
            if not readonly:
                store.reserve_metadata_space()
                if not store.key_secret:
                    log.warning("format version 1 store: dedup is shared by all users (no key secret); "
                                "a version 2 store (mkfs.kvfs) keeps each user's blocks apart")
            return cls(device, store, index, cache, namespace, replayed)
        except BaseException:
            if store is not None:
                store.release_mmp()
            device.close()
            raise

    @property
    def fenced(self):
        """Why writes are stopped (multi-mount protection), or None."""
        return self.store.fenced

    def close(self):
        """Release the multi-mount protection record (a clean unmount) and close the device."""
        try:
            self.store.release_mmp()
        finally:
            self.device.close()

    def stats(self):
        """Every component's statistics, flattened into one dict for kvfs-admin."""
        dev = self.device.statistics()
        store = self.store.statistics()
        idx = self.index.statistics()
        cache = self.cache.statistics()
        ns = self.ns.statistics()
        evict = self.ns.evictor.statistics()
        elapsed = max(time.time() - self.mounted_at, 1e-9)
        data_used = idx.used_bytes
        injected = {"faults_injected": self.device.injected()} if hasattr(self.device, "injected") else {}
        return {
            "pid": os.getpid(),
            "rss_bytes": _rss_bytes(),
            "buffer_bytes": cache.buffer_bytes,
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
            "checkpoint_cut_ms_max": ns.checkpoint_cut_ms_max,
            "checkpoint_last_ms": ns.checkpoint_last_ms,
            "checkpoint_rows_built_off_loop": ns.checkpoint_rows_built_off_loop,
            "checkpoint_rows_saved_on_loop": ns.checkpoint_rows_saved_on_loop,
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
            "read_handoffs": cache.read_handoffs,
            "blocks_fetched": cache.blocks_fetched,
            "read_buffers_mapped": cache.read_buffers_mapped,
            "blocks_flushed": cache.blocks_flushed,
            "flush_batches": cache.flush_batches,
            "flush_batch_max": cache.flush_batch_max,
            "device_reads_inflight_max": dev.reads_in_flight_max,
            "device_io_retries": dev.retries,
            "io_retry_s": self.device.retry_window,
            "io_timeout_s": self.device.timeout,
            "device_read_errors": dev.read_errors,
            "device_write_errors": dev.write_errors,
            "device_sync_errors": dev.sync_errors,
            "device_discard_errors": dev.discard_errors,
            "device_short_transfers": dev.short_transfers,
            "device_timeouts": dev.timeouts,
            "device_late_calls": dev.late_calls,
            "device_failed": int(bool(self.device.fenced) and self.device.fence_error is DeviceFailed),
            "device_bytes_written": dev.bytes_written,
            "device_bytes_read": dev.bytes_read,
            "data_bytes_written": idx.data_bytes_written,
            "blocks_written": idx.blocks_written,
            "dedup_hits": idx.dedup_hits,
            "dedup_verify_reads": idx.dedup_verify_reads,
            "dedup_collisions": idx.dedup_collisions,
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
            "eviction_policy": evict.policy,
            "high_watermark": evict.high_watermark,
            "low_watermark": evict.low_watermark,
            "evictions": evict.evictions,
            "evicted_bytes": evict.evicted_bytes,
            "pinned_files": evict.pinned_files,
            "pinned_bytes": evict.pinned_bytes,
            "used_fraction": round(self.ns.evictor.used_fraction(), 4),
            "uptime_s": round(elapsed, 3),
            **self.store.mmp_statistics(),
            **injected,                 # only under a test fault plan: faults injected, by effect
            **(dataclasses.asdict(self.tier.statistics()) if self.tier is not None else {}),
        }
