"""Long admin work shows progress on a terminal: kvfs-admin flush of a large dirty pool."""
import os
import subprocess
import sys

from kvfsmount import slow_writes


def run_on_a_terminal(argv, timeout=120):
    """Run ``argv`` with a pseudo-terminal as stdout and stderr; returns (status, what it printed)."""
    leader, follower = os.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:                 # EIO: the other side has closed
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return proc.wait(timeout), out.decode(errors="replace")


def test_flush_shows_progress_on_a_terminal_and_nothing_in_a_pipe(kvfs_factory):
    fs = kvfs_factory(faults=slow_writes(0.25), mount_options=["commit_interval=3600"])
    fs.mkfs()
    fs.mount()
    with open(fs.mnt / "big", "wb") as f:
        f.write(os.urandom(24 << 20))            # 24 blocks, each 0.25 s to the device (8 flushers)
    status, shown = run_on_a_terminal([sys.executable, "-m", "kvfs.cli.admin", "flush", str(fs.mnt)])
    assert status == 0, shown
    assert "flushing: " in shown and "MiB/s" in shown, shown
    assert fs.stats()["dirty_bytes"] == 0
    with open(fs.mnt / "big2", "wb") as f:
        f.write(os.urandom(8 << 20))
    proc = fs.admin("flush", fs.mnt)              # a pipe: no progress line
    assert proc.stdout == "" and proc.stderr == ""
