import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from kvfsmount import KvfsMount  # noqa: E402  (tests/ is on sys.path via rootdir conftest)


def require_fuse():
    """Fail the calling test unless this process may mount FUSE filesystems.

    Called by the fixtures listed in kvfsmount.MOUNT_FIXTURES, and only there.
    """
    problems = []
    if os.geteuid() != 0:
        problems.append(f"running as uid {os.geteuid()}, not root")
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse does not exist")
    if problems:
        pytest.fail("this test mounts a real kvfs through FUSE and needs root with /dev/fuse "
                    f"({'; '.join(problems)}); the layer tests in tests/unit need neither",
                    pytrace=False)


# -- parallel runs (pytest-xdist: tools/run-tests runs two workers) -----------------------

# Most mounted tests wait far more than they compute (FUSE round trips, the
# multi-mount claim, the device): one pytest kept a 2-core VM 30-40% busy, and two
# test files that took 112 s and 101 s one after the other took 116 s side by side.
# Under --dist loadfile each test file runs whole on one worker. Files that share
# something machine-wide are grouped, and a group runs on one worker, file after file:
SHARED_GROUPS = {
    # The kernel's page cache: these drop it for the whole machine (/proc/sys/vm/
    # drop_caches, for cold reads), or count the reads, lookups or getattrs that reach
    # the daemon (which a drop by another test would change: it drops dentries too).
    "page-cache": ("test_bench_netdev.py", "test_bench_tool.py", "test_bypass.py", "test_eviction.py",
                   "test_faults_writers.py", "test_sglang_backend.py",
                   "test_native_reads.py", "test_ops_admin.py", "test_ops_metrics.py", "test_page_cache_coherence.py",
                   "test_page_fill.py",
                   "test_page_writer_opens.py", "test_read_path.py", "test_tier_bench.py",
                   "test_writeback_prefetch.py"),
    # Time: these keep both cores busy for a fixed time (stress, crash rounds, fsx),
    # or bound how long something may take. One at a time, none of them competes
    # with another.
    "timing": ("test_core_acceptance.py", "test_crash_points.py", "test_crash_random.py",
               "test_crash_regressions.py", "test_faults_mounted.py", "test_fsx.py",
               "test_metadata_memory.py", "test_mmp_mounted.py", "test_stress.py"),
}
_GROUP_OF = {f"tests/{name}": group for group, names in SHARED_GROUPS.items() for name in names}


def work_unit(nodeid):
    """What one worker runs whole: the test's shared group, or else its file."""
    file = nodeid.split("::")[0]
    return _GROUP_OF.get(file, file)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with each shared group as one file.

    Not xdist's own loadgroup: it tags node ids with the group (item._nodeid), and
    pytest 9 no longer reads node ids from there, so every test ended up a group of its
    own and the groups above were split across the workers.
    """
    if config.getvalue("dist") != "loadfile":
        return None                             # xdist's own scheduler for other modes
    return file_group_scheduling()(config, log)


def file_group_scheduling():
    """xdist's scope scheduler, its scopes made by :func:`work_unit` (imported late: the
    layer tests run without xdist too)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

    return FileGroupScheduling


def pytest_collection_modifyitems(items):
    """Put the shared groups first: they are the longest, and a long one started last
    would leave the other worker idle at the end (--no-loadscope-reorder keeps this order)."""
    rank = {group: i for i, group in enumerate(SHARED_GROUPS)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))


# -- unexpected error logs fail the test --------------------------------------------------

# Loggers of the code under test, when it runs inside the test process: the kvfs
# package and the command-line tools' own loggers (kvfs.cli.tool names them by prog).
KVFS_LOGGERS = ("kvfs", "mount.kvfs", "mkfs.kvfs", "fsck.kvfs", "kvfs-admin")


class _ErrorRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _unexpected(lines, allowed):
    """The full text of each (text, full) pair whose "logger: message" no allowed pattern matches."""
    return [full for text, full in lines if not any(p.search(text) for p in allowed)]


@pytest.fixture(autouse=True)
def no_unexpected_errors(request):
    """Fail a test whose code under test logged an ERROR or CRITICAL it did not expect.

    In-process layers log through the ``kvfs`` loggers; mounted daemons write to
    the log file KvfsMount gives them. Both are checked when the test is over
    (this fixture is set up first, so it is torn down after the mounts are). Daemon
    logs are read from where the last test stopped, so the mount of a module-scoped
    fixture is checked test by test.
    A test that provokes errors on purpose says which with
    ``@pytest.mark.expect_errors("regex", ...)``: a record is then allowed if one
    of the patterns matches (re.search) its "logger.name: message" text.
    """
    allowed = [re.compile(p) for mark in request.node.iter_markers("expect_errors") for p in mark.args]
    handler = _ErrorRecords()
    loggers = [logging.getLogger(name) for name in KVFS_LOGGERS]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    found = []
    in_process = [(f"{r.name}: {r.getMessage()}", f"{r.levelname} {r.name}: {r.getMessage()}")
                  for r in handler.records]
    found += [f"in-process: {line}" for line in _unexpected(in_process, allowed)]
    for fs in KvfsMount.made:
        found += [f"daemon of {fs.device}: {full}" for full in _unexpected(fs.new_error_records(), allowed)]
    KvfsMount.made[:] = [fs for fs in KvfsMount.made if fs.mounted]     # a later mount() re-adds one
    if found:
        hint = ("" if allowed else
                "\n(if the test provokes these on purpose, mark it @pytest.mark.expect_errors(\"regex\"))")
        pytest.fail("unexpected errors were logged:\n  " + "\n  ".join(found) + hint, pytrace=False)


# -- mounting fixtures ----------------------------------------------------------------------

@pytest.fixture
def kvfs(tmp_path):
    """A freshly made 4 GiB sparse kvfs store, mounted; fsck must be clean at the end."""
    require_fuse()
    fs = KvfsMount(tmp_path)
    fs.mkfs()
    fs.mount()
    yield fs
    fs.teardown()


@pytest.fixture
def kvfs_factory(tmp_path):
    """Build a KvfsMount with custom size/options; the test mkfs's and mounts it."""
    require_fuse()
    made = []

    def make(name="fs", **kw):
        root = tmp_path / name
        root.mkdir()
        fs = KvfsMount(root, **kw)
        made.append(fs)
        return fs

    yield make
    for fs in made:
        fs.teardown()


@pytest.fixture
def shared_kvfs(tmp_path):
    """Mount factory: an allow_other kvfs whose root (mode 1777) every uid can reach."""
    require_fuse()
    made = []

    def make(*options, size="4G"):
        root = Path(tempfile.mkdtemp(prefix="kvfs-shared-", dir="/tmp"))
        os.chmod(root, 0o755)
        # The log goes to tmp_path: root is removed before the error-log check reads it.
        fs = KvfsMount(root, size=size, mount_options=["allow_other", *options],
                       log=tmp_path / f"kvfs-shared-{len(made)}.log")
        made.append((fs, root))
        fs.mkfs()
        fs.mount()
        os.chmod(fs.mnt, 0o1777)
        return fs

    yield make
    for fs, root in made:
        try:
            fs.teardown()
        finally:
            if not fs.mounted:
                shutil.rmtree(root, ignore_errors=True)
