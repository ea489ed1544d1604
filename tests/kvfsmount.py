"""Helpers that drive real kvfs mounts through the installed command-line tools.

Tests use these instead of talking to kvfs internals: a test mounts a real
filesystem in a daemon process and then uses it through ordinary syscalls.
"""
import contextlib
import importlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvfs.base import crashpoints
from kvfs.device import testfaults as faults

from kvfs.cli import admin as admin_cli
from kvfs.cli.admin import wait_exited


# The fixtures (tests/conftest.py) that mount a real FUSE filesystem. Only tests that
# use one of them, or build a KvfsMount themselves, need root and /dev/fuse;
# tests/unit/conftest.py refuses a layer test that asks for one.
MOUNT_FIXTURES = ("kvfs", "kvfs_factory", "shared_kvfs")


# The multi-mount protection heartbeat of test mounts (seconds), unless a test names its own.
TEST_MMP_INTERVAL = 0.25


def write_new(path, data):
    """Create or truncate ``path`` and write ``data`` with one write(), which must take all of it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)


def drop_kernel_cache():
    """Write back, then drop the kernel's page cache, dentries and inodes (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def data_region(fs):
    """Where the data region starts: it runs to the end of the store file."""
    off = os.path.getsize(fs.device) - fs.stats()["capacity_bytes"]
    assert off > 0 and off % (1 << 20) == 0, off
    return off


def two_files(fs):
    """Write "victim", then "other"; on a fresh store the victim's blocks come first.

    Returns both contents and the device range of the victim's blocks.
    """
    start = data_region(fs)
    victim, other = os.urandom(3 << 20), os.urandom(3 << 20)
    write_new(fs.mnt / "victim", victim)
    fs.flush()                                   # allocated from the start of the data region
    write_new(fs.mnt / "other", other)
    fs.flush()
    return victim, other, [start, start + len(victim)]


def slow_writes(seconds):
    """A fault plan for a slow device: every device write takes ``seconds`` longer."""
    return [{"op": "write", "effect": "delay", "seconds": seconds}]


def run_tool(module, *args, check=True, timeout=300, input=None, env=None):
    """Run one of kvfs's command-line tools (``kvfs.cli.<module>``); ``env`` adds variables."""
    cmd = [sys.executable, "-m", f"kvfs.cli.{module}", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input,
                          env=None if env is None else {**os.environ, **env})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n"
                             f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


def run_tool_in_process(module, *args, check=True):
    """Run a kvfs tool's ``main()`` in this process; returns what :func:`run_tool` would.

    For the harness's own bookkeeping around a test (mkfs, the closing fsck; stats,
    flush and umount call kvfs.cli.admin's functions): the same code as the
    command, without a new interpreter. Not for use from several threads at once:
    it swaps sys.stdout and sys.stderr while the tool runs. On the
    2-core CI VM an interpreter start with kvfs's imports costs 0.3-0.5 s, and every
    mounted test made four of them. Tests of the commands themselves (their output,
    exit status, and what they do in a process of their own) use :func:`run_tool`.
    Daemons are always processes of their own: mount.kvfs still runs as a command.
    """
    tool_main = importlib.import_module(f"kvfs.cli.{module}").main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tool_main([str(a) for a in args])
        except SystemExit as exc:           # argparse's errors and --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    cmd = [f"kvfs.cli.{module}", *map(str, args)]
    proc = subprocess.CompletedProcess(cmd, code or 0, out.getvalue(), err.getvalue())
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} (in process) returned {proc.returncode}\n"
                             f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


# A daemon log line, as kvfs.cli.setup_logging formats it:
#   "2025-01-01 12:00:00,123 kvfs[/mnt/point] ERROR kvfs.server.daemon: message"
# Lines that do not match (tracebacks) continue the record above them.
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ "
                       r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<text>.*)$")


def log_records(text):
    """The records in daemon log text: a list of (level, "logger: message", full text)."""
    records = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m:
            records.append([m["level"], m["text"], line])
        elif records:
            records[-1][2] += "\n" + line
    return [tuple(r) for r in records]


_log_read_up_to = {}            # log path -> bytes of it already handed out by new_log_records


def new_log_records(path):
    """The complete records appended to the log at ``path`` since the last call for it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            start = _log_read_up_to.get(path, 0)
            if start > os.fstat(f.fileno()).st_size:
                start = 0                       # a new file of the same name
            f.seek(start)
            chunk = f.read()
    except FileNotFoundError:
        return []
    chunk = chunk[:chunk.rfind(b"\n") + 1]      # a running daemon may be mid-line
    _log_read_up_to[path] = start + len(chunk)
    return log_records(chunk.decode(errors="replace"))


class KvfsMount:
    """One kvfs filesystem: a store file plus a mountpoint.

    ``faults``: a fault plan (see kvfs/device/testfaults.py) for the daemon's device. It is
    written to ``root/faults.json`` and handed to every mount as
    ``KVFS_TEST_FAULTS=@root/faults.json``; :meth:`set_faults` replaces it, and
    a running daemon picks the new plan up on its next device call.

    Its daemons log to ``root/kvfs.log`` (unless the mount options name another
    ``log=``, or ``log`` is given). Every instance is listed in ``KvfsMount.made``
    when it is made and whenever it mounts, so that the test harness can fail a
    test whose daemons logged an unexpected error (the harness drops the ones
    no longer mounted once it has read their logs).
    """

    made = []

    def __init__(self, root: Path, size="4G", block_size=None, mount_options=(), log=None,
                 faults=None, env=None):
        self.root = Path(root)
        self.device = self.root / "store.kvfs"
        self.mnt = self.root / "mnt"
        self.mnt.mkdir(exist_ok=True)
        self.size = size
        self.block_size = block_size
        self.mount_options = list(mount_options)
        self.pid = None
        self.log = Path(log) if log else self.root / "kvfs.log"
        self.logs = {self.log}          # every log file a daemon of this store was told to use
        KvfsMount.made.append(self)
        self.env = dict(env or {})      # extra environment of its daemons (KVFS_TEST_HOST_ID, ...)
        self.faults_file = None
        if faults is not None:
            self.faults_file = self.root / "faults.json"
            self.set_faults(faults)

    # -- lifecycle -------------------------------------------------------
    def mkfs(self, *extra):
        args = ["--size", self.size]
        if self.block_size:
            args += ["--block-size", self.block_size]
        return run_tool_in_process("mkfs", *args, *extra, self.device)

    def mount(self, *options, crash=None):
        """Mount; ``crash`` ("name" or "name@N", kvfs/base/crashpoints.py) arms a crash point in this daemon only."""
        opts = [*self.mount_options, *options]
        logs = [o.partition("=")[2] for o in opts if o.startswith("log=")]
        if logs:
            self.logs.update(Path(p) for p in logs)
        else:
            opts.append(f"log={self.log}")
        if not any(o.startswith("mmp_interval=") for o in opts):
            # A short heartbeat: every mount waits two intervals to claim the store.
            # But the heartbeat is a device write too, and an owner whose heartbeat is
            # overdue (4 intervals) fences itself: a slow device needs a longer one.
            opts.append(f"mmp_interval={max(TEST_MMP_INTERVAL, self._write_delay())}")
        args = [self.device, self.mnt, "-o", ",".join(opts)]
        if self not in KvfsMount.made:
            KvfsMount.made.append(self)
        env = self.mount_env() or {}
        if crash is not None:
            env[crashpoints.ENV] = crash
        run_tool("mount", *args, timeout=120, env=env or None)
        self.pid = self.stats()["pid"]
        return self

    def _write_delay(self):
        """Seconds the fault plan adds to every device write (its "delay" rules)."""
        if self.faults_file is None:
            return 0.0
        plan = json.loads(self.faults_file.read_text())
        rules = plan["rules"] if isinstance(plan, dict) else plan
        return sum(r.get("seconds", 0) for r in rules
                   if r.get("effect") == "delay" and r.get("op", "any") in ("write", "any"))

    def mount_env(self):
        """The extra environment a daemon of this store gets (None: none)."""
        env = dict(self.env)
        if self.faults_file is not None:
            env[faults.ENV] = f"@{self.faults_file}"
        return env or None

    def set_faults(self, plan):
        """Replace the fault plan (atomically) and wait until a running daemon would see it."""
        if self.faults_file is None:
            raise AssertionError("this KvfsMount was made without faults=: its daemon reads no plan")
        tmp = self.faults_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan))
        os.replace(tmp, self.faults_file)
        if self.mounted:
            time.sleep(faults.RELOAD_INTERVAL * 1.5)

    @property
    def mounted(self):
        return os.path.ismount(self.mnt)

    def umount(self):
        """Clean unmount as kvfs-admin umount does it (flushes, waits for the daemon)."""
        admin_cli.umount(str(self.mnt), timeout=300)     # what kvfs-admin umount does
        assert not self.mounted
        self.pid = None

    def kill9(self, detach=True):
        """Crash the daemon and clean up the dead mount like an operator would.

        ``detach=False`` leaves the dead mount in place (every syscall on it gets
        ENOTCONN, none reaches the bare mountpoint) until :meth:`detach`.
        """
        pid = self.pid or self.stats()["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_exited(pid, 30)        # it re-parents to init, so we cannot reap it ourselves
        self.pid = None
        if detach:
            self.detach()

    def detach(self):
        """Lazily unmount a mount whose daemon is dead."""
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)

    def wait_crashed(self, point, timeout=30):
        """Wait for the daemon to die at crash point ``point``, then clean up its dead mount.

        Fails unless it died, and its log says it died at that point.
        """
        pid = self.pid
        if not wait_exited(pid, timeout):
            raise AssertionError(f"daemon {pid} did not die at crash point {point!r} within {timeout} s")
        self.detach()
        self.pid = None
        said = f"crash point {point!r} reached"
        logs = "".join(p.read_text(errors="replace") for p in sorted(self.logs) if p.exists())
        assert said in logs, f"daemon {pid} died, but its log never says {said!r}"

    def wait_daemon_exit(self, pid, timeout=60):
        """Wait until the daemon has exited (a zombie awaiting its reaper counts)."""
        if not wait_exited(pid, timeout):
            raise AssertionError(f"daemon {pid} still running after {timeout} s")
        self.pid = None

    def remount(self):
        if self.mounted:
            self.umount()
        return self.mount()

    # -- queries ---------------------------------------------------------
    def admin(self, *args, check=True, timeout=300):
        return run_tool("admin", *args, check=check, timeout=timeout)

    def stats(self):
        return admin_cli.read_stats(str(self.mnt))           # what kvfs-admin stats --json prints

    def flush(self):
        admin_cli.send(str(self.mnt), "flush")               # what kvfs-admin flush does

    def fsck(self, *extra, check=False):
        return run_tool("fsck", *extra, self.device, check=check, timeout=600)

    def assert_fsck_clean(self):
        proc = run_tool_in_process("fsck", self.device, check=False)
        assert proc.returncode == 0, f"fsck not clean:\n{proc.stdout}\n{proc.stderr}"

    def new_error_records(self):
        """ERROR and CRITICAL records its daemons logged since the last call (for any mount)."""
        return [(text, full) for path in sorted(self.logs) for level, text, full in new_log_records(path)
                if level in ("ERROR", "CRITICAL")]

    def teardown(self):
        """Unmount if needed and demand a clean fsck: every test ends with one."""
        if self.mounted:
            try:
                self.umount()
            except Exception:
                subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
                raise
        self.assert_fsck_clean()
