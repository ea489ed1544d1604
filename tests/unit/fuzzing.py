"""The harness of the format fuzzers (tests/unit/test_fuzz_format.py).

Profiles: ``kvfs-ci`` (the default, a short run that CI does on every push) and
``kvfs-long`` (``KVFS_FUZZ=long``, the documented longer run; ``KVFS_FUZZ_EXAMPLES=N``
sets its examples per target). Every fuzz target counts its cases by outcome in
:data:`COUNTS`; the module prints the table at its end (``pytest -s`` shows it) and
writes it as JSON to ``$KVFS_FUZZ_REPORT`` when that is set.

The one rule every target checks (:func:`attempt`): decoding, loading, replaying,
mounting (in-process) and fsck either succeed or raise a :class:`KvfsError` with a
one-line message; any other exception fails the test, and so does taking longer
than :data:`DEADLINE_S` (a hang).
"""
import collections
import contextlib
import os
import signal
import stat

import trio
from hypothesis import HealthCheck, settings

from kvfs.server import fsck
from kvfs.errors import InternalError, KvfsError
from kvfs.namespace import ROOT_INO

from .helpers import open_fs, running

DEADLINE_S = 20.0
_EXAMPLES = int(os.environ.get("KVFS_FUZZ_EXAMPLES", "2000"))
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much, HealthCheck.large_base_example])
settings.register_profile("kvfs-ci", max_examples=100, **_COMMON)
settings.register_profile("kvfs-long", max_examples=_EXAMPLES, **_COMMON)
PROFILE = "kvfs-long" if os.environ.get("KVFS_FUZZ") == "long" else "kvfs-ci"
FUZZ = settings(settings.get_profile(PROFILE))

VERBOSE = bool(os.environ.get("KVFS_FUZZ_VERBOSE"))      # print every refusal's message
COUNTS = collections.defaultdict(collections.Counter)     # target -> outcome -> cases


class Hang(AssertionError):
    pass


@contextlib.contextmanager
def deadline(seconds=DEADLINE_S):
    """Fail with Hang if the body runs longer than ``seconds`` (SIGALRM: the main thread only)."""
    def expired(signum, frame):
        raise Hang(f"no result after {seconds} s: a hang")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def attempt(target, step, fn, *args, **kw):
    """Run ``fn(*args, **kw)``: its result, or None after a KvfsError (counted, message checked)."""
    with deadline():
        try:
            result = fn(*args, **kw)
        except InternalError:
            raise                          # a kvfs bug, even though it is a KvfsError
        except KvfsError as exc:
            message = str(exc)
            assert message.strip() and "\n" not in message, f"{step}: unclear message {message!r}"
            COUNTS[target][f"{step}: {type(exc).__name__}"] += 1
            if VERBOSE:
                print(f"{target} {step}: {message}")
            return None
    COUNTS[target][f"{step}: ok"] += 1
    return result


def count_case(target):
    COUNTS[target]["cases"] += 1


class Image:
    """A store file built once per module; examples damage it and put it back afterwards.

    ``files``: {path bytes: content} of what was written through the real stack.
    """

    def __init__(self, path, sb, files):
        self.path = str(path)
        self.sb = sb
        self.files = files

    def read(self, off, n):
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), n, off)

    @contextlib.contextmanager
    def damaged(self, writes):
        """Apply ``writes`` [(offset, bytes)], in order; undo them in reverse order afterwards."""
        fd = os.open(self.path, os.O_RDWR)
        saved = []
        try:
            for off, data in writes:
                saved.append((off, os.pread(fd, len(data), off)))
                os.pwrite(fd, data, off)
            yield
        finally:
            for off, data in reversed(saved):
                os.pwrite(fd, data, off)
            os.fsync(fd)
            os.close(fd)


# -- what every damaged image goes through ------------------------------------------

def check_everything(target, image):
    """fsck and the mount path (in-process, read-only) over the damaged image."""
    report = attempt(target, "fsck", fsck.check, image.path)
    if report is not None:
        for line in report.problems + report.notes:
            assert "\n" not in line
    fs = attempt(target, "mount", open_fs, image.path, readonly=True)
    if fs is not None:
        try:
            attempt(target, "use", trio.run, use_mounted, fs, image.files)
        finally:
            fs.close()


async def use_mounted(fs, originals):
    """Walk what loaded like a user would: every file reads back its original bytes or fails (EIO).

    ``originals``: what the base image held; a path that still names a regular file
    must read back as exactly those bytes, or raise a KvfsError. Files the damage made
    up are read (bounded) too, and every directory gets a rename probe (which walks
    the parents of the target directory).
    """
    ns = fs.ns
    async with running(fs, persist=False):
        seen, todo, dirs = {ROOT_INO}, [(ROOT_INO, b"")], []
        while todo and len(seen) < 500:
            ino, prefix = todo.pop()
            dirs.append(ino)
            for name, child, _ in list(ns.list_dir(ino, 0)):
                if ino == ROOT_INO and name == b".kvfs":
                    continue
                path = prefix + b"/" + name
                try:
                    got = ns.lookup(ino, name)
                    inode = ns.attr(got)[0]
                except KvfsError:
                    continue
                if inode.is_dir and got not in seen:
                    seen.add(got)
                    todo.append((got, path))
                elif stat.S_ISLNK(inode.mode):
                    ns.readlink(got)
                elif inode.is_file:
                    await _read_file(ns, got, inode, originals.get(path))
        try:
            probe = ns.make(ROOT_INO, b"fuzz-probe", stat.S_IFDIR | 0o755, 0, 0)
        except KvfsError:
            return
        for ino in dirs[:50]:
            if ino != probe:
                with contextlib.suppress(KvfsError):
                    await ns.rename(ROOT_INO, b"fuzz-probe", ino, b"fuzz-probe")
                    await ns.rename(ino, b"fuzz-probe", ROOT_INO, b"fuzz-probe")


async def _read_file(ns, ino, inode, original):
    size = inode.size
    spans = [(0, min(size, 1 << 20))]
    if size > (1 << 20):
        spans.append((max(0, min(size, 1 << 62) - 65536), 65536))
    try:
        fh, _, _ = ns.open(ino, os.O_RDONLY)
    except KvfsError:
        return
    try:
        for off, n in spans:
            try:
                data = bytes(await ns.read(fh, off, n))
            except KvfsError:
                continue                       # EIO-class: allowed, never wrong bytes
            if original is not None:
                assert size == len(original), f"size {size}, was {len(original)}"
                assert data == original[off:off + n], "a damaged image served wrong bytes"
    finally:
        await ns.release(fh)


def summary():
    lines = [f"fuzz profile {PROFILE}:"]
    for target in sorted(COUNTS):
        counts = COUNTS[target]
        rest = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "cases")
        lines.append(f"  {target}: {counts['cases']} cases ({rest})")
    return "\n".join(lines)
