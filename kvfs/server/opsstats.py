"""Statistics for operators that the layers do not keep themselves.

- Current values next to the high-water marks: prefetch and device reads in
  flight now (``kvfs-admin top`` shows the prefetch depth).
- The device read latency histogram (kept by the device, exported here in a
  Prometheus-shaped form: cumulative counts per upper bound).
- Recent rates: the counters are sampled once a second, and ``recent`` gives the
  rates over the last few seconds, so one ``kvfs-admin stats`` shows the current
  bandwidth, not the average since mount.
"""
import collections
import time

import trio

from ..device import READ_LATENCY_BOUNDS

SAMPLE_INTERVAL = 1.0
WINDOW = 5                 # samples kept: rates cover the last 5..6 seconds


class OpsStats:
    def __init__(self, fs):
        self.fs = fs
        self._samples = collections.deque(maxlen=WINDOW + 1)

    def _counters(self):
        cache = self.fs.cache.statistics()
        dev = self.fs.device.statistics()
        return (time.monotonic(), {
            "read_bytes_per_s": cache.bytes_read,
            "write_bytes_per_s": cache.bytes_written,
            "read_requests_per_s": cache.read_requests,
            "write_requests_per_s": cache.write_requests,
            "device_read_bytes_per_s": dev.bytes_read,
            "device_write_bytes_per_s": dev.bytes_written,
            "cache_hits": cache.cache_hits,
            "cache_misses": cache.cache_misses,
        })

    async def sample_forever(self):
        while True:
            self._samples.append(self._counters())
            await trio.sleep(SAMPLE_INTERVAL)

    def recent(self):
        now, current = self._counters()
        if not self._samples:
            return {"window_s": 0.0}
        then, old = self._samples[0]
        span = max(now - then, 1e-3)
        out = {"window_s": round(span, 3)}
        for name in current:
            if name.endswith("_per_s"):
                out[name] = round((current[name] - old[name]) / span, 1)
        hits = current["cache_hits"] - old["cache_hits"]
        lookups = hits + current["cache_misses"] - old["cache_misses"]
        out["cache_hit_ratio"] = round(hits / lookups, 4) if lookups else None
        return out

    def extend(self, stats):
        """``stats`` (Filesystem.stats()) plus the values above."""
        cache = self.fs.cache.statistics()
        dev = self.fs.device.statistics()
        stats["prefetch_inflight"] = cache.prefetch_inflight
        stats["device_reads_inflight"] = dev.reads_in_flight
        counts, total = [], 0
        for n in dev.read_latency_counts[:len(READ_LATENCY_BOUNDS)]:
            total += n
            counts.append(total)
        if counts:
            stats["device_read_latency_seconds"] = {
                "le": list(READ_LATENCY_BOUNDS), "counts": counts,
                "sum": round(dev.read_latency_sum, 6), "count": sum(dev.read_latency_counts)}
        stats["recent"] = self.recent()
        return stats
