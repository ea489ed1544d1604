"""The mount(8) helper (mount/mount.kvfs) and the systemd unit (systemd/kvfs@.service).

``mount -t kvfs DEVICE DIR -o OPTS`` makes mount(8) run
``/sbin/mount.kvfs DEVICE DIR -o OPTS``: options after the positionals. Installing
the helper into /sbin for a test would touch the host, so these tests call the
helper directly in that form. ``KVFS_PYTHON`` points the helper at the Python
running the tests (the helper otherwise looks for ``<repo>/.venv``).
"""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvfsmount import TEST_MMP_INTERVAL

REPO = Path(__file__).resolve().parent.parent
HELPER = REPO / "mount" / "mount.kvfs"
UNIT = REPO / "systemd" / "kvfs@.service"


def helper_env(**extra):
    env = dict(os.environ, KVFS_PYTHON=sys.executable)
    env.update(extra)
    return env


def run_helper(*args, env=None, timeout=120, helper=HELPER, cwd="/"):
    # cwd "/": kvfs must be found through the helper, not through the current directory.
    return subprocess.run([str(helper), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env if env is not None else helper_env(), cwd=cwd)


def test_helper_is_executable_shell_script():
    assert os.access(HELPER, os.X_OK)
    assert HELPER.read_text().startswith("#!/bin/sh\n")


def test_help_prints_usage():
    proc = run_helper("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: mount.kvfs")
    assert "MOUNTPOINT" in proc.stdout


def fake_repo(tmp_path, python_name):
    """A copy of the repo layout whose Python is a wrapper that leaves a marker."""
    repo = tmp_path / "repo"
    (repo / "mount").mkdir(parents=True)
    shutil.copy2(HELPER, repo / "mount" / "mount.kvfs")
    (repo / "kvfs").symlink_to(REPO / "kvfs")
    marker = tmp_path / "python-used"
    wrapper = tmp_path / "bin" / python_name
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\necho "$0" >> {marker}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return repo, wrapper, marker


def test_venv_found_through_symlink(tmp_path):
    """Installed as a symlink (/usr/sbin/mount.kvfs -> <repo>/mount/mount.kvfs) it uses <repo>/.venv."""
    repo, wrapper, marker = fake_repo(tmp_path, "python")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "python").symlink_to(wrapper)
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "mount.kvfs").symlink_to(repo / "mount" / "mount.kvfs")
    env = {k: v for k, v in os.environ.items() if k not in ("KVFS_PYTHON", "PYTHONPATH")}
    proc = run_helper("--help", env=env, helper=sbin / "mount.kvfs")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: mount.kvfs")
    assert marker.read_text().strip() == str(repo / ".venv" / "bin" / "python")


def test_falls_back_to_python3_that_imports_kvfs(tmp_path):
    repo, wrapper, marker = fake_repo(tmp_path, "python3")
    env = {k: v for k, v in os.environ.items() if k not in ("KVFS_PYTHON", "PYTHONPATH")}
    env["PATH"] = f"{wrapper.parent}:/usr/bin:/bin"
    proc = run_helper("--help", env=env, helper=repo / "mount" / "mount.kvfs")
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text().split() == [str(wrapper)] * 2      # the import probe, then the run


def test_no_python_is_a_clear_error(tmp_path):
    repo = tmp_path / "repo"
    (repo / "mount").mkdir(parents=True)
    shutil.copy2(HELPER, repo / "mount" / "mount.kvfs")     # no kvfs/, no .venv
    env = {"PATH": str(tmp_path / "empty-bin")}               # no python3 on PATH
    proc = subprocess.run([str(repo / "mount" / "mount.kvfs"), "--help"], capture_output=True,
                          text=True, env=env, timeout=60)
    if proc.returncode == 0:
        pytest.skip("a system python3 with kvfs installed exists on this host")
    assert proc.returncode == 1
    assert "no Python that can import kvfs" in proc.stderr


def test_mount_in_mount8_calling_form(kvfs_factory):
    """DEVICE DIR -o OPTS (options last, as mount(8) passes them) mounts a real kvfs."""
    fs = kvfs_factory("helper", size="1G")
    fs.mkfs()
    log = fs.root / "kvfs.log"
    opts = f"rw,noatime,_netdev,x-systemd.automount,cache_size=256M,log={log},mmp_interval={TEST_MMP_INTERVAL}"
    proc = run_helper(fs.device, fs.mnt, "-o", opts)
    assert proc.returncode == 0, f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert fs.mounted
    stats = fs.stats()
    fs.pid = stats["pid"]
    assert stats["device"] == str(fs.device)
    assert stats["cache_size"] == 256 << 20
    data = os.urandom(3 << 20)
    (fs.mnt / "chunk.pt").write_bytes(data)
    fs.umount()
    fs.assert_fsck_clean()
    # Again, with mount(8)'s -n flag and the options first: the data came back durable.
    proc = run_helper("-n", "-o", f"defaults,log={log},mmp_interval={TEST_MMP_INTERVAL}", fs.device, fs.mnt)
    assert proc.returncode == 0, proc.stderr
    fs.pid = fs.stats()["pid"]
    assert (fs.mnt / "chunk.pt").read_bytes() == data
    # teardown: umount through kvfs-admin, then a clean fsck


def test_mount_errors_exit_nonzero(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run_helper(tmp_path / "missing.kvfs", mnt, "-o", "defaults")
    assert proc.returncode != 0
    assert "missing.kvfs" in proc.stderr
    assert not os.path.ismount(mnt)
    proc = run_helper(tmp_path / "missing.kvfs", mnt, "-o", "no_such_option")
    assert proc.returncode != 0
    assert "no_such_option" in proc.stderr


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart's binary exists: point it at the helper in this checkout
    # (tools/setup installs that as /usr/sbin/mount.kvfs).
    text = UNIT.read_text()
    assert "ExecStart=/usr/sbin/mount.kvfs -f " in text
    (tmp_path / "kvfs@.service").write_text(text.replace("/usr/sbin/mount.kvfs", str(HELPER)))
    instance = tmp_path / "kvfs@mnt-kvfs.service"
    instance.symlink_to("kvfs@.service")
    proc = subprocess.run([analyze, "verify", str(instance)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "kvfs" in line]
    assert proc.returncode == 0 and not ours, "\n".join(ours) or proc.stderr


def test_foreground_mount_stops_cleanly_on_sigterm(kvfs_factory, tmp_path):
    """What kvfs@.service does: mount.kvfs -f DEVICE DIR -o OPTS, stopped with SIGTERM."""
    fs = kvfs_factory("unit", size="1G")
    fs.mkfs()
    # Type=notify: the unit counts as started when READY=1 arrives on $NOTIFY_SOCKET.
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(150)
    proc = subprocess.Popen([str(HELPER), "-f", str(fs.device), str(fs.mnt), "-o", f"defaults,mmp_interval={TEST_MMP_INTERVAL}"],
                            env=helper_env(NOTIFY_SOCKET=str(tmp_path / "notify")), cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "READY=1" in notify.recv(4096).decode().splitlines()
        assert fs.mounted
        data = os.urandom(5 << 20)
        (fs.mnt / "chunk.pt").write_bytes(data)         # dirty in RAM: SIGTERM must flush it
        proc.terminate()
        _, err = proc.communicate(timeout=300)
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert not fs.mounted
    fs.assert_fsck_clean()
    fs.mount()
    assert (fs.mnt / "chunk.pt").read_bytes() == data
