"""Support for the benchmark tools' tests: run a kvfs-bench mode and press Ctrl-C in the middle."""
import signal
import subprocess
import sys
import time

import pytest


def interrupt_once_running(args, started, in_use):
    """Start ``kvfs-bench ARGS``, wait for a progress line containing any of ``started``, check
    ``in_use()`` (what it built is there), press Ctrl-C, and return its stderr once it has
    exited with SIGINT's status and said it was interrupted."""
    # Ctrl-C's default action for the bench, whatever this test inherited: a
    # shell without job control starts background jobs (`nohup ... &`) with
    # SIGINT ignored, exec keeps it ignored, and Python then installs no
    # KeyboardInterrupt handler, so the bench ran on to its end.
    proc = subprocess.Popen([sys.executable, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:  # wait until the filesystems are up and in use
            if any(marker in line for marker in started):
                break
        else:
            pytest.fail(f"{args[1]} never started its first run")
        assert in_use(), "expected what the run builds (mounts, loop devices) while it runs"
        time.sleep(0.3)                             # into the middle of the run's work
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "interrupted" in err
    return err
