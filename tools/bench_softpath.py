"""kvfs-bench softpath: the software-path comparison of issue 9.

Both sides live on RAM, so the "device" costs the same for both and the host's
disk cache cannot blur "cold":

- kvfs: a store file on a private tmpfs, mkfs'd and mounted;
- ext4: a loop device (direct I/O when the kernel allows it) whose backing file
  is on the same tmpfs.

Workload: ``files`` files of ``file_bytes``, written by 4 threads with one
``write()`` each, then each read whole with one ``readv()`` into its own
page-aligned buffer, on these paths:

- cold buffered, 1 and 4 readers;  cold O_DIRECT, 1 and 4 readers;
- hot buffered, 1 and 4 readers (after an untimed warm-up read of every file);
- write, 4 writers (open, one write, close; new files, new contents each repeat).

After the hot single-reader pass each side reports how the kernel holds the
first file's cached pages (``page_cache``: pages, and how many of them sit in
large folios), since a hot read is the kernel copying from those folios.

Cold: ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches`` drop the kernel's
page cache, dentries and inodes, on both sides alike; then kvfs's own block
cache is emptied with ``kvfs-admin drop-caches`` until its ``cache_bytes``
statistic reads 0.  Each cold pass then checks that the device really delivered
every byte: kvfs's ``device_bytes_read`` statistic, and the loop device's
sectors read (/sys/block/loopN/stat), must each grow by at least the bytes read.

CPU: whole-machine busy time from /proc/stat (user+nice+system+irq+softirq+
steal over all CPUs) sampled at the start and end of the timed section only,
divided by the GB (1e9 bytes) moved.

Every buffer is zeroed before a pass and every file's bytes are hashed after
it (outside the timed section) against the hash of what was written, so a
fast wrong answer fails the benchmark.
"""
import os
import platform
import time
from pathlib import Path

import benchlib as bl

MiB = 1 << 20
GiB = 1 << 30
SIDES = ("kvfs", "ext4")

# (figure, temperature, O_DIRECT, threads) for the read figures, in run order.
READ_PATHS = [
    ("cold_buffered_1t", "cold", False, 1),
    ("cold_buffered_4t", "cold", False, 4),
    ("cold_direct_1t", "cold", True, 1),
    ("cold_direct_4t", "cold", True, 4),
    ("hot_buffered_1t", "hot", False, 1),
    ("hot_buffered_4t", "hot", False, 4),
]
WRITE_PATH = "write_4t"
WRITERS = 4
FIGURES = [name for name, *_ in READ_PATHS] + [WRITE_PATH]

# Issue 9, goal 1: (target name, figure, ratio, target, kind).  speed_ratio is
# kvfs GB/s over ext4 GB/s, cpu_ratio kvfs CPU-s/GB over ext4 CPU-s/GB, both
# from the medians.  "min": reach or beat it; "max": do not exceed it.
TARGETS = [
    ("cold_buffered_1t_cpu_ratio", "cold_buffered_1t", "cpu_ratio", 2.0, "max"),
    ("cold_buffered_4t_cpu_ratio", "cold_buffered_4t", "cpu_ratio", 2.0, "max"),
    ("cold_direct_1t_cpu_ratio", "cold_direct_1t", "cpu_ratio", 2.0, "max"),
    ("cold_direct_4t_cpu_ratio", "cold_direct_4t", "cpu_ratio", 2.0, "max"),
    ("cold_buffered_1t_speed_ratio", "cold_buffered_1t", "speed_ratio", 0.5, "min"),
    ("cold_direct_1t_speed_ratio", "cold_direct_1t", "speed_ratio", 0.7, "min"),
    ("hot_buffered_1t_speed_ratio", "hot_buffered_1t", "speed_ratio", 0.9, "min"),
    ("write_4t_speed_ratio", WRITE_PATH, "speed_ratio", 0.7, "min"),
]


class ColdCheckFailed(bl.BenchError):
    """A cold pass read fewer bytes from the device than it returned."""


class ContentMismatch(bl.BenchError):
    """A file read back differs from what was written."""


class Side:
    """One filesystem under test: where its files go, how to make it cold,
    and how many bytes its device has delivered so far."""

    def __init__(self, name, directory, kvfs_mnt=None, loop_dev=None):
        self.name = name
        self.directory = directory
        self.kvfs_mnt = kvfs_mnt
        self.loop_dev = loop_dev

    def paths(self, count):
        return [os.path.join(self.directory, f"chunk-{index:05d}") for index in range(count)]

    def drop_caches(self):
        # The kernel's caches first: kvfs starts prefetching a file's blocks
        # when it is opened, so anything that opens the files (fadvise would)
        # must come before kvfs's own cache is emptied.
        bl.drop_kernel_caches()
        if self.kvfs_mnt:
            bl.kvfs_drop_caches(self.kvfs_mnt)

    # kvfs counters reported per figure: what one pass cost the daemon in
    # FUSE requests, worker-thread hand-offs and device reads, and the CPU time
    # of its event-loop thread (the one thread every FUSE request goes through,
    # so its CPU-s/GB bounds a daemon's speed however many cores the host has).
    KVFS_COUNTERS = ("kernel_read_requests", "read_requests", "read_handoffs", "blocks_fetched", "cache_hits",
                     "page_fill_bytes")

    def counters(self):
        if not self.kvfs_mnt:
            return {}
        stats = bl.kvfs_stats(self.kvfs_mnt)
        counters = {name: stats.get(name, 0) for name in self.KVFS_COUNTERS}
        counters["loop_cpu_seconds"] = bl.main_thread_cpu_seconds(stats["pid"])
        return counters

    def device_bytes_read(self):
        if self.kvfs_mnt:
            return bl.kvfs_stats(self.kvfs_mnt)["device_bytes_read"]
        return bl.block_device_bytes_read(self.loop_dev)

    def make_durable(self):
        bl.make_durable(self.directory, self.kvfs_mnt)


def write_pass(paths, contents):
    """4 writers: open(O_WRONLY|O_CREAT|O_TRUNC), one write() of the whole
    file from its page-aligned buffer, close.  Returns (Timed, bytes written)."""
    written = [0] * len(paths)

    def write_one(_state, index):
        fd = os.open(paths[index], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written[index] = os.write(fd, contents[index])
        finally:
            os.close(fd)
        if written[index] != len(contents[index]):
            raise bl.ShortIO(f"write({paths[index]}) returned {written[index]} of "
                             f"{len(contents[index])} bytes")

    timing = bl.run_parallel(range(len(paths)), WRITERS, write_one)
    return timing, sum(written)


def read_pass(paths, buffers, file_bytes, threads, odirect, offsets=None):
    """Each file read whole with one preadv() into its own page-aligned buffer,
    through an open of its own, from offset 0 or from ``offsets[i]`` (the FUSE
    floor of tools/netdev_floor.py keeps its files end to end in one).
    With O_DIRECT the request is rounded up to 4 KiB; the call must still
    return exactly the file size.  Returns (Timed, bytes read)."""
    flags = os.O_RDONLY | (os.O_DIRECT if odirect else 0)
    want = bl.round_up(file_bytes) if odirect else file_bytes
    offsets = offsets or [0] * len(paths)
    got = [0] * len(paths)

    def read_one(_state, index):
        fd = os.open(paths[index], flags)
        try:
            got[index] = os.preadv(fd, [memoryview(buffers[index])[:want]], offsets[index])
        finally:
            os.close(fd)
        if got[index] != file_bytes:
            raise bl.ShortIO(f"preadv({paths[index]}, offset {offsets[index]}) returned {got[index]} "
                             f"of {file_bytes} bytes")

    timing = bl.run_parallel(range(len(paths)), threads, read_one)
    return timing, sum(got)


def verify(paths, buffers, file_bytes, expected):
    """Hash every file's bytes as read against what was written."""
    for path, buf, digest in zip(paths, buffers, expected, strict=True):
        if bl.content_hash(memoryview(buf)[:file_bytes]) != digest:
            raise ContentMismatch(f"{path}: bytes read differ from bytes written")
    return len(paths)


def figure(timing, nbytes, expected_bytes, **extra):
    seconds, cpu = timing
    return {"seconds": seconds, "bytes": nbytes, "expected_bytes": expected_bytes,
            "gbps": bl.gbps(nbytes, seconds), "cpu_seconds": cpu,
            "cpu_s_per_gb": bl.cpu_s_per_gb(cpu, nbytes), **extra}


def run_side(side, contents, expected, buffers, file_bytes):
    """Every figure once on one side; the files are removed afterwards."""
    count = len(contents)
    total = count * file_bytes
    paths = side.paths(count)
    result = {}
    try:
        timing, nbytes = write_pass(paths, contents)
        result[WRITE_PATH] = figure(timing, nbytes, total, files=count)
        _, durable = bl.timed(side.make_durable)
        result["flush_after_write"] = {"seconds": durable.seconds, "cpu_seconds": durable.cpu_seconds,
                                       "by": "kvfs-admin flush" if side.kvfs_mnt else "syncfs"}
        bl.log(f"{side.name} {WRITE_PATH}: {result[WRITE_PATH]['gbps']:.3f} GB/s, "
               f"{result[WRITE_PATH]['cpu_s_per_gb']:.2f} CPU-s/GB")
        for name, temperature, odirect, threads in READ_PATHS:
            if temperature == "hot":
                read_pass(paths, buffers, file_bytes, WRITERS, False)  # warm-up, not measured
            else:
                side.drop_caches()
            for buf in buffers:
                bl.zero_buffer(buf)  # a read that writes nothing must not pass
            device_before, counters_before = side.device_bytes_read(), side.counters()
            timing, nbytes = read_pass(paths, buffers, file_bytes, threads, odirect)
            device_bytes = side.device_bytes_read() - device_before
            counters = {k: v - counters_before[k] for k, v in side.counters().items()}
            checked = verify(paths, buffers, file_bytes, expected)
            if "loop_cpu_seconds" in counters:
                counters["loop_cpu_s_per_gb"] = bl.cpu_s_per_gb(counters["loop_cpu_seconds"], nbytes)
            result[name] = figure(timing, nbytes, total, files_verified=checked,
                                  device_bytes_read=device_bytes, **counters)
            if temperature == "cold" and device_bytes < nbytes:
                raise ColdCheckFailed(
                    f"{side.name} {name}: the device delivered {device_bytes} bytes for {nbytes} "
                    "bytes read, so part of the 'cold' read came from a cache")
            bl.log(f"{side.name} {name}: {result[name]['gbps']:.3f} GB/s, "
                   f"{result[name]['cpu_s_per_gb']:.2f} CPU-s/GB")
            if name == "hot_buffered_1t":
                # What bounds a hot read: the kernel copies once per folio, and FUSE
                # caches in 4 KiB folios where ext4 may use large ones.
                result["page_cache"] = bl.page_cache_folios(paths[0])
                bl.log(f"{side.name} page cache of {os.path.basename(paths[0])} after the hot pass: "
                       f"{result['page_cache']}")
    finally:
        for path in paths:
            with_missing_ok(os.unlink, path)
        side.make_durable()
    return result


def with_missing_ok(fn, *args):
    try:
        fn(*args)
    except FileNotFoundError:
        pass


def compute_medians(runs):
    medians = {}
    for side in SIDES:
        per_run = [run[side] for run in runs if side in run]
        medians[side] = {
            name: {key: bl.median([r[name][key] for r in per_run if key in r.get(name, {})])
                   for key in ("gbps", "cpu_s_per_gb", "seconds", "loop_cpu_s_per_gb")}
            for name in FIGURES}
    return medians


def ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def compute_table(medians):
    table = {}
    for name in FIGURES:
        k, e = medians["kvfs"][name], medians["ext4"][name]
        table[name] = {
            "kvfs_gbps": k["gbps"], "ext4_gbps": e["gbps"],
            "speed_ratio": ratio(k["gbps"], e["gbps"]),
            "kvfs_cpu_s_per_gb": k["cpu_s_per_gb"], "ext4_cpu_s_per_gb": e["cpu_s_per_gb"],
            "cpu_ratio": ratio(k["cpu_s_per_gb"], e["cpu_s_per_gb"]),
            "kvfs_loop_cpu_s_per_gb": k["loop_cpu_s_per_gb"],
        }
    return table


def compute_targets(table):
    targets = {}
    for name, fig, key, target, kind in TARGETS:
        value = table[fig][key]
        met = None if value is None else (value >= target if kind == "min" else value <= target)
        targets[name] = {"figure": fig, "ratio": key, "value": value, "target": target,
                         "kind": kind, "met": met}
    return targets


def log_summary(table, targets):
    bl.log(f"{'path':<18} {'kvfs GB/s':>9} {'ext4 GB/s':>9} {'speed':>6} "
           f"{'kvfs CPU':>8} {'ext4 CPU':>8} {'CPU':>5} {'kvfs loop':>9}")
    for name, row in table.items():
        cells = [row["kvfs_gbps"], row["ext4_gbps"], row["speed_ratio"],
                 row["kvfs_cpu_s_per_gb"], row["ext4_cpu_s_per_gb"], row["cpu_ratio"],
                 row["kvfs_loop_cpu_s_per_gb"]]
        text = [f"{c:.2f}" if c is not None else "-" for c in cells]
        bl.log(f"{name:<18} {text[0]:>9} {text[1]:>9} {text[2]:>6} {text[3]:>8} {text[4]:>8} {text[5]:>5} "
               f"{text[6]:>9}")
    for name, t in targets.items():
        sign = ">=" if t["kind"] == "min" else "<="
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        verdict = {True: "met", False: "NOT met", None: "unknown (a figure is missing or 0)"}[t["met"]]
        bl.log(f"target {name}: {value} (want {sign} {t['target']}): {verdict}")


def run(files=32, file_bytes=32 * MiB, repeat=3, workdir="/tmp", kvfs_options="", seed=0,
        keep_order=False):
    if file_bytes % 8:
        raise bl.BenchError("the file size must be a multiple of 8 bytes")
    total = files * file_bytes
    store_size = max(2 * GiB, 3 * total)
    store_size = -(-store_size // GiB) * GiB
    ext4_size = max(GiB, 2 * total + 256 * MiB)
    tmpfs_size = store_size + ext4_size + 256 * MiB
    os.makedirs(workdir, exist_ok=True)
    root = Path(workdir) / f"kvfs-bench-softpath-{os.getpid()}"
    runs = []
    with bl.Teardown() as teardown:
        root.mkdir()
        teardown.add(f"rmdir {root}", lambda: root.exists() and root.rmdir())
        ram = Path(bl.mount_tmpfs(teardown, root / "ram", tmpfs_size))
        bl.log(f"softpath: tmpfs of {tmpfs_size / GiB:.1f} GiB at {ram}; "
               f"kvfs store {store_size / GiB:.0f} GiB, ext4 loop {ext4_size / GiB:.2f} GiB")
        kvfs_mnt = bl.kvfs_mkfs_mount(teardown, ram / "store.kvfs", root / "kvfs",
                                      f"{store_size // GiB}G", kvfs_options)
        loop_dev, loop_dio = bl.ext4_on_loop(teardown, ram / "ext4.img", ext4_size, root / "ext4")
        sides = {
            "kvfs": Side("kvfs", os.path.join(kvfs_mnt, "files"), kvfs_mnt=kvfs_mnt),
            "ext4": Side("ext4", str(root / "ext4" / "files"), loop_dev=loop_dev),
        }
        for side in sides.values():
            os.makedirs(side.directory)
        contents = [bl.aligned_buffer(file_bytes) for _ in range(files)]
        buffers = [bl.aligned_buffer(file_bytes) for _ in range(files)]
        views = [memoryview(buf)[:file_bytes] for buf in contents]
        for rep in range(repeat):
            # New contents every repeat: kvfs deduplicates, and a rewrite of
            # contents it already holds would cost it no device writes.
            bl.log(f"repeat {rep + 1}/{repeat}: generating {files} files of {file_bytes} bytes")
            expected = []
            for index, buf in enumerate(contents):
                bl.fill_random(buf, (seed * 1_000_003 + rep) * 1_000_003 + index)
                expected.append(bl.content_hash(views[index]))
            # Alternate which side goes first, so drift in the machine's load
            # does not always favour the same one.
            order = list(SIDES) if keep_order or rep % 2 == 0 else list(reversed(SIDES))
            run_result = {"order": order}
            for name in order:
                bl.log(f"repeat {rep + 1}/{repeat}: {name}")
                run_result[name] = run_side(sides[name], views, expected, buffers, file_bytes)
            runs.append(run_result)
        del views
    medians = compute_medians(runs)
    table = compute_table(medians)
    targets = compute_targets(table)
    log_summary(table, targets)
    config = {
        "files": files, "file_bytes": file_bytes, "bytes": total, "repeat": repeat,
        "writers": WRITERS, "kvfs_store_size": store_size, "kvfs_options": kvfs_options,
        "ext4_backing_size": ext4_size, "tmpfs_size": tmpfs_size, "loop_direct_io": loop_dio,
        "kernel": platform.release(), "cpus": os.cpu_count(),
        "cold": "sync + drop_caches=3, then kvfs-admin drop-caches until cache_bytes is 0; "
                "device bytes read checked >= bytes read",
        "cpu": "/proc/stat busy (user+nice+system+irq+softirq+steal, all CPUs), timed section only",
        "cpu_tick_seconds": 1 / os.sysconf("SC_CLK_TCK"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return {"config": config, "runs": runs, "medians": medians, "table": table, "targets": targets}
