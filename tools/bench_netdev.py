"""kvfs-bench netdev: kvfs and ext4 on emulated NVMe-oF namespaces (issue 34).

The device.  Each side gets a namespace of its own: tools/netdev/latencydev.c, a
multi-threaded libfuse daemon, serves one file from RAM and answers every read
and write after a fixed latency (its serving thread sleeps), with async direct
I/O and max_background 128; its RAM is faulted in at start, so a first write
costs no more than a later one.  ``losetup --direct-io=on`` puts a loop device
on that file; /sys/block/loopN/loop/dio must read 1 (else the loop driver fell
back to buffered I/O, and the benchmark stops).  The loop driver then keeps many
requests in flight, so throughput grows with queue depth as on networked flash.
The daemon is compiled on first use into tools/netdev/build/ (git-ignored).
The entry ``tmpfs`` in ``--latency-us`` instead puts the loop device straight on a
file in a tmpfs of its own (no daemon): issue 35's third device, RAM behind the
block layer with no FUSE hop.

For each latency (``--latency-us``, default 100 and 300 µs) two daemons and two
loop devices are started; then, ``--repeat`` times:

- fio, 1 MiB O_DIRECT libaio on the raw loop device (one namespace per repeat,
  alternating): a sequential write at QD16 of the region read next, then
  sequential reads at QD1 and QD16: the device limit;
- mkfs.ext4 on one device and mkfs.kvfs on the other, both mounted;
- on each side in turn (the order alternates per repeat): bench_softpath's
  run_side: ``chunks`` files of ``chunk_mib`` written by 4 writers (one write()
  each), made durable, then cold buffered 1 and 4 readers, cold O_DIRECT 1 and
  4 readers, hot buffered 1 and 4 readers, every file hashed against what was
  written, and each cold pass checked to have come from the device;
- on each side: ``kvfs.client.read_many`` of the same files, cold, from one calling
  thread, into the same buffers (on ext4 it reads them plainly: the same call);
- when ``lmcache`` imports: the real LMCache engine (tools/lmcache_workload.py)
  stores the same amount of KV and retrieves it cold, buffered and use_odirect
  with its local disk backend on both sides, and on kvfs also through the kvfs
  storage plugin (kvfs/client/lmcache.py);
- when ``sglang`` imports: SGLang's real HiCache host pool and storage backends
  (tools/sglang_workload.py) store the same amount of KV in pages and read them
  back cold: HiCacheFile on both sides, and on kvfs also the kvfs backend with
  ``batch_get_v1`` (kvfs/client/sglang.py);
- both filesystems unmounted;
- the FUSE floor (tools/netdev_floor.py): the read passes again, through two more
  latencydev mounts with no latency and no loop device, one opening files without
  direct_io (as kvfs does by default) and one with it (as ``native_direct_io=on``
  does): what a FUSE server that does nothing but copy from RAM reaches here.

The engine rows of the table compare the kvfs client against the stock backend on
ext4: the LMCache plugin against the faster of LMCache's two local disk modes on
ext4, the SGLang backend against HiCacheFile on ext4.

Cold: sync + drop_caches=3, and for kvfs ``kvfs-admin drop-caches`` until its
cache is empty (bench_softpath.Side.drop_caches).  CPU: the whole machine's busy
time from /proc/stat over the timed section, divided by the GB moved: the
emulated device's daemon and the loop driver count for both sides alike.

Teardown (also after a failure or Ctrl-C): unmount the filesystems, detach the
loop devices, unmount the daemons and wait for them to exit, remove scratch.
"""
import contextlib
import hashlib
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import bench_softpath as sp
import benchlib as bl
import netdev_floor

MiB = 1 << 20
GiB = 1 << 30
SIDES = ("kvfs", "ext4")
NETDEV_DIR = Path(__file__).resolve().parent / "netdev"
DAEMON_SOURCE = NETDEV_DIR / "latencydev.c"
DAEMON_FILE = "namespace"          # the one file a latencydev mount holds
DAEMON_THREADS = 256
FIO_MIN_BYTES = 256 * MiB          # fio reads at least this much, so a run lasts long enough
LMCACHE_MODES = ("buffered", "odirect")
LMCACHE_PLUGIN = "plugin"          # the kvfs storage plugin: kvfs side only
CLIENT_FIGURE = "cold_read_many_1t"
SGLANG_BACKENDS = {"kvfs": ("file", "kvfs"), "ext4": ("file",)}
# Engine rows: kvfs's figure, and the ext4 figures it is compared with (the best of them).
ENGINE_ROWS = {
    "lmcache_retrieve_plugin": ("lmcache_retrieve_buffered", "lmcache_retrieve_odirect"),
    "sglang_get_v1_kvfs": ("sglang_get_file",),
}
LMCACHE_LAYER_BYTES = 2 * 256 * 8 * 128 * 2   # one layer of a 256-token Llama-3-8B chunk: 1 MiB


# --------------------------------------------------------------------------
# The emulated namespace


def build_daemon(build_dir=None):
    """Compile latencydev.c (once per version of the source); return the binary's path.

    The binary's name carries a hash of the source and the compile command, so a
    changed source is rebuilt and two benchmarks building at once do not clash.
    """
    build_dir = Path(build_dir or NETDEV_DIR / "build")
    source = DAEMON_SOURCE.read_bytes()
    try:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                               text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise bl.BenchError("pkg-config cannot find fuse3: install libfuse3-dev and pkg-config "
                            "(tools/setup does)") from exc
    compiler = os.environ.get("CC", "cc")
    base = [compiler, "-O2", "-pthread", "-Wall"]
    digest = hashlib.sha256(source + repr((base, flags)).encode()).hexdigest()[:12]
    binary = build_dir / f"latencydev-{digest}"
    if binary.exists():
        return binary
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = build_dir / f".{binary.name}.{os.getpid()}.tmp"
    cmd = [*base, "-o", str(tmp), str(DAEMON_SOURCE), *flags]
    bl.log(f"building the emulated namespace daemon: {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise bl.BenchError(f"compiling {DAEMON_SOURCE} failed:\n{proc.stderr.strip()}")
    os.replace(tmp, binary)
    return binary


class Namespace:
    """One latencydev daemon and the direct-I/O loop device on its file.

    ``loop=False`` leaves the loop device out (the FUSE floor reads through the
    mount); ``extra_args`` are more latencydev options (the floor's --page-cache)."""

    def __init__(self, name, binary, root, size, latency_us, threads=DAEMON_THREADS, *, loop=True,
                 extra_args=()):
        self.name = name
        self.with_loop, self.extra_args = loop, tuple(extra_args)
        self.mountpoint = Path(root) / f"ns-{name}"
        self.file = self.mountpoint / DAEMON_FILE
        self.log_path = Path(root) / f"ns-{name}.log"
        self.binary, self.size, self.latency_us, self.threads = binary, size, latency_us, threads
        self.proc = None
        self.init = {}
        self.loop = None
        self.dio = None

    def start(self, teardown, timeout=30):
        self.mountpoint.mkdir()
        teardown.add(f"rmdir {self.mountpoint}",
                     lambda: self.mountpoint.is_dir() and self.mountpoint.rmdir())
        cmd = [str(self.binary), "--size", str(self.size), "--latency-us", str(self.latency_us),
               "--threads", str(self.threads), "--prefault", *self.extra_args, str(self.mountpoint)]
        with open(self.log_path, "w") as log_file:
            # A session of its own: a Ctrl-C at the terminal reaches only the
            # benchmark, which then tears down in order, daemons last.
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file,
                                         start_new_session=True)
        # Registered at once: from here on the daemon must be stopped whatever happens.
        teardown.add(f"stop latencydev {self.mountpoint}", self.stop)
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        text = ""
        while "\ninit " not in "\n" + text or not text.endswith("\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise bl.BenchError(f"latencydev at {self.mountpoint} did not start in {timeout} s")
            if not select.select([fd], [], [], left)[0]:
                continue
            data = os.read(fd, 4096)   # raw reads: a buffered readline could sit on a line
            if not data:
                self.proc.wait()
                raise bl.BenchError(f"latencydev exited {self.proc.returncode} at start: "
                                    f"{self.log_path.read_text().strip()}")
            text += data.decode()
        lines = text.splitlines()
        init_line = next(line for line in lines if line.startswith("init "))
        self.init = {key: int(value) for key, value in
                     (item.split("=") for item in init_line.split()[1:])}
        if not self.file.exists():
            raise bl.BenchError(f"latencydev is up but {self.file} is missing")
        if self.with_loop:
            self.attach(teardown)
        return self

    def attach(self, teardown):
        """A loop device in direct-I/O mode on the namespace file; fails unless dio is 1."""
        proc = subprocess.run(["losetup", "--direct-io=on", "--find", "--show", str(self.file)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise bl.BenchError(f"losetup --direct-io=on {self.file}: {proc.stderr.strip()}")
        self.loop = proc.stdout.strip()
        teardown.add(f"losetup -d {self.loop}", detach_loop, self.loop)
        sysdir = Path("/sys/block") / os.path.basename(self.loop)
        dio = (sysdir / "loop" / "dio").read_text().strip()
        self.dio = int(dio) if dio.isdigit() else dio
        if self.dio != 1:
            raise bl.BenchError(f"{self.loop} on {self.file}: /sys/block/.../loop/dio is {dio!r}, "
                                "not 1: the loop driver fell back to buffered I/O")
        self.queue = {name: (sysdir / "queue" / name).read_text().strip()
                      for name in ("max_sectors_kb", "logical_block_size")}

    def served(self, timeout=60):
        """What the daemon served since the last call (its SIGUSR1 line), as a dict of ints."""
        self.proc.send_signal(signal.SIGUSR1)
        fd, text = self.proc.stdout.fileno(), b""
        deadline = time.monotonic() + timeout
        while not text.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise bl.BenchError(f"no stats line from latencydev {self.mountpoint}: {text!r}")
            data = os.read(fd, 4096)        # raw reads, as start() reads its first lines
            if not data:
                raise bl.BenchError(f"latencydev {self.mountpoint} closed its output: {text!r}")
            text += data
        line = text.decode().strip()
        if not line.startswith("stats "):
            raise bl.BenchError(f"latencydev {self.mountpoint}: not a stats line: {line!r}")
        return {key: int(value) for key, value in (item.split("=") for item in line.split()[1:])}

    def stop(self, timeout=30):
        """Unmount the daemon's filesystem and wait for the daemon to exit.

        A just-detached loop device may still hold the file for a moment
        (umount answers EBUSY): retry for a while, then SIGTERM the daemon,
        which unmounts itself.
        """
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        unmounted = False
        while is_mounted(self.mountpoint) and self.proc.poll() is None:
            proc = subprocess.run(["umount", str(self.mountpoint)], capture_output=True, text=True)
            unmounted = proc.returncode == 0
            if unmounted or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if self.proc.poll() is None and not unmounted:
            # umount kept failing, or the daemon was stopped before it had mounted
            # (still faulting its RAM in).
            bl.log(f"umount {self.mountpoint} did not end latencydev; sending it SIGTERM")
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            bl.log(f"latencydev {self.proc.pid} did not exit; killing it")
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        if is_mounted(self.mountpoint):     # killed: its mount is left dangling
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        if self.proc.returncode != 0:
            raise bl.BenchError(f"latencydev exited {self.proc.returncode}: "
                                f"{self.log_path.read_text().strip()}")

    def describe(self):
        return {"loop": self.loop, "dio": self.dio, "file": str(self.file), "size": self.size,
                "latency_us": self.latency_us, "daemon_threads": self.threads, "prefault": True,
                "daemon_init": self.init, "loop_queue": self.queue}


class TmpfsNamespace(Namespace):
    """A direct-I/O loop device on a file in a tmpfs of its own (tmpfs takes O_DIRECT since
    Linux 6.6); the tmpfs is sized to the file, so its RAM is what the namespace holds."""

    def __init__(self, name, root, size):
        super().__init__(name, None, root, size, "tmpfs", threads=0)

    def start(self, teardown, timeout=30):
        self.mountpoint.mkdir()
        teardown.add(f"rmdir {self.mountpoint}",
                     lambda: self.mountpoint.is_dir() and self.mountpoint.rmdir())
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size + MiB},mode=0700",
                               "kvfs-bench-netdev", str(self.mountpoint)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise bl.BenchError(f"mount tmpfs on {self.mountpoint}: {proc.stderr.strip()}")
        teardown.add(f"umount {self.mountpoint}", self.stop)
        with open(self.file, "wb") as f:
            f.truncate(self.size)
        self.attach(teardown)
        return self

    def stop(self, timeout=30):
        deadline = time.monotonic() + timeout
        while os.path.ismount(self.mountpoint):
            proc = subprocess.run(["umount", str(self.mountpoint)], capture_output=True, text=True)
            if proc.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise bl.BenchError(f"umount {self.mountpoint}: {proc.stderr.strip()}")
            time.sleep(0.1)

    def describe(self):
        return {"loop": self.loop, "dio": self.dio, "file": str(self.file), "size": self.size,
                "latency_us": None, "backing": "tmpfs", "loop_queue": self.queue}


def make_namespace(name, binary, root, size, device, daemon_threads):
    """``device``: a latency in µs (a latencydev namespace) or "tmpfs"."""
    if device == "tmpfs":
        return TmpfsNamespace(name, root, size)
    return Namespace(name, binary, root, size, device, daemon_threads)


def device_label(device):
    return "tmpfs" if device == "tmpfs" else f"{device} us"


def mount_targets():
    """Every mount point, from /proc/self/mountinfo: dead FUSE mounts too."""
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def is_mounted(path):
    """Whether something is mounted on ``path``, dead FUSE mounts included (os.path.ismount
    stats the path, which a dead FUSE mount answers with ENOTCONN, and says False)."""
    return str(path) in mount_targets()


def detach_loop(dev, timeout=30):
    """losetup -d, then wait until the loop device has let go of its file."""
    bl.loop_detach(dev)
    backing = Path("/sys/block") / os.path.basename(dev) / "loop" / "backing_file"
    deadline = time.monotonic() + timeout
    while backing.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_scratch(root):
    """rm -r the scratch directory, unless something is still mounted under it."""
    mounted = [target for target in mount_targets() if target.startswith(f"{root}/")]
    if mounted:
        raise bl.BenchError(f"not removing {root}: still mounted there: {mounted}")
    shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------
# One repeat


def device_limit(ns, nbytes):
    """fio on the raw loop device: write the region at QD16, then read it at QD1 and QD16."""
    size = min(max(nbytes, FIO_MIN_BYTES), ns.size)
    result = {"namespace": ns.name, "bytes": size}
    for name, rw, depth in (("write_qd16", "write", 16), ("read_qd1", "read", 1),
                            ("read_qd16", "read", 16)):
        speed, cpu = bl.fio_job(ns.loop, size, rw, depth)
        result[name] = {"gbps": speed, "cpu_s_per_gb": cpu}
        bl.log(f"fio {name} on {ns.loop} ({ns.name}): {speed:.2f} GB/s, {cpu:.2f} CPU-s/GB")
    return result


def mount_sides(teardown, root, namespaces, kvfs_options):
    """mkfs.ext4 and mkfs.kvfs on the two loop devices, both mounted; returns Sides."""
    ext4_ns, kvfs_ns = namespaces["ext4"], namespaces["kvfs"]
    ext4_mnt, kvfs_mnt = Path(root) / "ext4", Path(root) / "kvfs"
    for mnt in (ext4_mnt, kvfs_mnt):
        mnt.mkdir()
        teardown.add(f"rmdir {mnt}", lambda mnt=mnt: mnt.is_dir() and mnt.rmdir())
    bl.run_cmd("mkfs.ext4", "-F", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0",
               ext4_ns.loop, timeout=600)
    teardown.add(f"umount {ext4_mnt}", bl.unmount, ext4_mnt)
    bl.run_cmd("mount", "-t", "ext4", ext4_ns.loop, ext4_mnt)
    bl.kvfs_tool("mkfs", "--force", kvfs_ns.loop)
    # Registered before the mount: a mount that half succeeded must still be undone.
    teardown.add(f"unmount kvfs {kvfs_mnt}", bl.force_unmount_kvfs, kvfs_mnt)
    bl.kvfs_mount_only(kvfs_ns.loop, kvfs_mnt, kvfs_options)
    sides = {"ext4": sp.Side("ext4", str(ext4_mnt / "files"), loop_dev=ext4_ns.loop),
             "kvfs": sp.Side("kvfs", str(kvfs_mnt / "files"), kvfs_mnt=str(kvfs_mnt), loop_dev=kvfs_ns.loop)}
    for side in sides.values():
        os.makedirs(side.directory)
    return sides


def lmcache_shape(chunk_bytes):
    """The LMCache model shape whose chunk file has ``chunk_bytes`` (Llama-3-8B for 32 MiB)."""
    import lmcache_workload as lw
    if chunk_bytes % LMCACHE_LAYER_BYTES:
        raise bl.BenchError(f"LMCache chunks are whole layers of {LMCACHE_LAYER_BYTES} bytes; "
                            f"{chunk_bytes} is not")
    layers = chunk_bytes // LMCACHE_LAYER_BYTES
    if layers == lw.LLAMA3_8B.layers:
        return lw.LLAMA3_8B
    return lw.ModelShape(name=f"kvfs-bench/netdev-{layers}-layers", layers=layers)


def run_lmcache(side, chunks, chunk_bytes):
    """The real LMCache engine on one side: store, make cold, retrieve; per mode."""
    import lmcache_workload as lw
    shape = lmcache_shape(chunk_bytes)
    results = {}
    for mode in LMCACHE_MODES:
        directory = os.path.join(os.path.dirname(side.directory), f"lmcache-{mode}")

        def cold():
            side.make_durable()
            side.drop_caches()

        try:
            # Our stdout carries one JSON object: keep any prints of LMCache's off it.
            with contextlib.redirect_stdout(sys.stderr):
                result = lw.run(directory, chunks=chunks, use_odirect=mode == "odirect",
                                cold_hook=cold, shape=shape)
            bl.log(f"{side.name} lmcache retrieve {mode}: {result['retrieve_gbps']:.3f} GB/s, "
                   f"{result['retrieve_cpu_s_per_gb']:.2f} CPU-s/GB")
        except Exception as exc:  # record it, keep measuring
            bl.log(f"{side.name} lmcache {mode} failed: {exc!r}")
            result = {"error": repr(exc)}
        finally:
            bl.remove_tree(directory)
            side.make_durable()
        results[mode] = result
    return results


def run_lmcache_plugin(side, chunks, chunk_bytes):
    """LMCache with the kvfs storage plugin on the kvfs side: store, make cold, retrieve."""
    import lmcache_workload as lw
    directory = os.path.join(os.path.dirname(side.directory), "lmcache-plugin")

    def cold():
        side.make_durable()
        side.drop_caches()

    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = lw.run(directory, chunks=chunks, use_odirect=False, cold_hook=cold,
                            shape=lmcache_shape(chunk_bytes), plugin=True)
        bl.log(f"{side.name} lmcache retrieve plugin: {result['retrieve_gbps']:.3f} GB/s, "
               f"{result['retrieve_cpu_s_per_gb']:.2f} CPU-s/GB")
    except Exception as exc:  # record it, keep measuring
        bl.log(f"{side.name} lmcache plugin failed: {exc!r}")
        result = {"error": repr(exc)}
    finally:
        bl.remove_tree(directory)
        side.make_durable()
    return result


def release_bypass_devices():
    """Close the device descriptors kvfs.client's bypass keeps open in this process.

    The client opens a store's device once and keeps it for the process's life; here
    that device is a loop device the benchmark detaches after each repeat, and an open
    descriptor would keep its namespace file busy (latencydev then cannot unmount).
    Uses the client's ``release_devices()`` where it has one.
    """
    bypass = sys.modules.get("kvfs.client.bypass")
    if bypass is None:
        return
    release = getattr(bypass, "release_devices", None)
    if release is not None:
        release()
        return
    state = bypass._state
    with state.lock:
        held, state.devices = list(state.devices.values()), {}
    for fd, *_ in held:
        os.close(fd)


def run_read_many(side, contents, expected, buffers, file_bytes):
    """kvfs.client.read_many of every file, cold, from one calling thread."""
    from kvfs.client import read_many
    from kvfs.client.bypass import last_ways
    count = len(contents)
    paths = [os.path.join(os.path.dirname(side.directory), "client", os.path.basename(p))
             for p in side.paths(count)]
    os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
    try:
        sp.write_pass(paths, contents)
        side.make_durable()
        side.drop_caches()
        for buf in buffers:
            bl.zero_buffer(buf)
        # The block device's own count: on kvfs the client reads the device itself,
        # which the daemon's device_bytes_read does not see. What the daemon read on
        # top (a prefetch the client's open set off: the device read twice) is its own
        # figure, daemon_device_bytes_read.
        device_before = bl.block_device_bytes_read(side.loop_dev)
        daemon_before = side.device_bytes_read() if side.kvfs_mnt else 0
        items = [(path, memoryview(buf)[:file_bytes]) for path, buf in zip(paths, buffers)]
        sizes, timing = bl.timed(read_many, items)
        device_bytes = bl.block_device_bytes_read(side.loop_dev) - device_before
        daemon_bytes = side.device_bytes_read() - daemon_before if side.kvfs_mnt else None
        ways = last_ways()                     # per file: read from the device itself (else the mount)
        nbytes = sum(sizes)
        checked = sp.verify(paths, buffers, file_bytes, expected)
        result = sp.figure((timing.seconds, timing.cpu_seconds), nbytes, count * file_bytes,
                           files_verified=checked, device_bytes_read=device_bytes, threads=1,
                           files_bypassed=sum(ways), daemon_device_bytes_read=daemon_bytes)
        if device_bytes < nbytes:
            raise sp.ColdCheckFailed(f"{side.name} {CLIENT_FIGURE}: the device delivered "
                                     f"{device_bytes} bytes for {nbytes} bytes read")
        bl.log(f"{side.name} {CLIENT_FIGURE}: {result['gbps']:.3f} GB/s, "
               f"{result['cpu_s_per_gb']:.2f} CPU-s/GB")
    finally:
        for path in paths:
            sp.with_missing_ok(os.unlink, path)
        side.make_durable()
    return result


def sglang_shape(chunk_bytes):
    """An MHA page_first geometry whose pages are a quarter of a chunk (8 MiB for 32 MiB):
    chunk_bytes / 1 MiB layers of 8 heads x 128 dims in bf16, 64-token pages."""
    import sglang_workload as sw
    layers = chunk_bytes // LMCACHE_LAYER_BYTES
    if chunk_bytes % LMCACHE_LAYER_BYTES or layers < 1:
        raise bl.BenchError(f"SGLang pages here are whole layers of {LMCACHE_LAYER_BYTES} bytes "
                            f"per chunk; {chunk_bytes} is not")
    return sw.PoolShape(mla=False, layers=layers, heads=8, head_dim=128, page_size=64)


def run_sglang(side, chunks, chunk_bytes):
    """SGLang's HiCache backends on one side: store pages, make cold, read them back."""
    import sglang_workload as sw
    shape = sglang_shape(chunk_bytes)
    pages = chunks * chunk_bytes // shape.page_bytes
    results = {}
    for backend in SGLANG_BACKENDS[side.name]:
        directory = os.path.join(os.path.dirname(side.directory), f"sglang-{backend}")

        def cold():
            side.make_durable()
            side.drop_caches()

        try:
            with contextlib.redirect_stdout(sys.stderr):
                result = sw.run(directory, backend=backend, pages=pages, shape=shape,
                                cold_hook=cold)
            bl.log(f"{side.name} sglang get {backend}: {result['get_gbps']:.3f} GB/s, "
                   f"{result['get_cpu_s_per_gb']:.2f} CPU-s/GB")
        except Exception as exc:  # record it, keep measuring
            bl.log(f"{side.name} sglang {backend} failed: {exc!r}")
            result = {"error": repr(exc)}
        finally:
            bl.remove_tree(directory)
            side.make_durable()
        results[backend] = result
    return results


def run_repeat(rep, root, namespaces, floors, contents, views, expected, buffers, file_bytes, seed,
               kvfs_options, lmcache, sglang=False):
    run = {}
    # The device limit first, on the raw device (mkfs comes after it).
    fio_ns = namespaces[SIDES[rep % 2]]
    run["device"] = device_limit(fio_ns, len(views) * file_bytes)
    for index, buf in enumerate(contents):
        bl.fill_random(buf, (seed * 1_000_003 + rep) * 1_000_003 + index)
        expected[index] = bl.content_hash(views[index])
    order = list(SIDES) if rep % 2 == 0 else list(reversed(SIDES))
    run["order"] = order
    with bl.Teardown() as teardown:
        rep_root = Path(root) / f"repeat-{rep}"
        rep_root.mkdir()
        teardown.add(f"rmdir {rep_root}", lambda: rep_root.is_dir() and rep_root.rmdir())
        sides = mount_sides(teardown, rep_root, namespaces, kvfs_options)
        # Runs before the unmounts (teardown is last in, first out).
        teardown.add("close kvfs.client's device descriptors", release_bypass_devices)
        for name in order:
            bl.log(f"repeat {rep + 1}: {name}")
            run[name] = sp.run_side(sides[name], views, expected, buffers, file_bytes)
            run[name][CLIENT_FIGURE] = run_read_many(sides[name], views, expected, buffers,
                                                     file_bytes)
            if lmcache:
                run[name]["lmcache"] = run_lmcache(sides[name], len(views), file_bytes)
                if name == "kvfs":
                    run[name]["lmcache"][LMCACHE_PLUGIN] = run_lmcache_plugin(
                        sides[name], len(views), file_bytes)
            if sglang:
                run[name]["sglang"] = run_sglang(sides[name], len(views), file_bytes)
    run["floor"] = {name: netdev_floor.run_floor(floor, views, expected, buffers, file_bytes)
                    for name, floor in floors.items()}
    return run


# --------------------------------------------------------------------------
# Medians, ratios, output


def ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def _engine_medians(results, prefix):
    """Medians of the engine results that did not fail (``prefix``: retrieve or get)."""
    ok = [m for m in results if "error" not in m]
    return {"gbps": bl.median([m[f"{prefix}_gbps"] for m in ok]),
            "cpu_s_per_gb": bl.median([m[f"{prefix}_cpu_s_per_gb"] for m in ok]),
            "seconds": bl.median([m[f"{prefix}_seconds"] for m in ok]),
            "runs": len(ok)}


def compute_medians(runs, lmcache, sglang=False):
    medians = {"device": {}}
    for name in ("write_qd16", "read_qd1", "read_qd16"):
        medians["device"][name] = {key: bl.median([r["device"][name][key] for r in runs])
                                   for key in ("gbps", "cpu_s_per_gb")}
    for side in SIDES:
        medians[side] = {
            name: {key: bl.median([r[side][name][key] for r in runs])
                   for key in ("gbps", "cpu_s_per_gb", "seconds")}
            for name in [*sp.FIGURES, CLIENT_FIGURE]}
        if lmcache:
            modes = [*LMCACHE_MODES, LMCACHE_PLUGIN] if side == "kvfs" else LMCACHE_MODES
            for mode in modes:
                medians[side][f"lmcache_retrieve_{mode}"] = _engine_medians(
                    [r[side]["lmcache"][mode] for r in runs], "retrieve")
        if sglang:
            names = {"file": "sglang_get_file", "kvfs": "sglang_get_v1_kvfs"}
            for backend in SGLANG_BACKENDS[side]:
                medians[side][names[backend]] = _engine_medians(
                    [r[side]["sglang"][backend] for r in runs], "get")
    medians["floor"] = netdev_floor.medians(runs)
    return medians


def compute_table(medians):
    """Per figure: both sides' GB/s and CPU-s/GB, kvfs/ext4, and each over the device.

    An engine row (ENGINE_ROWS) has no figure of the same name on ext4: it is set
    against the best of the named ext4 figures (``ext4_figure`` says which)."""
    device = medians["device"]
    table = {}
    for name in medians["kvfs"]:
        k = medians["kvfs"][name]
        extra = {}
        if name in ENGINE_ROWS:
            candidates = [c for c in ENGINE_ROWS[name]
                          if c in medians["ext4"] and medians["ext4"][c]["gbps"] is not None]
            if not candidates:
                continue
            best = max(candidates, key=lambda c: medians["ext4"][c]["gbps"])
            e, extra = medians["ext4"][best], {"ext4_figure": best}
        else:
            e = medians["ext4"][name]
        row = {"kvfs_gbps": k["gbps"], "kvfs_cpu_s_per_gb": k["cpu_s_per_gb"],
               "ext4_gbps": e["gbps"], "ext4_cpu_s_per_gb": e["cpu_s_per_gb"],
               "speed_ratio": ratio(k["gbps"], e["gbps"]),
               "cpu_ratio": ratio(k["cpu_s_per_gb"], e["cpu_s_per_gb"]), **extra}
        limits = ({"device_write_qd16": "write_qd16"} if name == sp.WRITE_PATH else
                  {"device_qd1": "read_qd1", "device_qd16": "read_qd16"})
        for label, key in limits.items():
            row[f"kvfs_over_{label}"] = ratio(k["gbps"], device[key]["gbps"])
            row[f"ext4_over_{label}"] = ratio(e["gbps"], device[key]["gbps"])
        for floor, figures in medians["floor"].items():
            if name in figures:       # the FUSE floor (tools/netdev_floor.py): reads only
                f = figures[name]
                row[f"floor_{floor}_gbps"] = f["gbps"]
                row[f"floor_{floor}_cpu_s_per_gb"] = f["cpu_s_per_gb"]
                row[f"floor_{floor}_over_ext4"] = ratio(f["gbps"], e["gbps"])
                row[f"kvfs_over_floor_{floor}"] = ratio(k["gbps"], f["gbps"])
        table[name] = row
    return table


def log_summary(latency_us, medians, table):
    device = medians["device"]
    bl.log(f"--- {device_label(latency_us)}: device (fio, raw loop) read QD1 "
           f"{fmt(device['read_qd1']['gbps'])} GB/s ({fmt(device['read_qd1']['cpu_s_per_gb'])} CPU-s/GB), "
           f"QD16 {fmt(device['read_qd16']['gbps'])} GB/s ({fmt(device['read_qd16']['cpu_s_per_gb'])}), "
           f"write QD16 {fmt(device['write_qd16']['gbps'])} GB/s")
    bl.log(f"{'figure':<26} {'kvfs GB/s':>9} {'ext4 GB/s':>9} {'k/e':>5} {'kvfs CPU':>8} "
           f"{'ext4 CPU':>8} {'CPU k/e':>7} {'k/QD1':>6} {'k/QD16':>6} {'floor pc/dio GB/s':>17}")
    for name, row in table.items():
        floors = (f"{fmt(row['floor_page_cache_gbps'])}/{fmt(row['floor_direct_io_gbps'])}"
                  if "floor_page_cache_gbps" in row else "")
        bl.log(f"{name:<26} {fmt(row['kvfs_gbps']):>9} {fmt(row['ext4_gbps']):>9} "
               f"{fmt(row['speed_ratio']):>5} {fmt(row['kvfs_cpu_s_per_gb']):>8} "
               f"{fmt(row['ext4_cpu_s_per_gb']):>8} {fmt(row['cpu_ratio']):>7} "
               f"{fmt(row.get('kvfs_over_device_qd1')):>6} {fmt(row.get('kvfs_over_device_qd16')):>6} "
               f"{floors:>17}")


def fmt(value):
    return "-" if value is None else f"{value:.2f}"


def sglang_available():
    """(True, None) when tools/sglang_workload.py and SGLang's HiCache classes import."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import sglang_workload  # noqa: F401
    except ImportError as exc:
        return False, f"sglang does not import: {exc}"
    return True, None


def lmcache_available():
    """(True, None) when tools/lmcache_workload.py and the real LMCache import, else (False, why)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import lmcache_workload  # noqa: F401
    except ImportError as exc:
        return False, f"lmcache does not import: {exc}"
    return True, None


def run(latencies_us=(100, 300), chunks=16, chunk_bytes=32 * MiB, repeat=3, dev_size=None,
        workdir="/tmp", kvfs_options="", keep=False, lmcache=True, seed=0,
        daemon_threads=DAEMON_THREADS, sglang=True):
    if chunk_bytes % 4096:
        raise bl.BenchError("the chunk size must be a multiple of 4 KiB")
    total = chunks * chunk_bytes
    dev_size = dev_size or 2 * total + GiB
    dev_size = -(-dev_size // MiB) * MiB
    lmcache_why = "--no-lmcache"
    if lmcache:
        lmcache, lmcache_why = lmcache_available()
        if lmcache:
            lmcache_shape(chunk_bytes)          # refuse a size LMCache cannot hold, before any setup
        else:
            bl.log(f"LMCache rows skipped: {lmcache_why}")
    sglang_why = "--no-sglang"
    if sglang:
        sglang, sglang_why = sglang_available()
        if sglang:
            sglang_shape(chunk_bytes)
        else:
            bl.log(f"SGLang rows skipped: {sglang_why}")
    binary = build_daemon()
    os.makedirs(workdir, exist_ok=True)
    root = Path(workdir) / f"kvfs-bench-netdev-{os.getpid()}"
    results, namespaces_info, floors_info = {}, {}, {}
    with bl.Teardown() as scratch:
        root.mkdir()
        if not keep:
            scratch.add(f"rm -r {root}", remove_scratch, root)
        contents = [bl.aligned_buffer(chunk_bytes) for _ in range(chunks)]
        buffers = [bl.aligned_buffer(chunk_bytes) for _ in range(chunks)]
        views = [memoryview(buf)[:chunk_bytes] for buf in contents]
        try:
            for latency in latencies_us:
                lat_root = root / device_label(latency).replace(" ", "")
                lat_root.mkdir()
                runs = []
                with bl.Teardown() as teardown:
                    bl.log(f"{device_label(latency)}: two namespaces of {dev_size / GiB:.2f} GiB")
                    namespaces = {side: make_namespace(side, binary, lat_root, dev_size, latency,
                                                       daemon_threads).start(teardown)
                                  for side in ("ext4", "kvfs")}
                    namespaces_info[str(latency)] = {side: ns.describe() for side, ns in namespaces.items()}
                    floors = netdev_floor.make_floors(Namespace, binary, lat_root, -(-total // MiB) * MiB,
                                                      daemon_threads)
                    for floor in floors.values():
                        floor.start(teardown)
                    floors_info[str(latency)] = {name: netdev_floor.describe(floor)
                                                 for name, floor in floors.items()}
                    bl.log("loop devices: " + ", ".join(f"{side} {ns.loop} dio={ns.dio}"
                                                        for side, ns in namespaces.items()))
                    for rep in range(repeat):
                        bl.log(f"{device_label(latency)}, repeat {rep + 1}/{repeat}")
                        expected = [None] * chunks
                        runs.append(run_repeat(rep, lat_root, namespaces, floors, contents, views, expected,
                                               buffers, chunk_bytes, seed, kvfs_options, lmcache,
                                               sglang))
                medians = compute_medians(runs, lmcache, sglang)
                table = compute_table(medians)
                log_summary(latency, medians, table)
                results[str(latency)] = {"runs": runs, "medians": medians, "table": table}
        finally:
            del views
    config = {
        "latencies_us": list(latencies_us), "chunks": chunks, "chunk_bytes": chunk_bytes,
        "bytes": total, "repeat": repeat, "writers": sp.WRITERS, "figures": sp.FIGURES,
        "device_size": dev_size, "kvfs_options": kvfs_options, "daemon": str(binary),
        "namespaces": namespaces_info,
        "floors": floors_info,
        "floor": "latencydev with latency 0 and no loop device, read through its mount: "
                 "page_cache (opens without direct_io, keep_cache) and direct_io (opens with it); "
                 "the read passes",
        "loop_dio": {lat: {side: info["dio"] for side, info in sides.items()}
                     for lat, sides in namespaces_info.items()},
        "lmcache": bool(lmcache), "lmcache_skipped": None if lmcache else lmcache_why,
        "sglang": bool(sglang), "sglang_skipped": None if sglang else sglang_why,
        "client": f"{CLIENT_FIGURE}: kvfs.client.read_many of every file from one thread",
        "workdir": str(root), "kept": keep,
        "kernel": platform.release(), "cpus": os.cpu_count(),
        "device_limit": "fio 1 MiB O_DIRECT libaio on the raw loop device: seq write QD16, "
                        "then seq read QD1 and QD16 of the same region; one namespace per repeat",
        "cold": "sync + drop_caches=3, then kvfs-admin drop-caches until cache_bytes is 0; "
                "device bytes read checked >= bytes read",
        "cpu": "/proc/stat busy (user+nice+system+irq+softirq+steal, all CPUs), timed section only",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    failed = any("error" in result
                 for lat in results.values() for r in lat["runs"] for side in SIDES
                 for engine in ("lmcache", "sglang") for result in r[side].get(engine, {}).values())
    return {"config": config, "latencies": results}, 1 if failed else 0
