"""kvfs-admin as an operator uses it: stats, top, control commands, permissions, --help.

Everything runs the real command against a real mount.
"""
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfsmount import run_tool, write_new

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534
MiB = 1 << 20


@pytest.fixture
def small(kvfs_factory):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    fs.mount()
    return fs


def admin(*args, check=True, timeout=120):
    return run_tool("admin", *args, check=check, timeout=timeout)


def test_stats_is_grouped_short_and_exact(small):
    fs = small
    chunk = os.urandom(4 * MiB)
    for rank in range(8):
        (fs.mnt / f"tp{rank}.bin").write_bytes(chunk)
    fs.flush()
    out = admin("stats", fs.mnt).stdout
    lines = out.splitlines()
    assert len(lines) <= 22, out
    heads = [line for line in lines if not line.startswith(" ")]
    assert [h.split()[0] for h in heads] == ["mount", "device", "mmp", "space", "files", "cache", "I/O",
                                             "eviction", "errors"], out
    text = "\n".join(lines)
    assert f"device      {fs.device}  (file, " in text
    assert "mmp         owner, sequence " in text and "s ago (every 0.25 s)" in text
    assert "  used      4.0 MiB" in text                      # one copy of the 8 files
    assert "  logical   32.0 MiB  (dedup ratio 8.00)" in text
    assert "files       8  (1 directories, 4 unique blocks)" in text
    assert "hit rate" in text and "  device    read " in text and "  now       device read " in text
    assert "errors      corrupt block reads (served as EIO): 0" in text
    assert "up 0m" in lines[0] and f"daemon pid {fs.pid}" in lines[0]


def test_stats_all_lists_every_counter_and_json_is_the_full_dict(small):
    stats = json.loads(admin("stats", "--json", small.mnt).stdout)
    assert {"capacity_bytes", "dedup_ratio", "device_kind", "recent", "uptime_s"} <= set(stats)
    listed = {line.split()[0] for line in admin("stats", "--all", small.mnt).stdout.splitlines()}
    for key, value in stats.items():
        if isinstance(value, dict) and key != "device_read_latency_seconds":
            assert {f"{key}.{sub}" for sub in value} <= listed
        else:
            assert key in listed, key


def test_stats_watch_reports_the_bandwidth_of_each_interval(small):
    fs = small
    # The test reads reports until the burst is in them, then presses Ctrl-C; --count bounds
    # how long it can wait for them.
    proc = subprocess.Popen([sys.executable, "-m", "kvfs.cli.admin", "stats", "--watch", "1", "--count", "90",
                             "--json", str(fs.mnt)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    reports = []
    try:
        def next_report():
            line = proc.stdout.readline()
            assert line, f"stats --watch ended before the burst was reported: {reports}"
            reports.append(json.loads(line))

        next_report()                                       # watching: the burst comes after this sample
        (fs.mnt / "burst").write_bytes(os.urandom(24 * MiB))
        burst = 24 * MiB

        def written():
            return sum(r["interval"]["write"] * r["interval"]["window_s"] for r in reports[1:])
        while written() < burst * 0.99:
            next_report()
        proc.send_signal(signal.SIGINT)                     # Ctrl-C ends --watch quietly
        proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    # Each report's rate is its interval's bytes over its window, and the intervals add up.
    assert written() == pytest.approx(burst, rel=0.01)
    for before, r in zip(reports, reports[1:]):
        assert r["interval"]["write"] * r["interval"]["window_s"] == pytest.approx(
            r["bytes_written"] - before["bytes_written"], rel=1e-6, abs=1)
    assert all(r["interval"]["window_s"] >= 1 for r in reports), reports     # never shorter than --watch


def test_top_prints_rows_when_not_a_terminal(small):
    fs = small

    def load():
        for i in range(6):
            (fs.mnt / f"f{i}").write_bytes(os.urandom(2 * MiB))
            time.sleep(0.1)
    worker = threading.Thread(target=load)
    worker.start()
    out = admin("top", "--interval", "0.5", "--count", "3", fs.mnt).stdout
    worker.join()
    lines = out.splitlines()
    assert len(lines) == 4 and lines[0].split()[:3] == ["time", "read/s", "write/s"]
    assert "\x1b[" not in out
    assert any("MiB/s" in row for row in lines[1:]), out     # the writes show as a rate
    rates = [json.loads(line) for line in admin("top", "--json", "--interval", "0.3", "--count", "2",
                                                fs.mnt).stdout.splitlines()]
    assert len(rates) == 2 and {"read", "write", "read_requests", "prefetch_inflight",
                                "flush_backlog_bytes", "hit_ratio"} <= set(rates[0])


def test_top_redraws_in_place_on_a_terminal(small):
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "kvfs.cli.admin", "top", "--interval", "0.3",
                                  "--count", "2", str(small.mnt)])
    out = b""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    text = out.decode()
    assert text.count("\x1b[H\x1b[2J") == 2                 # two full redraws
    assert f"kvfs top  {small.mnt}" in text and "Ctrl-C quits" in text
    assert "dev rd/s" in text and "prefetch" in text and "backlog" in text


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (tools/setup --test installs it)")
def test_top_in_tmux_refreshes_and_quits_on_ctrl_c(small, tmp_path):
    session = f"kvfs-top-{os.getpid()}"
    cmd = f"cd {REPO} && {sys.executable} -m kvfs.cli.admin top --interval 0.3 {small.mnt}; echo EXITED=$?; sleep 60"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "30", cmd], check=True)
    try:
        def screen():
            return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                  text=True).stdout
        deadline = time.monotonic() + 30
        while "kvfs top" not in screen() and time.monotonic() < deadline:
            time.sleep(0.2)
        (small.mnt / "x").write_bytes(os.urandom(8 * MiB))

        def rows(text):                                 # rows of rates
            return [line for line in text.splitlines() if line[:2].isdigit()]
        deadline = time.monotonic() + 60
        while len(rows(screen())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        shown = screen()
        assert f"kvfs top  {small.mnt}" in shown and "dev wr/s" in shown, shown
        assert len(rows(shown)) >= 2, shown
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        deadline = time.monotonic() + 10
        while "EXITED=" not in screen() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "EXITED=0" in screen()
        assert "Traceback" not in screen()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_control_commands_answer_json(small):
    for command in ("flush", "drop-caches", "count-frozen", "checkpoint"):
        result = json.loads(admin(command, "--json", small.mnt).stdout)
        assert result["ok"] is True and result["command"] == command
    result = json.loads(admin("umount", "--json", small.mnt).stdout)
    assert result["ok"] and not small.mounted


def as_nobody(*args):
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           SYSTEM_PYTHON, "-m", "kvfs.cli.admin", *map(str, args)],
                          capture_output=True, text=True, timeout=60, cwd="/", env={"PYTHONPATH": str(REPO)})


def test_state_changing_commands_refuse_other_users_in_one_line(shared_kvfs):
    fs = shared_kvfs()
    (fs.mnt / "keep").write_bytes(b"k" * 4096)
    for command in ("flush", "drop-caches", "count-frozen", "checkpoint", "umount"):
        proc = as_nobody(command, fs.mnt)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 1 and proc.stdout == "" and len(lines) == 1, proc.stderr
        assert lines[0] == (f"kvfs-admin: {command} {fs.mnt}: permission denied: changing a mounted kvfs "
                            f"needs root or the mount's owner")
    assert fs.mounted and (fs.mnt / "keep").read_bytes() == b"k" * 4096
    proc = as_nobody("stats", fs.mnt)
    assert proc.returncode == 1 and "readable only by root and the mount's owner" in proc.stderr


def test_every_command_has_help():
    commands = [["stats"], ["top"], ["metrics"], ["flush"], ["drop-caches"], ["count-frozen"], ["checkpoint"], ["umount"],
                ["nvmeof"], ["nvmeof", "status"], ["nvmeof", "attach"], ["nvmeof", "command"]]
    assert admin("--help").stdout.startswith("usage: kvfs-admin")
    for cmd in commands:
        proc = admin(*cmd, "--help")
        assert proc.stdout.startswith(f"usage: kvfs-admin {' '.join(cmd)}"), proc.stdout
        assert "--json" in proc.stdout or cmd == ["nvmeof"], cmd


@pytest.mark.parametrize("args, message", [
    (["stats", "/proc"], "/proc is not a mounted kvfs"),
    (["stats", "/nonexistent/kvfs"], "/nonexistent/kvfs: no such directory"),
    (["top", "/proc"], "/proc is not a mounted kvfs"),
    (["metrics", "/proc"], "/proc is not a mounted kvfs"),
    (["flush", "/proc"], "/proc is not a mounted kvfs"),
    (["stats", "--watch", "0", "/proc"], "must be a positive number of seconds"),
    (["top", "--count", "-1", "/proc"], "must be positive"),
])
def test_bad_input_gets_one_line(args, message):
    proc = admin(*args, check=False)
    assert proc.returncode != 0 and proc.stdout == ""
    first = proc.stderr.splitlines()[0]
    assert message in first, proc.stderr
    assert len(proc.stderr.splitlines()) <= 2            # usage errors add "(see kvfs-admin --help)"


def test_a_slow_command_does_not_hold_up_lookups_and_creates_in_the_root(kvfs_factory):
    """kvfs-admin sends its commands to /.kvfs. The kernel holds the lock of the inode a
    setxattr names until the daemon answers, and a flush to a slow device takes seconds:
    sent to the root, it held up every lookup and create there, where engines keep their
    chunk files (the metadata benchmark's probe waited out whole checkpoints)."""
    fs = kvfs_factory(faults=[{"op": "write", "effect": "delay", "seconds": 4.0}])
    fs.mkfs()
    fs.mount()
    write_new(fs.mnt / "chunk", os.urandom(MiB))         # its write-back takes 4 s
    flusher = threading.Thread(target=admin, args=("flush", fs.mnt))
    flusher.start()
    try:
        deadline = time.monotonic() + 30
        while fs.stats()["control_commands_running"] == 0:   # stats come from a getxattr: no lock
            assert time.monotonic() < deadline, "the flush command never reached the daemon"
            time.sleep(0.05)
        with pytest.raises(FileNotFoundError):
            os.stat(fs.mnt / "not-cached-yet")               # a lookup in the root
        write_new(fs.mnt / "new-chunk", b"n" * 4096)         # a create in the root
        # Both finished while the flush command was still running.
        assert fs.stats()["control_commands_running"] == 1
        assert flusher.is_alive()
    finally:
        flusher.join(60)
    assert not flusher.is_alive()
    fs.set_faults([])                   # the rest need no slow device: every write took 4 s
    assert fs.stats()["control_commands_running"] == 0 and fs.stats()["dirty_bytes"] == 0
    assert (fs.mnt / "new-chunk").read_bytes() == b"n" * 4096
    fs.umount()
    fs.assert_fsck_clean()
