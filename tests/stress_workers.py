"""The workers of tests/test_stress.py, and the watchdog that turns a hang into a useful failure.

Every worker is a thread of the test process looping on one kind of operation
on a few overlapping names (``NAMES``) until the deadline; the blocking system
calls release the GIL, so they reach the daemon concurrently. mmap reads run in
a helper process each (a file truncated under a mapping raises SIGBUS, which
would kill the test process). Mutators take the locks of the names they change,
so each name's history (stress_oracle.History) is exact; readers take none.
"""
import collections
import errno
import json
import mmap
import os
import random
import struct
import subprocess
import sys
import threading
import time
import traceback

from stress_oracle import EMPTY, PAGE, History, Violation, content

DIRS = ("d0", "d1")
NAMES = tuple(f"{d}/f{i}" for d in DIRS for i in range(4))
SEED_POOL = range(1, 7)           # shared seeds: files that dedup against each other
OP_LIMIT = 45.0                   # one operation longer than this is a hang

MMAP_CHILD = r"""
import mmap, os, struct, sys
inp, out = sys.stdin.buffer, sys.stdout.buffer
for line in inp:
    status, data = 0, b""
    try:
        fd = os.open(line.rstrip(b"\n"), os.O_RDONLY)
        try:
            # Length 0 maps the whole file as it is now; "cannot mmap an empty
            # file" means it was empty at that moment, a state like any other.
            with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                data = m[:]
        except ValueError:
            pass
        finally:
            os.close(fd)
    except OSError as exc:
        status = exc.errno
    out.write(struct.pack("<iQ", status, len(data)) + data)
    out.flush()
"""


class Stress:
    def __init__(self, mnt, block_size, seconds, seed):
        self.mnt = mnt
        self.bs = block_size
        self.max_size = 6 * block_size + block_size // 2
        self.seconds = seconds
        self.seed = seed
        self.history = History()
        self.locks = {name: threading.Lock() for name in NAMES}
        self.counts = collections.Counter()
        self.slowest = collections.defaultdict(float)
        self.failures = []
        self.busy = {}                    # worker name -> (op, path, started, native tid)
        self._count_lock = threading.Lock()
        self._unique = iter(range(1000, 1 << 30))
        self.stop = threading.Event()
        self.children = []
        self._direct_bufs = {}            # worker -> its page-aligned O_DIRECT buffer
        self._mmap_children = {}          # worker -> its mmap helper process

    # -- bookkeeping ------------------------------------------------------------
    def op(self, worker, kind, path):
        """Context manager: ``worker`` is in ``kind`` on ``path``; counted and timed."""
        stress = self

        class _Op:
            def __enter__(self):
                self.t = time.monotonic()
                stress.busy[worker] = (kind, path, self.t, threading.get_native_id())

            def __exit__(self, *exc):
                took = time.monotonic() - self.t
                stress.busy.pop(worker, None)
                with stress._count_lock:
                    stress.counts[kind] += 1
                    stress.slowest[kind] = max(stress.slowest[kind], took)
        return _Op()

    def count(self, what, n=1):
        with self._count_lock:
            self.counts[what] += n

    def fail(self, text):
        self.failures.append(text)
        self.stop.set()

    def new_spec(self, rng):
        r = rng.random()
        bs = self.bs
        if r < 0.3:                                       # identical whole files
            return rng.choice(SEED_POOL), rng.choice((777, bs, bs + 1, 3 * bs - 5, 5 * bs + 4099))
        seed = rng.choice(SEED_POOL) if r < 0.6 else next(self._unique)
        length = rng.choice((rng.randint(1, 3 * PAGE), bs - 1, bs + 1, 2 * bs + 17,
                             rng.randint(bs, self.max_size), rng.randint(1, self.max_size)))
        return seed, length

    def path(self, name):
        return self.mnt / name

    # -- writers ----------------------------------------------------------------
    def _write_all(self, fd, data, rng, name):
        pos = 0
        while pos < len(data):
            n = rng.choice((len(data), self.bs, 3 * PAGE + 100, 200_000))
            written = os.write(fd, data[pos:pos + n])
            if written != min(n, len(data) - pos):
                self.fail(f"{name}: short write of {written} bytes of {min(n, len(data) - pos)} at {pos}")
                return
            pos += written
        if rng.random() < 0.3:
            os.fsync(fd)
            self.count("fsync_after_write")

    def publisher(self, worker, rng):
        """A new content in a temp file, then renamed over the name (the engines' pattern)."""
        name = rng.choice(NAMES)
        spec = self.new_spec(rng)
        tmp = f"{name.split('/')[0]}/.tmp-{worker}-{next(self._unique)}"
        access = os.O_WRONLY if rng.random() < 0.7 else os.O_RDWR
        with self.op(worker, "publish_write", tmp):
            fd = os.open(self.path(tmp), access | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                self._write_all(fd, content(*spec), rng, tmp)
            finally:
                os.close(fd)
        obj = self.history.new_object(spec, time.monotonic())
        with self.locks[name], self.op(worker, "publish_rename", name):
            token = self.history.begin([("name", name, obj)], time.monotonic())
            os.rename(self.path(tmp), self.path(name))
            self.history.end(token, time.monotonic())

    def rewriter(self, worker, rng):
        """O_TRUNC in place: the empty file, then the new content written in order."""
        name = rng.choice(NAMES)
        spec = self.new_spec(rng)
        access = os.O_WRONLY if rng.random() < 0.6 else os.O_RDWR
        mode = "O_WRONLY" if access == os.O_WRONLY else "O_RDWR"
        with self.locks[name], self.op(worker, "rewrite_o_trunc", f"{name} {mode}"):
            obj = self.history.current(name)
            now = time.monotonic()
            if obj is None:
                obj = self.history.new_object(EMPTY, now)
                token = self.history.begin([("name", name, obj), ("obj", obj, spec)], now)
            else:
                token = self.history.begin([("obj", obj, spec)], now)
            try:
                fd = os.open(self.path(name), access | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    self._write_all(fd, content(*spec), rng, name)
                finally:
                    os.close(fd)
            finally:
                self.history.end(token, time.monotonic())

    def unlinker(self, worker, rng):
        time.sleep(rng.uniform(0, 0.05))
        name = rng.choice(NAMES)
        with self.locks[name], self.op(worker, "unlink", name):
            present = self.history.current(name) is not None
            token = self.history.begin([("name", name, None)], time.monotonic())
            try:
                os.unlink(self.path(name))
                happened = True
            except FileNotFoundError:
                happened = False
            self.history.end(token, time.monotonic(), happened=happened)
        if happened != present:
            self.fail(f"unlink {name}: {'succeeded' if happened else 'ENOENT'}, but the name was "
                      f"{'absent' if not present else 'present'}")

    def renamer(self, worker, rng):
        time.sleep(rng.uniform(0, 0.02))
        src, dst = rng.sample(NAMES, 2)
        first, second = sorted((src, dst))
        with self.locks[first], self.locks[second], self.op(worker, "rename", f"{src} -> {dst}"):
            obj = self.history.current(src)
            changes = [("name", src, None), ("name", dst, obj)] if obj is not None else []
            token = self.history.begin(changes, time.monotonic())
            try:
                os.rename(self.path(src), self.path(dst))
                happened = True
            except FileNotFoundError:
                happened = False
            self.history.end(token, time.monotonic(), happened=happened)
        if happened != (obj is not None):
            self.fail(f"rename {src} -> {dst}: {'succeeded' if happened else 'ENOENT'}, but {src} "
                      f"was {'absent' if obj is None else 'present'}")

    def fsyncer(self, worker, rng):
        time.sleep(rng.uniform(0, 0.02))
        if rng.random() < 0.2:
            d = rng.choice(DIRS)
            with self.op(worker, "fsync_dir", d):
                fd = os.open(self.path(d), os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return
        name = rng.choice(NAMES)
        with self.op(worker, "fsync", name):
            try:
                fd = os.open(self.path(name), os.O_RDONLY if rng.random() < 0.5 else os.O_RDWR)
            except FileNotFoundError:
                return
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def cache_dropper(self, worker, rng):
        """Now and then empty the daemon's clean cache (cold reads) or flush everything."""
        time.sleep(rng.uniform(0.5, 2.0))
        command = rng.choice(("drop-caches", "drop-caches", "flush"))
        with self.op(worker, command, "."):
            os.setxattr(self.mnt, "user.kvfs.control", command.encode())

    # -- readers ----------------------------------------------------------------
    def _checked(self, name, t0, t_open, data, kind):
        t1 = time.monotonic()
        try:
            self.history.check_read(name, t0, t_open, t1, data, kind)
        except Violation as exc:
            # What else was running says which kernel path raced the read (a
            # page-cache O_RDWR rewriter or a direct_io O_WRONLY one).
            running = sorted(f"{op} {path}" for op, path, _, _ in list(self.busy.values()))
            self.fail(f"{kind} read: {exc}\nin flight when it was checked: {running}")

    def _eio(self, kind, name, exc):
        if exc.errno != errno.EIO:
            raise exc
        self.count("read_eio")
        self.failures.append(f"{kind} of {name}: EIO (no fault in the plan is unrecoverable)")

    def buffered_reader(self, worker, rng):
        name = rng.choice(NAMES)
        chunk = rng.choice((1 << 20, 3 * PAGE, self.bs))
        with self.op(worker, "read_buffered", name):
            t0 = time.monotonic()
            try:
                fd = os.open(self.path(name), os.O_RDONLY)
            except FileNotFoundError:
                return self._checked(name, t0, time.monotonic(), None, "buffered")
            t_open = time.monotonic()
            parts = []
            try:
                while part := os.read(fd, chunk):
                    parts.append(part)
            except OSError as exc:
                return self._eio("buffered read", name, exc)
            finally:
                os.close(fd)
            self._checked(name, t0, t_open, b"".join(parts), "buffered")

    def direct_reader(self, worker, rng):
        name = rng.choice(NAMES)
        mem = self._direct_bufs.get(worker)
        if mem is None:
            mem = self._direct_bufs[worker] = mmap.mmap(-1, -(-(self.max_size + 1) // self.bs) * self.bs)
        with self.op(worker, "read_o_direct", name):
            t0 = time.monotonic()
            try:
                fd = os.open(self.path(name), os.O_RDONLY | os.O_DIRECT)
            except FileNotFoundError:
                return self._checked(name, t0, time.monotonic(), None, "O_DIRECT")
            t_open = time.monotonic()
            try:
                n = os.preadv(fd, [mem], 0)
            except OSError as exc:
                return self._eio("O_DIRECT read", name, exc)
            finally:
                os.close(fd)
            self._checked(name, t0, t_open, mem[:n], "O_DIRECT")

    def mmap_reader(self, worker, rng):
        child = self._mmap_children.get(worker)
        if child is None or child.poll() is not None:
            child = self._mmap_children[worker] = subprocess.Popen([sys.executable, "-c", MMAP_CHILD],
                                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.children.append(child)
        name = rng.choice(NAMES)
        with self.op(worker, "read_mmap", name):
            t0 = time.monotonic()
            child.stdin.write(os.fsencode(self.path(name)) + b"\n")
            child.stdin.flush()
            head = child.stdout.read(12)
            if len(head) < 12:
                code = child.wait(10)
                t1 = time.monotonic()
                if code == -7 and self._rewritten_during(name, t0, t1):     # SIGBUS: truncated under the map
                    self.count("mmap_sigbus_on_truncate")
                    return
                return self.fail(f"mmap reader of {name} died with status {code} and no in-place "
                                 f"rewrite of it was running")
            status, length = struct.unpack("<iQ", head)
            data = child.stdout.read(length)
            if status == errno.ENOENT:
                return self._checked(name, t0, time.monotonic(), None, "mmap")
            if status:
                return self._eio("mmap read", name, OSError(status, os.strerror(status)))
            self._checked(name, t0, time.monotonic(), data, "mmap")

    def _rewritten_during(self, name, t0, t1):
        h = self.history
        with h.lock:
            objs = [s.value for s in h._name_segs(name) if s.overlaps(t0, t1) and s.value is not None]
            return any(seg.value[0] == "rewrite" and seg.overlaps(t0, t1)
                       for obj in objs for seg in h.objects[obj])

    # -- running ----------------------------------------------------------------
    ROLES = (("publisher", 2), ("rewriter", 2), ("unlinker", 1), ("renamer", 2), ("fsyncer", 1),
             ("buffered_reader", 2), ("direct_reader", 2), ("mmap_reader", 2), ("cache_dropper", 1))

    def _loop(self, worker, role, rng, deadline):
        fn = getattr(self, role)
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                fn(worker, rng)
        except BaseException as exc:  # noqa: BLE001 - every worker failure is reported
            self.fail(f"{worker} ({role}) raised {exc!r}:\n{traceback.format_exc()}")

    def run(self, daemon_pid, abort_connection):
        """Run every role until the deadline; returns the hang report (None: no hang)."""
        for d in DIRS:
            os.makedirs(self.path(d), exist_ok=True)
        deadline = time.monotonic() + self.seconds
        threads = []
        for role, n in self.ROLES:
            for i in range(n):
                worker = f"{role}-{i}"
                rng = random.Random(f"{self.seed}-{worker}")
                t = threading.Thread(target=self._loop, args=(worker, role, rng, deadline),
                                     name=worker, daemon=True)
                threads.append(t)
                t.start()
        hang = None
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            now = time.monotonic()
            stuck = {w: b for w, b in list(self.busy.items()) if now - b[2] > OP_LIMIT}
            if stuck or now > deadline + 2 * OP_LIMIT:
                hang = self.hang_report(threads, daemon_pid)
                abort_connection()           # the stuck system calls return ENOTCONN
                break
        for t in threads:
            t.join(30)
        for child in self.children:
            child.kill()
            child.wait()
        return hang

    def hang_report(self, threads, daemon_pid):
        now = time.monotonic()
        frames = sys._current_frames()
        lines = []
        for t in threads:
            if not t.is_alive():
                continue
            kind, path, started, tid = self.busy.get(t.name, ("(between operations)", "", now, None))
            lines.append(f"worker {t.name}: in {kind} {path} for {now - started:.1f} s")
            if tid is not None:
                lines.append("  kernel stack: " + _read(f"/proc/self/task/{tid}/stack").replace("\n", " | "))
            if t.ident in frames:
                lines.append("  python stack:\n" + "".join(traceback.format_stack(frames[t.ident])[-4:]))
        lines.append(f"daemon {daemon_pid} threads (kernel wait channels):")
        for task in sorted(os.listdir(f"/proc/{daemon_pid}/task")) if os.path.exists(f"/proc/{daemon_pid}") else []:
            lines.append(f"  {task} {_read(f'/proc/{daemon_pid}/task/{task}/comm').strip()}: "
                         f"{_read(f'/proc/{daemon_pid}/task/{task}/wchan')}")
        return "\n".join(lines)

    def summary(self, label, elapsed, extra):
        return json.dumps({"stress": label, "seconds": round(elapsed, 1), "ops": dict(sorted(self.counts.items())),
                           "total_ops": sum(self.counts.values()),
                           "slowest_s": {k: round(v, 3) for k, v in sorted(self.slowest.items())}, **extra},
                          sort_keys=False)


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return f"({exc.strerror})"
