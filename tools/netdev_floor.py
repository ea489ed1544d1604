"""The FUSE floor of kvfs-bench netdev: what any FUSE filesystem could reach here.

A kvfs read goes through the kernel's FUSE client whatever the daemon does, so
before a kvfs figure is set against ext4 it helps to know what FUSE alone allows
on this machine and kernel.  The floor is tools/netdev/latencydev.c with no
latency and no loop device: a multi-threaded C server that answers every READ
from RAM and does nothing else (no device read, no key check).  It is read with
the read passes of bench_softpath, the files laid end to end in its one file:

- ``page_cache``: opens answered without direct_io and with keep_cache, as kvfs
  answers a sealed file's by default: buffered reads fill the page cache in the
  kernel's 4 KiB folios, and hot reads are the page cache's;
- ``direct_io``: opens answered with direct_io, as kvfs's ``native_direct_io=on``
  answers buffered readers: a read() goes to the server in READs straight into
  the reader's buffer, one at a time, hot or cold.

O_DIRECT readers take the kernel's async direct I/O in both.  Each cold pass
drops the kernel's caches first and checks, from the daemon's counters, that
it served every byte; a hot pass follows an unmeasured read of every file;
every byte read is checked against what was written.
"""
import os

import bench_softpath as sp
import benchlib as bl

FLOORS = {"page_cache": ("--page-cache",), "direct_io": ()}
FIGURES = sp.READ_PATHS              # (figure, temperature, O_DIRECT, threads), as kvfs and ext4 read


class FloorFailed(bl.BenchError):
    pass


def make_floors(namespace_class, binary, root, size, threads):
    """One latencydev per floor, latency 0, no loop device (started by the caller)."""
    return {name: namespace_class(f"floor-{name.replace('_', '-')}", binary, root, size, 0, threads,
                                  loop=False, extra_args=extra_args)
            for name, extra_args in FLOORS.items()}


def describe(floor):
    return {"file": str(floor.file), "size": floor.size, "latency_us": 0,
            "daemon_threads": floor.threads, "options": list(floor.extra_args),
            "daemon_init": floor.init}


def run_floor(floor, contents, expected, buffers, file_bytes):
    """Write the files into the floor's RAM, then every cold figure once."""
    count = len(contents)
    fd = os.open(floor.file, os.O_WRONLY)
    try:
        for index, content in enumerate(contents):
            if os.pwrite(fd, content, index * file_bytes) != file_bytes:
                raise bl.ShortIO(f"pwrite({floor.file}) at file {index} was short")
    finally:
        os.close(fd)
    # Each file through an open of its own, at its place in the floor's one file.
    paths, offsets = [floor.file] * count, [index * file_bytes for index in range(count)]
    result = {}
    for name, temperature, odirect, threads in FIGURES:
        if temperature == "hot":
            sp.read_pass(paths, buffers, file_bytes, sp.WRITERS, False, offsets)  # warm-up, not measured
        else:
            bl.drop_kernel_caches()
        for buf in buffers:
            bl.zero_buffer(buf)
        floor.served()                                    # counts from here
        timing, nbytes = sp.read_pass(paths, buffers, file_bytes, threads, odirect, offsets)
        served = floor.served()["read_bytes"]
        sp.verify([f"{floor.name} {name}, file at offset {offset}" for offset in offsets],
                  buffers, file_bytes, expected)
        if temperature == "cold" and served < nbytes:
            raise FloorFailed(f"{floor.name} {name}: the daemon served {served} bytes for {nbytes} read, "
                              "so part of the cold read came from a cache")
        result[name] = sp.figure(timing, nbytes, count * file_bytes, files_verified=count,
                                 daemon_bytes_served=served)
        bl.log(f"{floor.name} {name}: {result[name]['gbps']:.3f} GB/s, "
               f"{result[name]['cpu_s_per_gb']:.2f} CPU-s/GB")
    return result


def medians(runs):
    """Per floor and figure: medians of GB/s, CPU-s per GB and seconds."""
    return {floor: {name: {key: bl.median([r["floor"][floor][name][key] for r in runs])
                           for key in ("gbps", "cpu_s_per_gb", "seconds")}
                    for name, *_ in FIGURES}
            for floor in FLOORS}
