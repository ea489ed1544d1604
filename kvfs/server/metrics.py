"""Prometheus metrics: the daemon's statistics in the text exposition format.

One function turns the statistics dict (the same one ``kvfs-admin stats --json``
prints) into metric families, so ``kvfs-admin metrics MOUNTPOINT`` and the
daemon's ``/metrics`` endpoint (mount option ``metrics_port=``) print the same
thing. Names follow Prometheus conventions: a ``kvfs_`` prefix, base units
(bytes, seconds), ``_total`` on counters, ``_bytes`` on sizes.

The HTTP endpoint runs in its own thread and never touches kvfs state there:
for each scrape it asks the trio loop for a statistics snapshot
(``TrioToken.run_sync_soon``) and gives up with 503 after a timeout, so a busy
or hung loop cannot wedge the scraper and the scraper can never block the loop.

The text format is small and fixed (version 0.0.4); it is written here rather
than with prometheus_client so that mounting needs no extra package. The tests
parse the output with prometheus_client's own parser.
"""
import dataclasses
import http.server
import logging
import math
import socket
import threading

from .. import __version__
from ..errors import os_error

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT = 5.0            # seconds a scrape waits for the event loop

# stats key -> (metric name, type, help). Counters only ever grow while mounted.
GAUGE, COUNTER = "gauge", "counter"
METRICS = {
    "capacity_bytes": ("kvfs_capacity_bytes", GAUGE, "Bytes the store can hold for block data."),
    "used_bytes": ("kvfs_used_bytes", GAUGE, "Bytes of block data stored on the device (after dedup)."),
    "free_bytes": ("kvfs_free_bytes", GAUGE, "Bytes still free for block data."),
    "logical_bytes": ("kvfs_logical_bytes", GAUGE, "Sum of the files' recorded content sizes, as the engines see them."),
    "dedup_ratio": ("kvfs_dedup_ratio", GAUGE, "Logical bytes per stored byte."),
    "unique_blocks": ("kvfs_unique_blocks", GAUGE, "Distinct blocks stored."),
    "files": ("kvfs_files", GAUGE, "Regular files."),
    "directories": ("kvfs_directories", GAUGE, "Directories."),
    "open_handles": ("kvfs_open_handles", GAUGE, "Open file handles."),
    "block_size": ("kvfs_block_size_bytes", GAUGE, "Block size of the store."),
    "metadata_bytes": ("kvfs_metadata_used_bytes", GAUGE, "Bytes of metadata space in use."),
    "metadata_capacity": ("kvfs_metadata_capacity_bytes", GAUGE, "Bytes of metadata space."),
    "journal_bytes": ("kvfs_journal_used_bytes", GAUGE, "Bytes of journal written since the last checkpoint."),
    "journal_capacity": ("kvfs_journal_capacity_bytes", GAUGE, "Bytes of journal space."),
    "generation": ("kvfs_generation", GAUGE, "Checkpoint generation of the store."),
    "cache_size": ("kvfs_cache_size_bytes", GAUGE, "RAM given to the block cache (cache_size)."),
    "cache_bytes": ("kvfs_cache_clean_bytes", GAUGE, "Clean blocks held in RAM."),
    "dirty_bytes": ("kvfs_cache_dirty_bytes", GAUGE, "Written data not yet on the device."),
    "dirty_limit": ("kvfs_cache_dirty_limit_bytes", GAUGE, "Dirty data at which writers wait (dirty_limit)."),
    "dirty_bytes_max": ("kvfs_cache_dirty_max_bytes", GAUGE, "Most dirty data seen since mount."),
    "flush_backlog_bytes": ("kvfs_flush_backlog_bytes", GAUGE, "Dirty blocks waiting to be written."),
    "prefetch_inflight": ("kvfs_prefetch_reads_in_flight", GAUGE, "Prefetch device reads in flight now."),
    "prefetch_inflight_max": ("kvfs_prefetch_reads_in_flight_max", GAUGE,
                              "Most prefetch reads in flight at once since mount."),
    "device_reads_inflight": ("kvfs_device_reads_in_flight", GAUGE, "Device reads in flight now."),
    "device_reads_inflight_max": ("kvfs_device_reads_in_flight_max", GAUGE,
                                  "Most device reads in flight at once since mount."),
    "uptime_s": ("kvfs_uptime_seconds", GAUGE, "Seconds since the filesystem was mounted."),
    "cache_hits": ("kvfs_cache_hits_total", COUNTER, "Block reads served from RAM."),
    "cache_misses": ("kvfs_cache_misses_total", COUNTER, "Block reads that went to the device."),
    "bytes_read": ("kvfs_read_bytes_total", COUNTER, "Bytes read by applications."),
    "bytes_written": ("kvfs_written_bytes_total", COUNTER, "Bytes written by applications."),
    "read_requests": ("kvfs_read_requests_total", COUNTER, "FUSE read requests."),
    "write_requests": ("kvfs_write_requests_total", COUNTER, "FUSE write requests."),
    "device_bytes_read": ("kvfs_device_read_bytes_total", COUNTER, "Bytes read from the device."),
    "device_bytes_written": ("kvfs_device_written_bytes_total", COUNTER,
                             "Bytes written to the device (data and metadata)."),
    "data_bytes_written": ("kvfs_data_written_bytes_total", COUNTER, "Block data bytes written to the device."),
    "blocks_written": ("kvfs_blocks_written_total", COUNTER, "Blocks written to the device."),
    "dedup_hits": ("kvfs_dedup_hits_total", COUNTER, "Blocks not written because an identical one was stored."),
    "checkpoint_cut_ms_max": ("kvfs_checkpoint_cut_ms_max", GAUGE,
                              "Longest a checkpoint held the event loop, taking its copy-on-write cuts (ms)."),
    "checkpoint_last_ms": ("kvfs_checkpoint_last_ms", GAUGE, "The last checkpoint, from its cut to durable (ms)."),
    "checkpoint_rows_built_off_loop": ("kvfs_checkpoint_rows_built_off_loop_total", COUNTER,
                                       "Checkpoint inode rows built in a worker thread."),
    "checkpoint_rows_saved_on_loop": ("kvfs_checkpoint_rows_saved_on_loop_total", COUNTER,
                                      "Checkpoint inode rows saved on the event loop because a change came first."),
    "rss_bytes": ("kvfs_daemon_rss_bytes", GAUGE, "Resident memory of the kvfs daemon."),
    "control_commands_running": ("kvfs_control_commands_running", GAUGE,
                                 "kvfs-admin commands (flush, checkpoint, evict, ...) the daemon is running."),
    "kernel_page_drops": ("kvfs_kernel_page_drops_total", COUNTER,
                          "Page ranges dropped from the kernel's cache before a WRITE's reply, because a read "
                          "raced an O_RDWR writer's copy (kvfs/namespace/pagecache.py)."),
    "kernel_page_drops_late": ("kvfs_kernel_page_drops_late_total", COUNTER,
                               "Of those, drops still waiting for a page lock when the reply went out."),
    "kernel_page_drops_failed": ("kvfs_kernel_page_drops_failed_total", COUNTER,
                                 "Page drops the kernel refused (each is logged)."),
    "kernel_page_drops_last_late": ("kvfs_kernel_page_drops_last_late_total", COUNTER,
                                    "Of the late drops, those of a WRITE's partly written last page."),
    "kernel_read_requests": ("kvfs_kernel_read_requests_total", COUNTER,
                             "READ requests from the kernel (page-cache misses and O_DIRECT reads)."),
    "kernel_lookup_requests": ("kvfs_kernel_lookup_requests_total", COUNTER,
                               "LOOKUP requests: path walks the kernel's dentry cache did not answer."),
    "kernel_getattr_requests": ("kvfs_kernel_getattr_requests_total", COUNTER,
                                "GETATTR requests: attributes the kernel's cache did not answer."),
    "kernel_entry_invalidations": ("kvfs_kernel_entry_invalidations_total", COUNTER,
                                   "Names dropped from the kernel's dentry cache because eviction removed them."),
    "page_fills": ("kvfs_page_fills_total", COUNTER,
                   "Cold opens whose file was stored into the kernel's page cache before the reply "
                   "(kvfs/fuse/pagefill.py)."),
    "page_fill_bytes": ("kvfs_page_fill_bytes_total", COUNTER, "Bytes stored into the kernel's page cache."),
    "page_fill_blocks_skipped": ("kvfs_page_fill_blocks_skipped_total", COUNTER,
                                 "Blocks a page fill left to readahead: not read in time, or failed."),
    "page_fill_stores_refused": ("kvfs_page_fill_stores_refused_total", COUNTER,
                                 "Page stores the kernel refused (each is logged)."),
    "page_fill_fence_waits": ("kvfs_page_fill_fence_waits_total", COUNTER,
                              "Opens for writing and truncates that waited for a running page fill."),
    "fuse_waits_queued": ("kvfs_fuse_waits_queued_total", COUNTER,
                          "Waits for the next FUSE request that found one queued (no epoll round trip)."),
    "fuse_waits_idle": ("kvfs_fuse_waits_idle_total", COUNTER,
                        "Waits for the next FUSE request that parked in the event loop until one came."),
    "fuse_waits_unlocked": ("kvfs_fuse_waits_unlocked_total", COUNTER,
                            "Of the queued waits, those that took the request without a trio checkpoint."),
    "native_reads": ("kvfs_native_reads_total", COUNTER,
                     "READs the native read plane answered without Python (kvfs/fuse/readplane.c); "
                     "kvfs_read_requests and kvfs_read_bytes count them too."),
    "native_read_bytes": ("kvfs_native_read_bytes_total", COUNTER, "Bytes the native read plane answered."),
    "native_device_bytes": ("kvfs_native_device_read_bytes_total", COUNTER,
                            "Bytes the native read plane read from the device (also in kvfs_device_read_bytes)."),
    "native_forwarded_reads": ("kvfs_native_forwarded_reads_total", COUNTER,
                               "READs the native read plane handed to pyfuse3 (not published, or in doubt)."),
    "native_unpublished_reads": ("kvfs_native_unpublished_reads_total", COUNTER,
                                 "Of those, READs of files not published (dirty, open for writing, ...)."),
    "native_verify_failures": ("kvfs_native_verify_failures_total", COUNTER,
                               "READs handed to pyfuse3 because a block failed its key on the native path."),
    "native_device_errors": ("kvfs_native_device_errors_total", COUNTER,
                             "READs handed to pyfuse3 because a device read failed on the native path."),
    "native_forwarded_requests": ("kvfs_native_forwarded_requests_total", COUNTER,
                                  "Requests the native front end handed to pyfuse3."),
    "native_forwards_queued": ("kvfs_native_forwards_queued_total", COUNTER,
                               "Of those, requests that waited for room in pyfuse3's socket (a busy event loop)."),
    "native_published_files": ("kvfs_native_published_files", GAUGE,
                               "Files whose READs the native read plane answers now."),
    "native_publications": ("kvfs_native_publications_total", COUNTER, "Files published to the native read plane."),
    "native_withdrawals": ("kvfs_native_withdrawals_total", COUNTER,
                           "Files withdrawn from it (a change, a writer, the last close)."),
    "native_kept_versions": ("kvfs_native_kept_versions", GAUGE,
                             "Withdrawn file versions the native read plane keeps, blocks pinned, "
                             "for READs handed out before the change."),
    "native_threads": ("kvfs_native_threads", GAUGE, "Threads of the native read plane."),
    "leases_held": ("kvfs_leases_held", GAUGE, "Block-map leases bypass readers (kvfs.client) hold now."),
    "lease_bytes_held": ("kvfs_lease_held_bytes", GAUGE, "Bytes of the extents held leases name."),
    "lease_deferred_bytes": ("kvfs_lease_deferred_bytes", GAUGE,
                             "Bytes no file names any more whose free waits for a lease to end."),
    "leases_granted": ("kvfs_leases_granted_total", COUNTER, "Block maps handed out under a lease."),
    "leases_released": ("kvfs_leases_released_total", COUNTER,
                        "Leases a client ended with the file unchanged: its device reads stood."),
    "leases_stale": ("kvfs_leases_stale_total", COUNTER,
                     "Leases ended after a change or past expiry: the client read again through the mount."),
    "leases_expired": ("kvfs_leases_expired_total", COUNTER, "Leases ended by time, never released."),
    "leases_refused": ("kvfs_leases_refused_total", COUNTER,
                       "Block maps refused: file dirty, open for writing or truncating, or too many leases."),
    "block_maps_served": ("kvfs_block_maps_served_total", COUNTER, "Block maps given to bypass readers."),
    "block_maps_denied": ("kvfs_block_maps_denied_total", COUNTER,
                          "Block maps denied: caller neither root nor in bypass_group, or not the owner."),
    "block_maps_unavailable": ("kvfs_block_maps_unavailable_total", COUNTER,
                               "Block maps not given: the file not on the device as it is, or its map too large."),
    "bypass_bytes_mapped": ("kvfs_bypass_mapped_bytes_total", COUNTER,
                            "Bytes of blocks named in block maps (read by clients from the device)."),
    "gc_full_collections": ("kvfs_gc_full_collections_total", COUNTER,
                            "Full (generation-2) Python garbage collections in the daemon."),
    "gc_full_collection_max_ms": ("kvfs_gc_full_collection_max_ms", GAUGE,
                                  "Longest full garbage collection (ms): it stopped every FUSE request."),
    "gc_frozen_objects": ("kvfs_gc_frozen_objects", GAUGE,
                          "Objects the daemon has frozen out of garbage collection (kvfs/base/gcpolicy.py), "
                          "as last counted."),
    "gc_frozen_counted_s_ago": ("kvfs_gc_frozen_counted_seconds_ago", GAUGE,
                                "Age of kvfs_gc_frozen_objects: counting walks every frozen object, so it "
                                "is recounted at most once a minute, or by kvfs-admin count-frozen."),
    "buffer_bytes": ("kvfs_buffer_bytes", GAUGE,
                     "RAM in block buffers (clean, dirty, and spare ones kept for reuse); the rest of the "
                     "daemon's RSS is code and metadata."),
    "read_handoffs": ("kvfs_read_handoffs_total", COUNTER,
                      "Worker-thread calls that read blocks from the device (one per run of adjacent blocks)."),
    "blocks_fetched": ("kvfs_blocks_fetched_total", COUNTER, "Blocks read from the device into the cache."),
    "read_buffers_mapped": ("kvfs_read_buffers_mapped_total", COUNTER,
                            "Device reads that found no recycled block buffer and mapped a fresh one "
                            "(a page fault and a zeroing per 4 KiB)."),
    "blocks_flushed": ("kvfs_blocks_flushed_total", COUNTER, "Dirty blocks stored on the device (or found there)."),
    "flush_batches": ("kvfs_flush_batches_total", COUNTER,
                      "Flush worker calls: one large block, or a batch of small ones stored with one "
                      "hashing hand-off and one device call."),
    "flush_batch_max": ("kvfs_flush_batch_max_blocks", GAUGE, "The most blocks one flush worker call stored."),
    "dedup_verify_reads": ("kvfs_dedup_verify_reads_total", COUNTER,
                           "Stored blocks read back to compare bytes on a dedup hit (dedup_verify=bytes)."),
    "dedup_collisions": ("kvfs_dedup_collisions_total", COUNTER,
                         "Dedup hits whose stored bytes differed: the write failed with EIO."),
    "zero_blocks": ("kvfs_zero_blocks_total", COUNTER, "All-zero blocks stored as holes."),
    "writers_throttled": ("kvfs_writers_throttled_total", COUNTER, "Writes that waited for the dirty limit."),
    "corrupt_reads": ("kvfs_corrupt_reads_total", COUNTER,
                      "Device reads whose content did not match its key (served as EIO)."),
    "commits": ("kvfs_commits_total", COUNTER, "Journal commits."),
    "evictions": ("kvfs_evictions_total", COUNTER, "Files evicted to make room."),
    "device_io_retries": ("kvfs_device_io_retries_total", COUNTER,
                          "Device transfers retried during a path loss (io_retry)."),
    "io_retry_s": ("kvfs_device_io_retry_seconds", GAUGE, "How long a failing device transfer is retried."),
    "io_timeout_s": ("kvfs_device_io_timeout_seconds", GAUGE, "How long a caller waits for a device call (then EIO)."),
    "device_read_errors": ("kvfs_device_read_errors_total", COUNTER, "Device reads that failed (after io_retry)."),
    "device_write_errors": ("kvfs_device_write_errors_total", COUNTER, "Device writes that failed (after io_retry)."),
    "device_sync_errors": ("kvfs_device_sync_errors_total", COUNTER, "Device flushes that failed (after io_retry)."),
    "device_discard_errors": ("kvfs_device_discard_errors_total", COUNTER, "Device discards that failed."),
    "device_short_transfers": ("kvfs_device_short_transfers_total", COUNTER,
                               "Device system calls that moved fewer bytes than asked (absorbed or not)."),
    "device_timeouts": ("kvfs_device_timeouts_total", COUNTER,
                        "Device calls not answered within io_timeout: EIO for the caller."),
    "device_late_calls": ("kvfs_device_late_calls", GAUGE,
                          "Device calls given up on (io_timeout) whose threads still wait for the device."),
    "device_failed": ("kvfs_device_failed", GAUGE,
                      "1 once a journal or checkpoint write went unanswered: all writes now fail (EIO)."),
    "evicted_bytes": ("kvfs_evicted_bytes_total", COUNTER, "Bytes of the files evicted."),
    "pinned_files": ("kvfs_pinned_files", GAUGE, "Files pinned against eviction."),
    "pinned_bytes": ("kvfs_pinned_bytes", GAUGE, "Bytes of the pinned files."),
    "used_fraction": ("kvfs_used_ratio", GAUGE, "Share of the data region in use (0..1)."),
    "high_watermark": ("kvfs_eviction_high_watermark_ratio", GAUGE, "Eviction starts above this share used."),
    "low_watermark": ("kvfs_eviction_low_watermark_ratio", GAUGE, "Eviction stops below this share used."),
    "checkpoints": ("kvfs_checkpoints_total", COUNTER, "Checkpoints written."),
    "mmp_seq": ("kvfs_mmp_sequence", GAUGE, "Multi-mount protection heartbeat sequence (random start per mount)."),
    "mmp_heartbeats": ("kvfs_mmp_heartbeats_total", COUNTER, "Multi-mount protection heartbeats written."),
    "mmp_heartbeat_age_s": ("kvfs_mmp_heartbeat_age_seconds", GAUGE, "Seconds since the last MMP heartbeat."),
    "mmp_interval_s": ("kvfs_mmp_interval_seconds", GAUGE, "Multi-mount protection heartbeat interval."),
    "mmp_fenced": ("kvfs_mmp_fenced", GAUGE,
                   "1 once multi-mount protection stopped all writes (another host took the store over)."),
    # The shared tier (tier=rados, kvfs/tier/shared.py).
    "tier_connected": ("kvfs_tier_connected", GAUGE, "1 while the shared tier's cluster is connected."),
    "tier_published_files": ("kvfs_tier_published_files_total", COUNTER, "Files published to the shared tier."),
    "tier_published_blocks": ("kvfs_tier_published_blocks_total", COUNTER, "Block objects created in the tier."),
    "tier_published_bytes": ("kvfs_tier_published_bytes_total", COUNTER, "Bytes of block objects created in the tier."),
    "tier_publish_dedup_blocks": ("kvfs_tier_publish_dedup_blocks_total", COUNTER,
                                  "Blocks to publish that the tier held already."),
    "tier_publish_errors": ("kvfs_tier_publish_errors_total", COUNTER, "Publishes that failed."),
    "tier_publish_skipped": ("kvfs_tier_publish_skipped_total", COUNTER,
                             "Offered files changed, removed or too large by their turn."),
    "tier_queue_len": ("kvfs_tier_queue_files", GAUGE, "Files waiting to be published."),
    "tier_queue_max": ("kvfs_tier_queue_files_max", GAUGE, "Most files waiting at once since mount."),
    "tier_queue_drops": ("kvfs_tier_queue_drops_total", COUNTER, "Files not published: the queue was full."),
    "tier_lookups": ("kvfs_tier_lookups_total", COUNTER, "Local lookup misses that consulted the tier."),
    "tier_hits": ("kvfs_tier_hits_total", COUNTER, "Tier lookups that found and verified the file."),
    "tier_misses": ("kvfs_tier_misses_total", COUNTER, "Tier lookups that found nothing usable."),
    "tier_misses_cached": ("kvfs_tier_misses_cached_total", COUNTER, "Tier misses answered from the miss cache."),
    "tier_misses_down": ("kvfs_tier_misses_down_total", COUNTER,
                         "Tier misses answered at once: the tier had just run out of time."),
    "tier_fetched_files": ("kvfs_tier_fetched_files_total", COUNTER, "Files fetched from the tier."),
    "tier_fetched_blocks": ("kvfs_tier_fetched_blocks_total", COUNTER, "Block objects fetched from the tier."),
    "tier_fetched_bytes": ("kvfs_tier_fetched_bytes_total", COUNTER, "Bytes fetched from the tier."),
    "tier_verify_failures": ("kvfs_tier_verify_failures_total", COUNTER,
                             "Fetched blocks or manifests that did not verify (never served)."),
    "tier_quarantined": ("kvfs_tier_quarantined_total", COUNTER, "Objects moved to quarantine."),
    "tier_timeouts": ("kvfs_tier_timeouts_total", COUNTER, "Tier calls or lookups that ran out of time."),
    "tier_errors": ("kvfs_tier_errors_total", COUNTER, "Tier calls that failed otherwise."),
    "tier_latency_ms_last": ("kvfs_tier_latency_last_milliseconds", GAUGE, "The last tier call's latency."),
    "tier_latency_ms_mean": ("kvfs_tier_latency_mean_milliseconds", GAUGE, "Mean tier call latency since mount."),
    "tier_latency_ms_max": ("kvfs_tier_latency_max_milliseconds", GAUGE, "Longest tier call since mount."),
    "tier_janitor_sweeps": ("kvfs_tier_janitor_sweeps_total", COUNTER, "Janitor passes over the tenant's objects."),
    "tier_janitor_deleted": ("kvfs_tier_janitor_deleted_total", COUNTER, "Objects the janitor deleted."),
    "tier_janitor_deleted_bytes": ("kvfs_tier_janitor_deleted_bytes_total", COUNTER, "Bytes the janitor deleted."),
    "tier_stored_bytes": ("kvfs_tier_stored_bytes", GAUGE, "The tenant's bytes in the tier at the janitor's last listing."),
    "tier_lookup_ms_max": ("kvfs_tier_lookup_max_milliseconds", GAUGE, "Longest lookup that consulted the tier."),
}
# Statistics with no metric of their own: labels of kvfs_info, or derived values
# that Prometheus computes better itself (rate() over the counters).
NOT_EXPORTED = {"pid", "mountpoint", "device", "device_kind", "direct_io", "eviction_policy", "read_bytes_per_s",
                "write_bytes_per_s", "recent", "device_read_latency_seconds"}
LATENCY_KEY = "device_read_latency_seconds"


@dataclasses.dataclass
class Family:
    name: str                   # counters keep their _total, as prometheus_client writes them
    type: str
    help: str
    samples: list               # (sample name, {label: value}, number)


def families(stats):
    """The metric families for one statistics dict (keys it lacks are left out)."""
    out = [Family("kvfs_info", GAUGE, "kvfs version and the device and mountpoint of this mount.",
                  [("kvfs_info", {"version": __version__,
                                  "mountpoint": str(stats.get("mountpoint") or ""),
                                  "device": str(stats.get("device", "")),
                                  "device_kind": str(stats.get("device_kind", "")),
                                  "eviction_policy": str(stats.get("eviction_policy", "")),
                                  "direct_io": str(bool(stats.get("direct_io", False))).lower()}, 1)])]
    for key, (name, kind, text) in METRICS.items():
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out.append(Family(name, kind, text, [(name, {}, value)]))
    hist = stats.get(LATENCY_KEY)
    if hist:
        samples = [("kvfs_device_read_latency_seconds_bucket", {"le": _le(le)}, n)
                   for le, n in zip(hist["le"], hist["counts"])]
        samples.append(("kvfs_device_read_latency_seconds_bucket", {"le": "+Inf"}, hist["count"]))
        samples.append(("kvfs_device_read_latency_seconds_sum", {}, hist["sum"]))
        samples.append(("kvfs_device_read_latency_seconds_count", {}, hist["count"]))
        out.append(Family("kvfs_device_read_latency_seconds", "histogram",
                          "Time one device read took (one block, or one metadata read).", samples))
    return out


def _le(bound):
    return repr(float(bound))


def _number(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(text, quote=True):
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def exposition(stats):
    """Prometheus text exposition (format 0.0.4) of one statistics dict."""
    lines = []
    for fam in families(stats):
        lines.append(f"# HELP {fam.name} {_escape(fam.help, quote=False)}")
        lines.append(f"# TYPE {fam.name} {fam.type}")
        for name, labels, value in fam.samples:
            tags = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{tags}}} {_number(value)}" if tags else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"


def as_json(stats):
    """The same families as plain data, for ``kvfs-admin metrics --json``."""
    return [{"name": f.name, "type": f.type, "help": f.help,
             "samples": [{"name": n, "labels": labels, "value": v} for n, labels, v in f.samples]}
            for f in families(stats)]


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "kvfs-metrics"

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            return self._reply(404, "text/plain; charset=utf-8", "not found: kvfs serves /metrics\n")
        if path == "/":
            return self._reply(200, "text/html; charset=utf-8",
                               '<html><body><a href="/metrics">/metrics</a></body></html>\n')
        try:
            stats = self.server.snapshot()
        except TimeoutError:
            return self._reply(503, "text/plain; charset=utf-8",
                               f"kvfs daemon did not answer within {self.server.timeout_s:g} s\n")
        except Exception as exc:  # noqa: BLE001 - a scrape failure must not kill the thread
            return self._reply(500, "text/plain; charset=utf-8", f"kvfs statistics failed: {exc}\n")
        self._reply(200, CONTENT_TYPE, exposition(stats))

    def _reply(self, code, content_type, body):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_HEAD = do_GET

    def log_message(self, fmt, *args):          # scrapes every 15 s would flood the log
        log.debug("metrics %s: %s", self.address_string(), fmt % args)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, family):
        self.address_family = family
        super().__init__(address, _Handler)


class MetricsServer:
    """``/metrics`` over HTTP, in a thread, with snapshots taken inside the trio loop.

    Create it (this binds the port, so a port in use fails the mount before
    anything is mounted), :meth:`start` it from inside the loop, and
    :meth:`aclose` it when the daemon stops.
    """

    def __init__(self, addr, port, stats_fn, *, timeout=SCRAPE_TIMEOUT):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            self.httpd = _HTTPServer((addr, port), family)
        except OSError as exc:
            raise os_error(exc, f"metrics_port: cannot listen on {addr} port {port}: {exc.strerror or exc}") from None
        self.httpd.snapshot = self._snapshot
        self.httpd.timeout_s = timeout
        self.stats_fn = stats_fn
        self.timeout = timeout
        self.token = None
        self._thread = None

    @property
    def port(self):
        return self.httpd.server_address[1]

    def start(self, trio_token):
        self.token = trio_token
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kvfs-metrics", daemon=True)
        self._thread.start()

    def _snapshot(self):
        """Called in an HTTP thread: run ``stats_fn`` in the trio loop, wait at most ``timeout``."""
        import trio                 # here, not at the top: kvfs-admin imports this module without trio
        done = threading.Event()
        box = {}

        def grab():
            try:
                box["stats"] = self.stats_fn()
            except Exception as exc:  # noqa: BLE001 - handed to the HTTP thread
                box["error"] = exc
            done.set()

        try:
            self.token.run_sync_soon(grab)
        except trio.RunFinishedError:
            raise TimeoutError from None
        if not done.wait(self.timeout):
            raise TimeoutError
        if "error" in box:
            raise box["error"]
        return box["stats"]

    async def aclose(self):
        import trio
        if self._thread is not None:
            await trio.to_thread.run_sync(self.httpd.shutdown)
            self._thread = None
        self.httpd.server_close()

    def close(self):
        """Release the port of a server that was never started."""
        if self._thread is None:
            self.httpd.server_close()
