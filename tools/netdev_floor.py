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
FIGURES = [(name, temperature, odirect, threads)
           for name, temperature, odirect, threads in sp.READ_PATHS]


class FloorFailed(bl.BenchError):
    pass


def make_floors(namespace_class, binary, root, size, threads):
    """One latencydev per floor, latency 0, no loop device (started by the caller)."""
    floors = {}
    for name, extra_args in FLOORS.items():
        floor = namespace_class(f"floor-{name.replace('_', '-')}", binary, root, size, 0, threads)
        floor.extra_args = extra_args
        floor.attach = lambda teardown: None       # read through the mount, no loop device
        floors[name] = floor
    return floors


def describe(floor):
    return {"file": str(floor.file), "size": floor.size, "latency_us": 0,
            "daemon_threads": floor.threads, "options": list(floor.extra_args),
            "daemon_init": floor.init}


def _read_pass(path, buffers, file_bytes, threads, odirect):
    """Each file read whole with one preadv() at its place in the floor's file, through
    an open of its own (as bench_softpath reads each file)."""
    flags = os.O_RDONLY | (os.O_DIRECT if odirect else 0)
    got = [0] * len(buffers)

    def read_one(_state, index):
        fd = os.open(path, flags)
        try:
            got[index] = os.preadv(fd, [memoryview(buffers[index])[:file_bytes]], index * file_bytes)
        finally:
            os.close(fd)
        if got[index] != file_bytes:
            raise bl.ShortIO(f"preadv({path}) at file {index} returned {got[index]} of {file_bytes} bytes")

    timing = bl.run_parallel(range(len(buffers)), threads, read_one)
    return timing, sum(got)


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
    result = {}
    for name, temperature, odirect, threads in FIGURES:
        if temperature == "hot":
            _read_pass(floor.file, buffers, file_bytes, sp.WRITERS, False)   # warm-up, not measured
        else:
            bl.drop_kernel_caches()
        for buf in buffers:
            bl.zero_buffer(buf)
        floor.served()                                    # counts from here
        timing, nbytes = _read_pass(floor.file, buffers, file_bytes, threads, odirect)
        served = floor.served()["read_bytes"]
        for index, (buf, digest) in enumerate(zip(buffers, expected, strict=True)):
            if bl.content_hash(memoryview(buf)[:file_bytes]) != digest:
                raise FloorFailed(f"{floor.name} {name}: file {index} read back differs from what was written")
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
