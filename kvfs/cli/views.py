"""How kvfs-admin shows statistics: human units, the grouped summary, --all, --watch, top.

Formatting over the statistics dict the daemon returns; ``watch`` and
``TopScreen`` are handed a reader, so nothing here talks to a mount itself.
"""
import os
import time

from ..server import metrics


def human(n):
    """Bytes in binary units: 0 B, 1023 B, 1.0 KiB, 4.0 GiB."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def rate(n):
    return "-" if n is None else f"{human(n)}/s"


def duration(seconds):
    seconds = int(seconds or 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] * bool(days) + [f"{hours}h"] * bool(hours or days) + [f"{minutes}m"]
    return " ".join(parts) + f" {secs}s" if not days else " ".join(parts)


def percent(part, whole):
    return "-" if not whole else f"{100 * part / whole:.1f}%"


def ratio(hits, misses):
    return percent(hits, hits + misses) if (hits or misses) else "-"


def _error_lines(stats):
    """Errors by kind: every counter named like an error ("corrupt_reads", "*_errors", "errors_*")."""
    kinds = {"corrupt_reads": "corrupt block reads (served as EIO)"}
    for key in sorted(stats):
        if key.startswith("device_"):
            continue                    # the device's own line (_device_error_line)
        if key.endswith("_errors") or key.startswith("errors_"):
            kinds.setdefault(key, key.replace("_", " "))
    return [(text, stats[key]) for key, text in kinds.items() if isinstance(stats.get(key), int)]


def _device_error_line(s):
    """The device's errors by kind, on one line: failed calls (after io_retry), then the rest."""
    if "device_read_errors" not in s:
        return []
    failed = ", ".join(f"{s.get(f'device_{op}_errors', 0)} {op}" for op in ("read", "write", "sync", "discard"))
    line = (f"  device    failed {failed}; {s.get('device_short_transfers', 0)} short, "
            f"{s.get('device_timeouts', 0)} timed out, {s.get('device_io_retries', 0)} retried")
    if s.get("device_failed"):
        line += "; WRITES STOPPED (a metadata write went unanswered)"
    return [line]


def _mmp_line(s):
    """Multi-mount protection: the state, and the heartbeat of a claimed record."""
    if "mmp" not in s:
        return []
    line = f"mmp         {s['mmp']}"
    if "mmp_seq" in s:
        line += (f", sequence {s['mmp_seq']}, last heartbeat {s.get('mmp_heartbeat_age_s', 0):.1f} s ago "
                 f"(every {s.get('mmp_interval_s', 0):g} s)")
    return [line]


def summary(stats, rates=None):
    """The grouped, short view of ``kvfs-admin stats`` (like s3qlstat) as a list of lines.

    ``rates``: the current bandwidth as {"read": B/s, "write": B/s, "window_s": s};
    by default the daemon's own recent rates.
    """
    s = stats
    g = s.get
    recent = s.get("recent") or {}
    if rates is None:
        rates = {"read": recent.get("device_read_bytes_per_s"), "write": recent.get("device_write_bytes_per_s"),
                 "app_read": recent.get("read_bytes_per_s"), "app_write": recent.get("write_bytes_per_s"),
                 "window_s": recent.get("window_s")}
    kind = g("device_kind") or "?"
    used, cap = g("used_bytes", 0), g("capacity_bytes", 0)
    lines = [
        f"mount       {g('mountpoint')}  (daemon pid {g('pid')}, up {duration(g('uptime_s'))})",
        f"device      {g('device')}  ({kind}{', O_DIRECT' if g('direct_io') else ''}, "
        f"{human(g('block_size'))} blocks)",
        *_mmp_line(s),
        "space",
        f"  capacity  {human(cap)}",
        f"  used      {human(used)}  ({percent(used, cap)})",
        f"  free      {human(g('free_bytes'))}",
        f"  logical   {human(g('logical_bytes'))}  (dedup ratio {g('dedup_ratio', 1.0):.2f})",
    ]
    if "pinned_bytes" in s:
        lines.append(f"  pinned    {human(s['pinned_bytes'])}")
    lines.append(f"files       {g('files', 0):,}  ({g('directories', 0):,} directories, "
                 f"{g('unique_blocks', 0):,} unique blocks)")
    lines += [
        "cache",
        f"  dirty     {human(g('dirty_bytes'))} of {human(g('dirty_limit'))} limit"
        f"  (flush backlog {human(g('flush_backlog_bytes'))})",
        f"  clean     {human(g('cache_bytes'))} of {human(g('cache_size'))}",
        f"  hit rate  {ratio(g('cache_hits', 0), g('cache_misses', 0))} in RAM since mount"
        + (f", {percent(recent['cache_hit_ratio'], 1)} now" if recent.get("cache_hit_ratio") is not None else ""),
        "I/O",
        f"  device    read {human(g('device_bytes_read'))}, written {human(g('device_bytes_written'))}",
        f"  now       device read {rate(rates.get('read'))}, write {rate(rates.get('write'))}"
        + (f"; files read {rate(rates.get('app_read'))}, write {rate(rates.get('app_write'))}"
           if rates.get("app_read") is not None else "")
        + (f"  (last {rates['window_s']:.1f} s)" if rates.get("window_s") else ""),
    ]
    if "native_reads" in s:         # kvfs/fuse/readplane.c (its device reads are in "device" above)
        lines.append(f"  native    {g('native_reads', 0):,} READs ({human(g('native_read_bytes'))}) answered "
                     f"without Python, {g('native_forwarded_reads', 0):,} handed to it; "
                     f"{g('native_published_files', 0):,} files published")
    if s.get("block_maps_served") or s.get("leases_held"):      # bypass readers (kvfs.client)
        lines.append(f"  bypass    {g('block_maps_served', 0):,} block maps ({human(g('bypass_bytes_mapped'))}); "
                     f"{g('leases_held', 0):,} leases held ({human(g('lease_bytes_held'))}, "
                     f"{human(g('lease_deferred_bytes'))} of frees deferred), {g('leases_stale', 0):,} ended stale, "
                     f"{g('leases_expired', 0):,} expired")
    if "evictions" in s:
        lines += ["eviction", f"  evicted   {s['evictions']:,} files, {human(s.get('evicted_bytes', 0))}"]
    if "tier_lookups" in s:         # the shared tier (tier=rados, kvfs/tier/)
        lines += ["tier        " + ("connected" if g("tier_connected") else "NOT connected (local only)"),
                  f"  published {g('tier_published_files', 0):,} files, {g('tier_published_blocks', 0):,} blocks "
                  f"({human(g('tier_published_bytes'))}), {g('tier_publish_dedup_blocks', 0):,} already there; "
                  f"queue {g('tier_queue_len', 0)}, {g('tier_queue_drops', 0):,} dropped",
                  f"  lookups   {g('tier_lookups', 0):,}: {g('tier_hits', 0):,} hits, {g('tier_misses', 0):,} misses; "
                  f"fetched {g('tier_fetched_files', 0):,} files ({human(g('tier_fetched_bytes'))})",
                  f"  problems  {g('tier_verify_failures', 0):,} verify failures, {g('tier_timeouts', 0):,} timeouts, "
                  f"{g('tier_errors', 0):,} errors; latency {g('tier_latency_ms_mean', 0.0):.1f} ms mean, "
                  f"{g('tier_latency_ms_max', 0.0):.1f} ms max"]
    errors = _error_lines(s)
    lines.append("errors      " + (", ".join(f"{text}: {n}" for text, n in errors) if errors else "none"))
    lines += _device_error_line(s)
    return lines


def print_all(stats):
    """Every statistic, one per line (``stats --all``)."""
    flat = {}
    for name, value in stats.items():
        if isinstance(value, dict) and name != metrics.LATENCY_KEY:
            for sub, v in value.items():
                flat[f"{name}.{sub}"] = v
        else:
            flat[name] = value
    width = max(map(len, flat))
    for name in sorted(flat):
        value = flat[name]
        if name == metrics.LATENCY_KEY:
            value = f"{value['count']} reads, {value['sum']:.3f} s in all"
        elif isinstance(value, int) and not isinstance(value, bool) and (
                name.endswith("bytes") or name.endswith("_size") or name.endswith("_capacity")
                or name.endswith("_limit")):
            value = f"{value}  ({human(value)})"
        print(f"{name:<{width}}  {value}")


# -- sampling: rates between two reads of the statistics ---------------------------------
RATE_FIELDS = {
    "read": "bytes_read", "write": "bytes_written",
    "device_read": "device_bytes_read", "device_write": "device_bytes_written",
    "read_requests": "read_requests", "write_requests": "write_requests",
    "hits": "cache_hits", "misses": "cache_misses", "dedup_hits": "dedup_hits",
    "blocks_written": "blocks_written",
}


def delta(old, new, seconds):
    seconds = max(seconds, 1e-6)
    out = {name: max(0, new.get(key, 0) - old.get(key, 0)) / seconds for name, key in RATE_FIELDS.items()}
    out["window_s"] = seconds
    lookups = (new.get("cache_hits", 0) - old.get("cache_hits", 0)) + \
              (new.get("cache_misses", 0) - old.get("cache_misses", 0))
    out["hit_ratio"] = (new.get("cache_hits", 0) - old.get("cache_hits", 0)) / lookups if lookups else None
    return out


def watch(read_stats, interval, count, show):
    """Read the statistics (``read_stats()``) every ``interval`` seconds; ``show(stats, rates)`` each time."""
    old, then = read_stats(), time.monotonic()
    shown = 0
    try:
        while count is None or shown < count:
            time.sleep(interval)
            new, now = read_stats(), time.monotonic()
            show(new, delta(old, new, now - then))
            shown += 1
            old, then = new, now
    except KeyboardInterrupt:
        pass


# -- top ------------------------------------------------------------------------
TOP_COLUMNS = (
    ("time", 8), ("read/s", 10), ("write/s", 10), ("dev rd/s", 10), ("dev wr/s", 10),
    ("rreq/s", 7), ("wreq/s", 7), ("hit%", 6), ("dedup%", 6), ("prefetch", 8),
    ("dirty", 10), ("backlog", 10),
)


def top_row(stats, r):
    blocks = r["blocks_written"] + r["dedup_hits"]
    cells = (
        time.strftime("%H:%M:%S"), rate(r["read"]), rate(r["write"]), rate(r["device_read"]),
        rate(r["device_write"]), f"{r['read_requests']:.0f}", f"{r['write_requests']:.0f}",
        "-" if r["hit_ratio"] is None else f"{100 * r['hit_ratio']:.0f}",
        percent(r["dedup_hits"], blocks).rstrip("%") if blocks else "-",
        str(stats.get("prefetch_inflight", "-")), human(stats.get("dirty_bytes")),
        human(stats.get("flush_backlog_bytes")),
    )
    return "  ".join(c.rjust(w) for c, (_, w) in zip(cells, TOP_COLUMNS))


def top_header():
    return "  ".join(name.rjust(w) for name, w in TOP_COLUMNS)


class TopScreen:
    """A terminal view redrawn in place (plain ANSI: home, clear to end); scrolling rows when not a tty."""

    def __init__(self, out, mnt, tty):
        self.out, self.mnt, self.tty = out, mnt, tty
        self.rows = []

    def show(self, stats, r):
        row = top_row(stats, r)
        if not self.tty:
            if not self.rows:
                print(top_header(), file=self.out)
            self.rows.append(row)
            print(row, file=self.out, flush=True)
            return
        self.rows.append(row)
        try:
            height = os.get_terminal_size(self.out.fileno()).lines
        except OSError:
            height = 24
        head = [
            f"kvfs top  {self.mnt}  pid {stats.get('pid')}  up {duration(stats.get('uptime_s'))}  "
            f"(every {r['window_s']:.1f} s, Ctrl-C quits)",
            f"used {human(stats.get('used_bytes'))} of {human(stats.get('capacity_bytes'))}  "
            f"files {stats.get('files', 0):,}  dedup {stats.get('dedup_ratio', 1.0):.2f}  "
            f"open {stats.get('open_handles', 0)}  "
            f"hit rate {ratio(stats.get('cache_hits', 0), stats.get('cache_misses', 0))} since mount",
            "", top_header(),
        ]
        keep = max(1, height - len(head) - 1)
        self.rows = self.rows[-keep:]
        screen = "\n".join(head + self.rows[::-1])       # newest first
        self.out.write("\x1b[H\x1b[2J" + screen + "\n")
        self.out.flush()
