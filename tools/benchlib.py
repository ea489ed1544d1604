"""Measurement primitives for tools/kvfs-bench.

Everything here imitates what LMCache 0.5.6 does to its local-disk directory
(design-notes.md section 2): one file per chunk, written with one ``write()``
and read with one ``read()`` into a staging buffer, four threads at once.

Throughputs are reported in GB/s with GB = 1e9 bytes.
"""
import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Alignment for O_DIRECT buffers and lengths.  4 KiB satisfies every device
# and filesystem we meet; mmap-allocated buffers are page aligned already.
ALIGN = 4096

# Llama-3-8B chunk geometry: [K/V, layers, tokens, kv_heads * head_dim], bf16.
KV, LAYERS, TOKENS, BF16_BYTES = 2, 32, 256, 2
MODEL_NAME = "meta-llama-Meta-Llama-3-8B"

LMCACHE_THREADS = 4


class BenchError(RuntimeError):
    """A benchmark step failed in a way that makes its numbers meaningless."""


class ShortIO(BenchError):
    """A read or write returned fewer bytes than asked: LMCache would corrupt KV."""


def log(msg):
    print(f"[kvfs-bench] {msg}", file=sys.stderr, flush=True)


def gbps(nbytes, seconds):
    """Bytes/second as GB/s; None when the interval is too short to mean anything."""
    if seconds is None or seconds < 1e-6:
        return None
    return nbytes / seconds / 1e9


def round_up(n, align=ALIGN):
    return (n + align - 1) // align * align


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def cpu_s_per_gb(cpu_seconds, nbytes):
    """Whole-machine busy CPU-seconds per GB (1e9 bytes) moved."""
    if cpu_seconds is None or not nbytes:
        return None
    return cpu_seconds / (nbytes / 1e9)


# --------------------------------------------------------------------------
# Whole-machine CPU time


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_busy_seconds():
    """Busy CPU-seconds of the whole machine since boot, summed over all CPUs.

    From the aggregate ``cpu`` line of /proc/stat: user + nice + system + irq +
    softirq + steal.  idle and iowait are not busy; guest and guest_nice are
    already counted in user and nice.  A FUSE daemon, the kernel's work for
    every process, loop-device and kworker threads are all in it.
    """
    with open("/proc/stat") as f:
        fields = f.readline().split()
    if fields[0] != "cpu":
        raise BenchError("/proc/stat does not start with the aggregate cpu line")
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


class Timed(tuple):
    """(seconds, cpu_seconds) of one timed section: its wall time, and the
    whole machine's busy CPU time (``cpu_busy_seconds``) over it."""
    __slots__ = ()

    def __new__(cls, seconds, cpu_seconds):
        return super().__new__(cls, (seconds, cpu_seconds))

    seconds = property(lambda self: self[0])
    cpu_seconds = property(lambda self: self[1])


class Meter:
    """``with Meter() as m: ...`` then ``m.result()`` is the section's Timed."""

    def __enter__(self):
        self._cpu = cpu_busy_seconds()
        self._start = time.perf_counter()
        self._timed = None
        return self

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self._start
        self._timed = Timed(seconds, cpu_busy_seconds() - self._cpu)
        return False

    def result(self):
        return self._timed


def timed(fn, *args, **kwargs):
    """Call ``fn`` and return (its result, Timed)."""
    with Meter() as meter:
        value = fn(*args, **kwargs)
    return value, meter.result()


# --------------------------------------------------------------------------
# Chunk contents


def chunk_shape(chunk_bytes):
    """The real LMCache tensor shape for a chunk of this size, if there is one."""
    per_column = KV * LAYERS * TOKENS * BF16_BYTES
    if chunk_bytes % per_column == 0:
        return [KV, LAYERS, TOKENS, chunk_bytes // per_column]
    return [chunk_bytes // BF16_BYTES]


def chunk_name(seed, index):
    """An LMCache-style file name.  LMCache prints a signed hash, so about half
    of the names carry a '-' in the hash field, as real ones do."""
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    value = int.from_bytes(digest[:8], "little", signed=True)
    sign = "-" if value < 0 else ""
    return f"{MODEL_NAME}@1@0@{sign}{abs(value):x}@bfloat16.pt"


def make_chunks(count, chunk_bytes, seed=0):
    """Generate ``count`` chunks of random bf16 values, different per chunk.

    The tensors are built directly inside page-aligned anonymous mmaps, so the
    same buffers can also be written with O_DIRECT.  Seeding by (seed, index)
    makes a second call return byte-identical chunks, which the rewrite (dedup)
    measurement relies on.
    """
    # Imported lazily: read-only commands do not need torch.  The CPU wheel
    # warns on import when numpy is absent; we never use numpy.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*NumPy.*")
        import torch

    if chunk_bytes % BF16_BYTES:
        raise BenchError("chunk size must be a whole number of bf16 values")
    shape = chunk_shape(chunk_bytes)
    chunks = []
    for index in range(count):
        buf = mmap.mmap(-1, round_up(chunk_bytes))
        tensor = torch.frombuffer(buf, dtype=torch.bfloat16, count=chunk_bytes // BF16_BYTES)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        tensor.view(shape).normal_(generator=generator)
        del tensor  # drop the export so the mmap can be closed later
        chunks.append((chunk_name(seed, index), memoryview(buf)[:chunk_bytes]))
    return chunks, shape


# --------------------------------------------------------------------------
# Thread pools that behave like LMCache's disk I/O threads


def run_parallel(items, threads, work, setup=None):
    """Call ``work(state, item)`` for every item from ``threads`` threads that
    pull from one shared queue; return a ``Timed``: the wall time until the last
    finishes, and the whole machine's busy CPU time over the same interval.

    ``setup()`` builds per-thread state (a staging buffer) *before* the clock
    starts, so allocation and page faults are not measured.
    """
    states = [setup() if setup else None for _ in range(threads)]
    pending = iter(items)
    lock = threading.Lock()
    stop = threading.Event()  # set on any failure or signal: stop pulling work

    def worker(state):
        while not stop.is_set():
            with lock:
                item = next(pending, None)
            if item is None:
                return
            try:
                work(state, item)
            except BaseException:
                stop.set()
                raise

    with ThreadPoolExecutor(max_workers=threads) as pool:
        with Meter() as meter:
            futures = [pool.submit(worker, state) for state in states]
            try:
                for future in futures:
                    future.result()  # re-raises a worker's exception here
            except BaseException:
                stop.set()  # e.g. SIGTERM: let the pool's shutdown return soon
                raise
    return meter.result()


def write_files(directory, chunks, threads=LMCACHE_THREADS, odirect=False):
    """Write every chunk as its own file, as LMCache's local-disk backend does.

    Default: open(O_WRONLY|O_CREAT|O_TRUNC), one write() of the whole chunk,
    close.  With ``odirect``: open(O_WRONLY|O_CREAT|O_DIRECT) without O_TRUNC,
    LMCache's use_odirect path.
    """
    flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if odirect else os.O_TRUNC)

    def write_one(_state, chunk):
        name, data = chunk
        fd = os.open(os.path.join(directory, name), flags, 0o644)
        try:
            written = os.write(fd, data)
        finally:
            os.close(fd)
        if written != len(data):
            raise ShortIO(f"write({name}) returned {written} of {len(data)} bytes")

    return run_parallel(chunks, threads, write_one)


def list_chunk_files(directory):
    """(path, size) of every regular, non-hidden file in ``directory``."""
    files = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                continue
            files.append((entry.path, entry.stat(follow_symlinks=False).st_size))
    files.sort()
    return files


def read_files(files, threads, odirect):
    """Read each file whole with one readv() into a page-aligned staging buffer.

    With O_DIRECT the request length is rounded up to the alignment; the call
    must still return exactly the file size.  Returns a Timed.
    """
    largest = max(size for _, size in files)
    flags = os.O_RDONLY | (os.O_DIRECT if odirect else 0)

    def staging_buffer():
        buf = mmap.mmap(-1, round_up(largest))
        buf.write(bytes(len(buf)))  # fault the pages in before timing
        return memoryview(buf)

    def read_one(buf, item):
        path, size = item
        want = round_up(size) if odirect else size
        fd = os.open(path, flags)
        try:
            got = os.readv(fd, [buf[:want]])
        finally:
            os.close(fd)
        if got != size:
            raise ShortIO(f"readv({path}) returned {got} of {size} bytes")

    return run_parallel(files, threads, read_one, setup=staging_buffer)


def odirect_supported(path):
    """Whether the filesystem accepts O_DIRECT opens of the file at ``path``
    (tmpfs on older kernels, for one, answers EINVAL)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


# --------------------------------------------------------------------------
# Filesystems, caches and durability


def mount_info(path):
    """(mount target, fstype) of the filesystem holding ``path``."""
    out = subprocess.run(["findmnt", "-n", "-o", "TARGET,FSTYPE", "-T", str(path)],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


def find_kvfs_mount(directory, force=False):
    """The kvfs mountpoint holding ``directory``, or None if it is not kvfs.

    kvfs is recognised by a ``.kvfs`` entry in the directory or at the mount
    root, by a fuse.kvfs fstype, or because the caller said so (--kvfs).
    """
    target, fstype = mount_info(directory)
    if (force or "kvfs" in fstype or os.path.exists(os.path.join(directory, ".kvfs"))
            or os.path.exists(os.path.join(target, ".kvfs"))):
        return target
    return None


def kvfs_tool(module, *args, timeout=600):
    """Run ``python -m kvfs.cli.<module>`` with this repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # ``-m`` puts the working directory first on sys.path: run from another kvfs
    # checkout, the tools and the daemon would be that checkout's, not this one's.
    env["PYTHONSAFEPATH"] = "1"
    cmd = [sys.executable, "-m", f"kvfs.cli.{module}", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}: "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def kvfs_stats(mountpoint):
    return json.loads(kvfs_tool("admin", "stats", "--json", mountpoint))


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(directory):
    """syncfs(2) on the filesystem holding ``directory``: all its dirty data durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def make_durable(directory, kvfs_mnt):
    """Block until everything written to ``directory`` is on the device."""
    if kvfs_mnt:
        kvfs_tool("admin", "flush", kvfs_mnt)
    else:
        syncfs(directory)


def drop_caches(kvfs_mnt=None):
    """Make the next read cold: write back and empty kvfs's RAM cache, then the kernel's.

    kvfs is flushed first, as os.sync() below writes back ext4: sync(2) does
    not reach a FUSE daemon's write-back cache, so without the flush the timed
    reads ran beside kvfs still writing the just-stored chunks to the device,
    and read them from its dirty buffers instead of the device.
    """
    if kvfs_mnt:
        kvfs_tool("admin", "flush", kvfs_mnt)
        kvfs_tool("admin", "drop-caches", kvfs_mnt)
    os.sync()  # drop_caches only drops clean pages
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError as exc:
        raise BenchError("cold reads need root to write /proc/sys/vm/drop_caches") from exc


@contextlib.contextmanager
def tmpfs_mount(mountpoint, size_bytes):
    os.makedirs(mountpoint, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "kvfs-bench", str(mountpoint)],
                   check=True, capture_output=True)
    try:
        yield str(mountpoint)
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True)
        if os.path.ismount(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


@contextlib.contextmanager
def kvfs_mount(root, store_size, options=""):
    """mkfs a sparse kvfs store under ``root``, mount it, and always unmount it."""
    root = Path(root)
    mnt = root / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    store = root / "store.kvfs"
    kvfs_tool("mkfs", "--size", store_size, "--force", store)
    args = ["-o", options] if options else []
    try:
        # Inside the try: a mount that half succeeded must still be undone.
        kvfs_tool("mount", *args, store, mnt, timeout=120)
        yield str(mnt)
    finally:
        force_unmount_kvfs(mnt)
        store.unlink(missing_ok=True)


def force_unmount_kvfs(mnt):
    """Clean unmount through kvfs-admin; if that fails, detach the mount."""
    if not os.path.ismount(mnt):
        return
    try:
        kvfs_tool("admin", "umount", mnt, timeout=300)
    except (BenchError, subprocess.TimeoutExpired) as exc:
        log(f"kvfs-admin umount failed ({exc}); detaching with fusermount3 -uz")
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


def empty_directory(directory):
    for path, _ in list_chunk_files(directory):
        os.unlink(path)


def remove_tree(path):
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------
# The device limit, measured with fio


def fio_job(filename, size_bytes, rw, iodepth=16, end_fsync=False):
    """One fio job of 1 MiB O_DIRECT libaio I/O; returns (GB/s, CPU-s/GB).

    fio's runtime includes the end_fsync, so a write job's number is the rate
    at which data becomes durable.  The CPU figure is the whole machine's busy
    time while the fio process ran (its start-up included), per GB it moved.
    """
    cmd = ["fio", "--name=kvfs-bench", f"--filename={filename}", f"--size={size_bytes}",
           f"--rw={rw}", "--bs=1M", "--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}",
           "--numjobs=1", "--output-format=json"]
    if end_fsync:
        cmd.append("--end_fsync=1")
    proc, (_, cpu) = timed(subprocess.run, cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"fio {rw} failed: {proc.stderr.strip()}")
    # fio may print warnings before the JSON document.
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    job = report["jobs"][0]["write" if "write" in rw else "read"]
    return gbps(job["io_bytes"], job["runtime"] / 1000), cpu_s_per_gb(cpu, job["io_bytes"])


def fio_device_limits(directory, size_bytes, iodepth=16):
    """Sequential write (durable), then sequential and random reads of the same file."""
    filename = os.path.join(directory, "fio-backing")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(filename)  # a fresh file each time, like a fresh store
    try:
        limits = {}
        for name, rw, end_fsync in (("seq_write", "write", True), ("seq_read", "read", False),
                                    ("rand_read", "randread", False)):
            speed, cpu = fio_job(filename, size_bytes, rw, iodepth, end_fsync=end_fsync)
            limits[f"{name}_gbps"] = speed
            limits[f"{name}_cpu_s_per_gb"] = cpu
        return limits
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(filename)



# --------------------------------------------------------------------------
# Scratch filesystems that set themselves up and always tear down


class Teardown:
    """Undo steps, run in reverse order by ``close()`` even after a failure.

    Each step is tried on its own (one failing does not skip the rest), and
    SIGINT/SIGTERM are ignored while they run, so a second Ctrl-C cannot leave
    a mount or a loop device behind half undone.
    """

    def __init__(self):
        self._steps = []

    def add(self, description, fn, *args):
        self._steps.append((description, fn, args))

    def close(self):
        import signal
        if threading.current_thread() is threading.main_thread():
            saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        else:
            saved = {}
        try:
            while self._steps:
                description, fn, args = self._steps.pop()
                try:
                    fn(*args)
                except Exception as exc:  # keep undoing the rest
                    log(f"teardown: {description} failed: {exc!r}")
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def run_cmd(*cmd, timeout=300):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(map(str, cmd))} exited {proc.returncode}: "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def unmount(mountpoint):
    """umount; if the filesystem is busy, detach it lazily (umount -l)."""
    if not os.path.ismount(mountpoint):
        return
    if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
        log(f"umount {mountpoint} failed; detaching it lazily")
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def mount_tmpfs(teardown, mountpoint, size_bytes):
    os.makedirs(mountpoint, exist_ok=True)
    teardown.add(f"rmdir {mountpoint}", lambda: os.path.isdir(mountpoint) and os.rmdir(mountpoint))
    run_cmd("mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "kvfs-bench", mountpoint)
    teardown.add(f"umount {mountpoint}", unmount, mountpoint)
    return str(mountpoint)


def loop_attach(teardown, backing, direct_io=True):
    """Attach ``backing`` to a free loop device; returns (device, direct_io in effect)."""
    args = ["losetup", "--find", "--show"]
    dev = None
    if direct_io:
        proc = subprocess.run([*args, "--direct-io=on", str(backing)], capture_output=True, text=True)
        if proc.returncode == 0:
            dev = proc.stdout.strip()
    if dev is None:
        dev = run_cmd(*args, backing).strip()
    # Registered at once: from here on the device must be detached whatever happens.
    teardown.add(f"losetup -d {dev}", loop_detach, dev)
    dio = Path(f"/sys/block/{os.path.basename(dev)}/loop/dio")
    in_effect = dio.exists() and dio.read_text().strip() == "1"
    return dev, in_effect


def loop_detach(dev):
    proc = subprocess.run(["losetup", "-d", dev], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"losetup -d {dev}: {proc.stderr.strip()}")


def loop_devices_of(backing):
    """Loop devices attached to the file ``backing`` (for leak checks)."""
    out = subprocess.run(["losetup", "-n", "-O", "NAME", "-j", str(backing)],
                         capture_output=True, text=True).stdout
    return out.split()


def block_device_bytes_read(dev):
    """Bytes read from block device ``dev`` since it was attached (/sys/block/*/stat)."""
    with open(f"/sys/block/{os.path.basename(dev)}/stat") as f:
        return int(f.read().split()[2]) * 512


def ext4_on_loop(teardown, backing, size_bytes, mountpoint, direct_io=True):
    """A sparse ``backing`` file of ``size_bytes``, a loop device on it, ext4 on
    that, mounted at ``mountpoint``.  Returns (loop device, loop direct I/O).

    Inode tables and the journal are initialised by mkfs, so no ext4lazyinit
    thread writes (and burns CPU) behind the measurements.
    """
    os.makedirs(mountpoint, exist_ok=True)
    teardown.add(f"rmdir {mountpoint}", lambda: os.path.isdir(mountpoint) and os.rmdir(mountpoint))
    with open(backing, "wb") as f:
        f.truncate(size_bytes)
    teardown.add(f"rm {backing}", lambda: Path(backing).unlink(missing_ok=True))
    dev, dio = loop_attach(teardown, backing, direct_io)
    run_cmd("mkfs.ext4", "-F", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev, timeout=600)
    run_cmd("mount", "-t", "ext4", dev, mountpoint)
    teardown.add(f"umount {mountpoint}", unmount, mountpoint)
    return dev, dio


def kvfs_mkfs_mount(teardown, store, mountpoint, store_size, options=""):
    """mkfs a sparse kvfs store file and mount it; unmounted and removed by teardown."""
    os.makedirs(mountpoint, exist_ok=True)
    teardown.add(f"rmdir {mountpoint}", lambda: os.path.isdir(mountpoint) and os.rmdir(mountpoint))
    teardown.add(f"rm {store}", lambda: Path(store).unlink(missing_ok=True))
    kvfs_tool("mkfs", "--size", store_size, "--force", store)
    # Registered before the mount: a mount that half succeeded must still be undone.
    teardown.add(f"unmount kvfs {mountpoint}", force_unmount_kvfs, mountpoint)
    kvfs_mount_only(store, mountpoint, options)
    return str(mountpoint)


def kvfs_mount_only(store, mountpoint, options=""):
    args = ["-o", options] if options else []
    kvfs_tool("mount", *args, store, mountpoint, timeout=300)


def kvfs_drop_caches(mountpoint, attempts=20):
    """Empty kvfs's block cache and check through its statistics that it is
    empty: a prefetch still in flight can refill it after the drop."""
    for _ in range(attempts):
        kvfs_tool("admin", "drop-caches", mountpoint)
        if kvfs_stats(mountpoint)["cache_bytes"] == 0:
            return
        time.sleep(0.05)
    raise BenchError(f"kvfs at {mountpoint} still holds cached blocks after {attempts} drop-caches")


def drop_kernel_caches():
    """Write back dirty pages, then drop the page cache, dentries and inodes."""
    os.sync()  # drop_caches only drops clean pages
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError as exc:
        raise BenchError("cold runs need root to write /proc/sys/vm/drop_caches") from exc


def fadvise_dontneed(paths):
    """POSIX_FADV_DONTNEED on every file: its cached pages are dropped."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main_thread_cpu_seconds(pid):
    """User + system CPU-seconds of the process's main thread (for the kvfs daemon,
    pyfuse3's and trio's event loop), from /proc."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK      # utime, stime (fields 14, 15)


_KPF_COMPOUND_HEAD, _KPF_COMPOUND_TAIL = 1 << 15, 1 << 16      # /proc/kpageflags bits
_PAGEMAP_PRESENT, _PAGEMAP_PFN = 1 << 63, (1 << 55) - 1            # /proc/self/pagemap entry


def page_cache_folios(path):
    """How the kernel holds ``path``'s cached pages: {"pages": N, "pages_in_large_folios": M}.

    Why a benchmark wants it: a hot read() is the kernel copying from its page
    cache, once per folio, so a file held in 4 KiB folios reads slower than one
    held in large folios (ext4 on kernel 6.18 caches in 2 MiB folios; FUSE, and so
    kvfs, in 4 KiB ones). Only the pages already cached are counted: the file is
    mapped (privately, only read) and its pages looked up without faulting in any that are not
    (MAP_POPULATE is not used; a read through the mapping is made only for pages
    mincore() reports resident). Needs root (/proc/kpageflags and the PFNs in
    /proc/self/pagemap); returns None where they cannot be read.
    """
    page = mmap.PAGESIZE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return {"pages": 0, "pages_in_large_folios": 0}
        # A private mapping, so ctypes can take its address; it is only ever read,
        # so no page is copied.
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    try:
        npages = -(-size // page)
        base = _mapping_address(mapping)
        resident = (ctypes.c_ubyte * npages)()
        if _libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), resident) != 0:
            return None
        pages = in_large = 0
        # Unbuffered reads: a buffered file would serve later entries from what it
        # read ahead, before those pages were mapped.
        pagemap, kflags = os.open("/proc/self/pagemap", os.O_RDONLY), os.open("/proc/kpageflags", os.O_RDONLY)
        try:
            for index in range(npages):
                if not resident[index] & 1:
                    continue
                mapping[index * page]                       # map it: the page is cached, no I/O
                entry = int.from_bytes(os.pread(pagemap, 8, (base // page + index) * 8), "little")
                pfn = entry & _PAGEMAP_PFN
                if not entry & _PAGEMAP_PRESENT or pfn == 0:
                    return None                             # PFNs hidden: not root
                flags = int.from_bytes(os.pread(kflags, 8, pfn * 8), "little")
                pages += 1
                in_large += bool(flags & (_KPF_COMPOUND_HEAD | _KPF_COMPOUND_TAIL))
        finally:
            os.close(pagemap)
            os.close(kflags)
        return {"pages": pages, "pages_in_large_folios": in_large}
    except OSError:
        return None
    finally:
        mapping.close()


def _mapping_address(mapping):
    """The virtual address of an mmap object's first byte."""
    holder = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def process_memory(pid):
    """VmRSS and VmHWM of ``pid`` in bytes, from /proc/<pid>/status."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024  # the kernel prints kB
    return values


# --------------------------------------------------------------------------
# Verifiable contents


def content_hash(buf):
    """A digest of ``buf`` for checking bytes read against bytes written."""
    try:
        import xxhash
    except ModuleNotFoundError:
        return hashlib.blake2b(buf, digest_size=16).hexdigest()
    return xxhash.xxh3_128_hexdigest(buf)


def fill_random(buf, seed):
    """Fill the writable buffer ``buf`` (length a multiple of 8) with
    pseudo-random bytes from ``seed``: a different seed gives different bytes in
    every 8-byte word, so no block of one file deduplicates against another."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*NumPy.*")
        import torch
    generator = torch.Generator().manual_seed(seed)
    torch.frombuffer(buf, dtype=torch.int64).random_(generator=generator)


def aligned_buffer(nbytes):
    """A page-aligned, pre-faulted anonymous buffer of at least ``nbytes``."""
    buf = mmap.mmap(-1, round_up(max(nbytes, 1)))
    zero_buffer(buf)
    return buf


def zero_buffer(buf):
    """memset the buffer to 0 (also faults every page in)."""
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    ctypes.memset(view, 0, len(buf))
    del view
