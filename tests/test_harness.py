"""The test harness itself: error logs fail tests, helper-thread failures reach them.

None of these mount anything, so they run without root.
"""
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvfsmount import log_records
from threads import Workers, run_in_threads

TESTS = Path(__file__).parent
REPO = TESTS.parent


# -- helper threads -----------------------------------------------------------------------

def test_a_worker_exception_is_raised_in_the_test():
    def reader(stop):
        assert False, "short read: 10 of 20"

    with pytest.raises(AssertionError, match="short read") as err:
        with Workers(timeout=10) as workers:
            workers.start(reader, workers.stop, name="reader")
            while not workers.failed:
                time.sleep(0.01)
    assert any("helper thread reader" in note for note in err.value.__notes__)


def test_a_worker_that_does_not_stop_fails_the_test():
    release = threading.Event()
    try:
        with pytest.raises(AssertionError, match="still running"):
            with Workers(timeout=0.2) as workers:
                workers.start(release.wait, name="stuck")
    finally:
        release.set()


def test_the_tests_own_failure_wins_and_names_the_workers():
    def worker():
        raise OSError(5, "Input/output error")

    with pytest.raises(KeyError) as err:
        with Workers(timeout=10) as workers:
            workers.start(worker)
            while not workers.failed:
                time.sleep(0.01)
            raise KeyError("the test's own")
    assert any("Input/output error" in note for note in err.value.__notes__)


def test_run_in_threads_runs_concurrently_and_keeps_order():
    barrier = threading.Barrier(4, timeout=10)         # only passes if all four run at once

    def work(i):
        barrier.wait()
        return i * i

    assert run_in_threads(work, range(4)) == [0, 1, 4, 9]
    with pytest.raises(ZeroDivisionError):
        run_in_threads(lambda i: 1 // i, range(3))


# -- error logs ------------------------------------------------------------------------------

def test_daemon_log_lines_are_parsed_from_the_real_formatter(tmp_path):
    """The parser reads what kvfs.cli.setup_logging writes, tracebacks included."""
    log = tmp_path / "kvfs.log"
    code = textwrap.dedent(f"""
        import logging
        from kvfs.cli import setup_logging
        setup_logging(path={str(log)!r}, tag="kvfs[/some/mnt]")
        logging.getLogger("kvfs.server.daemon").info("mounted")
        try:
            1 / 0
        except ZeroDivisionError:
            logging.getLogger("kvfs.blockcache").exception("flush failed: EIO")
        logging.getLogger("kvfs.server.daemon").critical("giving up")
    """)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    records = log_records(log.read_text())
    assert [(level, text) for level, text, _ in records] == [
        ("INFO", "kvfs.server.daemon: mounted"),
        ("ERROR", "kvfs.blockcache: flush failed: EIO"),
        ("CRITICAL", "kvfs.server.daemon: giving up")]
    assert "ZeroDivisionError" in records[1][2]


CASES = '''
import logging
import subprocess
import sys

import pytest

from kvfsmount import KvfsMount

def daemon_logs(tmp_path, message):
    """A process logging through the real setup_logging to the log of a KvfsMount."""
    fs = KvfsMount(tmp_path)
    code = ("import logging; from kvfs.cli import setup_logging; "
            f"setup_logging(path={str(fs.log)!r}, tag='kvfs[x]'); "
            f"logging.getLogger('kvfs.server.daemon').error({message!r})")
    subprocess.run([sys.executable, "-c", code], check=True)

def test_in_process_error():
    logging.getLogger("kvfs.blockindex").error("block abc fails its checksum")

@pytest.mark.expect_errors(r"kvfs\\.blockindex: block \\w+ fails its checksum")
def test_in_process_error_expected():
    logging.getLogger("kvfs.blockindex").error("block abc fails its checksum")

@pytest.mark.expect_errors("fails its checksum")
def test_in_process_error_other_than_expected():
    logging.getLogger("kvfs.namespace").error("inode 3 names missing blocks")

def test_in_process_warning_and_foreign_error():
    logging.getLogger("kvfs.server.daemon").warning("just a warning")
    logging.getLogger("somebody.else").error("not kvfs")

def test_daemon_error(tmp_path):
    daemon_logs(tmp_path, "final checkpoint failed")

@pytest.mark.expect_errors("final checkpoint failed")
def test_daemon_error_expected(tmp_path):
    daemon_logs(tmp_path, "final checkpoint failed")
'''


def test_unexpected_error_logs_fail_the_test(tmp_path):
    """Run a small suite under the real tests/conftest.py and read the outcome of each test."""
    for name in ("conftest.py", "kvfsmount.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    expect_errors(*patterns): allowed error logs\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-rA", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
                           str(tmp_path / "test_cases.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    outcome = {}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "ERROR", "FAILED") and "::" in rest:
            outcome[rest.split("::")[1].split(" ")[0]] = word
    assert outcome == {
        "test_in_process_error": "ERROR",
        "test_in_process_error_expected": "PASSED",
        "test_in_process_error_other_than_expected": "ERROR",
        "test_in_process_warning_and_foreign_error": "PASSED",
        "test_daemon_error": "ERROR",
        "test_daemon_error_expected": "PASSED",
    }, proc.stdout + proc.stderr
    assert "in-process: ERROR kvfs.namespace: inode 3 names missing blocks" in proc.stdout
    assert "kvfs.server.daemon: final checkpoint failed" in proc.stdout


def test_files_that_drop_the_page_cache_or_count_kernel_reads_share_one_worker(request):
    """tests/conftest.py runs the files of SHARED_GROUPS["page-cache"] one after another on
    one worker: a file that drops the kernel's page cache for the whole machine must not
    run beside one that counts the reads reaching its daemon. A file that does either
    and is missing from the group fails here, not as a rare flake of another file."""
    from conftest import SHARED_GROUPS
    # drop_caches=3 drops dentries and inodes too, so counts of the LOOKUP and GETATTR
    # requests that reach a daemon are disturbed by it as much as counts of READs.
    marks = ("drop_kernel_cache", "/proc/sys/vm/drop_caches", "kernel_read_requests",
             "kernel_lookup_requests", "kernel_getattr_requests")
    here = Path(__file__).parent
    needing = {p.name for p in here.glob("test_*.py")
               if any(m in p.read_text() for m in marks) and p.name != Path(__file__).name}
    assert "test_page_fill.py" in needing, needing          # the scan finds what it looks for
    missing = sorted(needing - set(SHARED_GROUPS["page-cache"]))
    assert not missing, f"add these to SHARED_GROUPS['page-cache'] in tests/conftest.py: {missing}"
    # And the scheduler tools/run-tests gets hands each group out whole.
    from conftest import file_group_scheduling
    scheduler = object.__new__(file_group_scheduling())      # _split_scope needs no state
    units = {scheduler._split_scope(f"tests/{name}::test_x[a-b]") for name in sorted(needing)}
    assert units == {"page-cache"}, units
    assert scheduler._split_scope("tests/test_harness.py::test_x") == "tests/test_harness.py"
