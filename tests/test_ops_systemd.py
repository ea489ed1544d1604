"""systemd: the units pass systemd-analyze verify, and the daemon speaks sd_notify.

The notify tests run the daemon the way the unit does (``mount.kvfs -f`` in the
foreground) with ``$NOTIFY_SOCKET`` pointing at a unix datagram socket the test
owns, so they check the real datagrams systemd would get.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from kvfs.server.sdnotify import Notifier
from kvfsmount import TEST_MMP_INTERVAL

REPO = Path(__file__).resolve().parent.parent
UNITS = sorted((REPO / "systemd").glob("*.service"))
MiB = 1 << 20

# Each of these makes systemd run the service in its own mount namespace, cut
# off from the host's: the FUSE mount would not be visible outside the service.
MOUNT_NAMESPACE_DIRECTIVES = ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                              "PrivateMounts", "ProtectKernelTunables", "ProtectKernelModules",
                              "ProtectKernelLogs", "ProtectControlGroups", "ReadOnlyPaths",
                              "InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "MountFlags",
                              "ProtectProc", "ProcSubset", "DynamicUser")


def unit_settings(path):
    settings = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_there_are_units_to_check():
    assert [u.name for u in UNITS] == ["kvfs@.service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package systemd; tools/setup --test installs it)")
@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_passes_systemd_analyze_verify(unit, tmp_path):
    # Verify the template and one instance of it: the instance expands %i/%f.
    # systemd-analyze exits 0 on unknown keys and bad values, only warning, so
    # any output at all is a failure.
    instance = tmp_path / unit.name.replace("@.", "@mnt-kvfs.")
    shutil.copy(unit, instance)
    for path in (unit, instance):
        proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                              timeout=120)
        said = (proc.stdout + proc.stderr).strip()
        assert proc.returncode == 0 and not said, f"systemd-analyze verify {path.name}:\n{said}"


def test_unit_is_a_notify_service_that_fuse_survives():
    s = unit_settings(REPO / "systemd" / "kvfs@.service")
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"]
    watchdog = s["WatchdogSec"][0]
    assert re.fullmatch(r"\d+s", watchdog) and int(watchdog[:-1]) >= 10
    assert s["TimeoutStopSec"] == ["15min"]              # sized for a 16 GiB dirty pool at 20 MB/s
    assert not s.get("ExecStartPost"), "Type=notify needs no polling for the mount"
    assert any("nvmeof attach" in cmd for cmd in s["ExecStartPre"])
    namespaced = sorted(set(s) & set(MOUNT_NAMESPACE_DIRECTIVES))
    assert not namespaced, f"these put the service in its own mount namespace: {namespaced}"
    assert s["NoNewPrivileges"] == ["yes"]


class NotifyListener:
    """A unix datagram socket standing in for systemd's notify socket."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.messages = []          # (monotonic time, {name: value})

    def wait_for(self, line, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            for when, fields in self.messages:
                if line in fields:
                    return when
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {line} within {timeout} s; got {self.messages}")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            self.messages.append((time.monotonic(), data.decode().split("\n")))

    def times(self, line):
        return [when for when, fields in self.messages if line in fields]

    def close(self):
        self.sock.close()


def start_foreground(fs, env_extra, log):
    env = {**os.environ, **env_extra}
    # A short heartbeat, as KvfsMount gives every mount: the default one claims in 5 s.
    return subprocess.Popen([sys.executable, "-m", "kvfs.cli.mount", "-f", str(fs.device), str(fs.mnt),
                             "-o", f"mmp_interval={TEST_MMP_INTERVAL}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def test_ready_watchdog_stopping_then_sigterm_exits_0_and_keeps_data(kvfs_factory, tmp_path):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    log = open(tmp_path / "daemon.log", "w+")
    proc = start_foreground(fs, {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
                                 "WATCHDOG_USEC": "400000"}, log)
    try:
        listener.wait_for("READY=1", timeout=60)
        assert os.path.ismount(fs.mnt), "READY=1 came before the mount was live"
        assert any(line.startswith("STATUS=serving ") for _, f in listener.messages for line in f)
        # WATCHDOG_USEC=400 ms: kvfs pings every 200 ms, from its event loop (the interval
        # itself is checked on trio's virtual clock below): here, the pings keep coming.
        deadline = time.monotonic() + 60
        while len(listener.times("WATCHDOG=1")) < 4 and time.monotonic() < deadline:
            try:
                listener.wait_for("NOTHING", timeout=0.3)
            except AssertionError:
                pass
        pings = listener.times("WATCHDOG=1")
        assert len(pings) >= 4, listener.messages
        assert not listener.times("STOPPING=1")

        data = os.urandom(3 * MiB + 17)
        (fs.mnt / "chunk").write_bytes(data)              # closed, not fsynced: SIGTERM must flush it
        (fs.mnt / "dir").mkdir()
        (fs.mnt / "dir" / "small").write_bytes(b"kv" * 1000)
        proc.send_signal(signal.SIGTERM)
        listener.wait_for("STOPPING=1", timeout=60)
        assert proc.wait(timeout=120) == 0, (log.seek(0), log.read())[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            subprocess.run(["fusermount3", "-uz", str(fs.mnt)], capture_output=True)
        listener.close()
        log.close()
    assert not os.path.ismount(fs.mnt)
    fs.assert_fsck_clean()
    fs.mount()
    assert (fs.mnt / "chunk").read_bytes() == data
    assert (fs.mnt / "dir" / "small").read_bytes() == b"kv" * 1000


async def test_watchdog_pings_every_half_of_watchdog_usec(tmp_path, autojump_clock):
    """The interval the daemon derives from $WATCHDOG_USEC, and its pings on trio's clock."""
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"})
    assert notifier.watchdog_interval == 0.2
    assert Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}).watchdog_interval is None
    assert Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000",
                                  "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval is None
    sent = []
    notifier.send = lambda *lines: sent.append((trio.current_time(), lines))
    start = trio.current_time()
    with trio.move_on_after(1.1):
        await notifier.watchdog()
    assert [lines for _, lines in sent] == [("WATCHDOG=1",)] * 6
    assert [when - start for when, _ in sent] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])


def test_abstract_notify_socket_and_no_watchdog_without_watchdog_usec(kvfs_factory, tmp_path):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    name = f"kvfs-test-notify-{os.getpid()}"
    listener = NotifyListener("\0" + name)
    log = open(tmp_path / "daemon.log", "w+")
    proc = start_foreground(fs, {"NOTIFY_SOCKET": "@" + name}, log)
    try:
        listener.wait_for("READY=1", timeout=60)
        assert os.path.ismount(fs.mnt)
        time.sleep(1.0)
        fs.admin("umount", fs.mnt)                        # a stop that is not a signal
        listener.wait_for("STOPPING=1", timeout=60)
        assert proc.wait(timeout=60) == 0
        assert not listener.times("WATCHDOG=1"), "no WATCHDOG_USEC: no pings"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            subprocess.run(["fusermount3", "-uz", str(fs.mnt)], capture_output=True)
        listener.close()
        log.close()
