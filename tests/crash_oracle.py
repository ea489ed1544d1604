"""What a file may hold after a crash: an oracle of every version a test wrote, and its checks.

Used by tests/test_crash_points.py and tests/test_crash_random.py. A test tells
the oracle what it is *about* to do (before the syscall: a daemon that dies in
the middle may or may not have made the change durable), and what a completed
fsync made durable. After the crash and a remount, every name must show one of
the states the oracle allows:

* ``history[name]`` lists the states the name went through, in order: file
  contents (bytes) or ABSENT (None): never created, unlinked, renamed away;
* ``floor[name]`` is the index of the newest state known durable. A completed
  fsync of a file makes its content durable; any completed fsync (or directory
  fsync) also makes every earlier unlink and rename of the same writer durable,
  because it commits every record appended before it (a rename seals its
  source's content first, so the content it moves is durable with it);
* allowed after the crash: ``history[name][floor:]``.

A name showing a content the oracle never saw for it is **torn**; a name showing
an allowed-but-older state, or ABSENT where a durable content should be, is
**lost**. Both must be 0.
"""
import errno
import os

ABSENT = None
# errno of a syscall on a mount whose daemon died (the kernel aborted the FUSE connection)
DEAD_MOUNT = {errno.ENOTCONN, errno.ECONNABORTED}

WRITE, REMOVE, RENAME_IN, RENAME_OUT, MAYBE_GONE = "write", "remove", "rename-in", "rename-out", "maybe-gone"


class Oracle:
    def __init__(self):
        self.history = {}           # name -> [(state, kind)]
        self.floor = {}             # name -> index into history[name]

    def _states(self, name):
        return self.history.setdefault(name, [(ABSENT, "initial")])

    def current(self, name):
        return self._states(name)[-1][0]

    def names(self):
        return set(self.history)

    # -- intents: told before the syscall --------------------------------------
    def will_write(self, name, data):
        """``name`` is about to be (re)written with ``data`` and closed (or fsynced)."""
        self._states(name).append((bytes(data), WRITE))

    def will_remove(self, name):
        self._states(name).append((ABSENT, REMOVE))

    def will_rename(self, src, dst):
        content = self.current(src)
        self._states(dst).append((content, RENAME_IN))
        self._states(src).append((ABSENT, RENAME_OUT))

    def may_vanish(self, name):
        """An eviction may or may not take ``name``: afterwards it is either gone or unchanged."""
        content = self.current(name)
        self._states(name).append((ABSENT, MAYBE_GONE))
        self._states(name).append((content, WRITE))

    # -- what completed ----------------------------------------------------------
    def fsynced(self, name):
        """An fsync of ``name`` returned: its current content, and every earlier namespace change, are durable."""
        self.committed()
        self.floor[name] = len(self._states(name)) - 1

    def committed(self):
        """A commit returned (fsync of anything, fsync of a directory, kvfs-admin flush/checkpoint)."""
        for name, states in self.history.items():
            for i in range(len(states) - 1, self.floor.get(name, 0), -1):
                if states[i][1] not in (WRITE, MAYBE_GONE):
                    self.floor[name] = i
                    break

    def flushed_all(self):
        """kvfs-admin flush or checkpoint returned with no file open: every state so far is durable."""
        for name, states in self.history.items():
            self.floor[name] = len(states) - 1

    def allowed(self, name):
        states = self._states(name)
        return [s for s, _ in states[self.floor.get(name, 0):]]

    def restart(self, actual):
        """After a verified remount: what is there now is the durable starting point."""
        self.history = {name: [(content, "initial")] for name, content in actual.items()}
        self.floor = {}


def read_tree(root):
    """{relative name: bytes} of every regular file under ``root`` (not /.kvfs)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if os.path.samefile(dirpath, root) and ".kvfs" in dirnames:
            dirnames.remove(".kvfs")
        for fn in filenames:
            path = os.path.join(dirpath, fn)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def judge(oracle, actual):
    """(torn, lost): lists of one-line descriptions of names that break the oracle."""
    torn, lost = [], []
    for name in sorted(oracle.names() | set(actual)):
        got = actual.get(name, ABSENT)
        allowed = oracle.allowed(name) if name in oracle.history else [ABSENT]
        if any(got == a for a in allowed):
            continue
        seen = [s for s, _ in oracle.history.get(name, [])]
        what = "absent" if got is ABSENT else f"{len(got)} bytes"
        if got is not ABSENT and not any(got == s for s in seen):
            torn.append(f"{name}: {what}, a content never written to it")
        else:
            lost.append(f"{name}: {what}, older than its durable state "
                        f"({len(allowed)} state(s) allowed: {[_describe(a) for a in allowed]})")
    return torn, lost


def _describe(state):
    return "absent" if state is ABSENT else f"{len(state)} bytes"


def expected_blocks(contents, block_size):
    """(unique blocks, allocated bytes) that storing ``contents`` must take: a block is stored
    at its real length rounded up to 4 KiB, once per distinct content; all-zero blocks are holes."""
    blocks = set()
    for data in contents:
        for off in range(0, len(data), block_size):
            piece = data[off:off + block_size]
            if piece.count(0) != len(piece):
                blocks.add(piece)
    return len(blocks), sum(-(-len(b) // 4096) * 4096 for b in blocks)


def check_after_remount(fs, oracle, block_size):
    """The checks after a crash and a clean remount: (torn, lost, actual contents).

    Also asserts that the daemon's block accounting matches the surviving files exactly
    (no leaked or double-counted block)."""
    actual = read_tree(fs.mnt)
    torn, lost = judge(oracle, actual)
    stats = fs.stats()
    unique, used = expected_blocks(actual.values(), block_size)
    assert (stats["unique_blocks"], stats["used_bytes"]) == (unique, used), (
        f"block accounting after remount: stats say {stats['unique_blocks']} blocks / "
        f"{stats['used_bytes']} bytes, the surviving files need {unique} / {used}")
    return torn, lost, actual


def dead(exc):
    """True if ``exc`` is what a syscall gets once the daemon has died."""
    return isinstance(exc, OSError) and exc.errno in DEAD_MOUNT


class Workload:
    """File operations on a mount that keep the oracle told (intent first, durability after)."""

    def __init__(self, mnt, oracle):
        self.mnt, self.oracle = mnt, oracle
        self.trace = []             # what it did, for a failure message

    def note(self, text):
        self.trace.append(text)
        del self.trace[:-50]

    def path(self, name):
        return os.path.join(self.mnt, name)

    def put(self, name, data, *, fsync=False):
        """Create or O_TRUNC-rewrite ``name`` with ``data`` in one write, then close (fsync first if asked)."""
        self.oracle.will_write(name, data)
        self.note(f"put {name} {len(data)} bytes{' fsync' if fsync else ''}")
        fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
                self.oracle.fsynced(name)
        finally:
            os.close(fd)

    def remove(self, name):
        self.oracle.will_remove(name)
        self.note(f"unlink {name}")
        os.unlink(self.path(name))

    def rename(self, src, dst):
        self.oracle.will_rename(src, dst)
        self.note(f"rename {src} {dst}")
        os.rename(self.path(src), self.path(dst))

    def sync_dir(self):
        """fsync the root directory: one commit of every record appended so far."""
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.oracle.committed()
