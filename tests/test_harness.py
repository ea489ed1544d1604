"""The test harness itself: unexpected error logs fail tests.

None of these mount anything, so they run without root.
"""
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from kvfsmount import log_records

TESTS = Path(__file__).parent
REPO = TESTS.parent


# -- error logs ------------------------------------------------------------------------------

def test_daemon_log_lines_are_parsed_from_the_real_formatter(tmp_path):
    """The parser reads what kvfs.cli.setup_logging writes, tracebacks included."""
    log = tmp_path / "kvfs.log"
    code = textwrap.dedent(f"""
        import logging
        from kvfs.cli import setup_logging
        setup_logging(path={str(log)!r}, tag="kvfs[/some/mnt]")
        logging.getLogger("kvfs.daemon").info("mounted")
        try:
            1 / 0
        except ZeroDivisionError:
            logging.getLogger("kvfs.blockcache").exception("flush failed: EIO")
        logging.getLogger("kvfs.daemon").critical("giving up")
    """)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    records = log_records(log.read_text())
    assert [(level, text) for level, text, _ in records] == [
        ("INFO", "kvfs.daemon: mounted"),
        ("ERROR", "kvfs.blockcache: flush failed: EIO"),
        ("CRITICAL", "kvfs.daemon: giving up")]
    assert "ZeroDivisionError" in records[1][2]


CASES = '''
import logging
import subprocess
import sys


from kvfsmount import KvfsMount

def daemon_logs(tmp_path, message):
    """A process logging through the real setup_logging to the log of a KvfsMount."""
    fs = KvfsMount(tmp_path)
    code = ("import logging; from kvfs.cli import setup_logging; "
            f"setup_logging(path={str(fs.log)!r}, tag='kvfs[x]'); "
            f"logging.getLogger('kvfs.daemon').error({message!r})")
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
    logging.getLogger("kvfs.daemon").warning("just a warning")
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
    assert "kvfs.daemon: final checkpoint failed" in proc.stdout
