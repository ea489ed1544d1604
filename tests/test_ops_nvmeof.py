"""NVMe-oF attach: the nvme connect command line, and finding the namespace in sysfs.

This kernel has no NVMe-oF modules, so the sysfs trees here are built by the
tests, laid out as the kernel lays them out (class links into
devices/virtual, controllers linked from their subsystem, native-multipath
heads under the subsystem with hidden nvmeXcYnZ paths under each controller).
That tree is the only stand-in; everything else is the real module and CLI.
"""
import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs.cli import nvmeof
from kvfsmount import KvfsMount

REPO = Path(__file__).resolve().parent.parent
SUBNQN = "nqn.2024-06.io.example:kvfs-pool-a"
OTHER = "nqn.2024-06.io.example:scratch"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:5b4b1c5e-9d1a-4b7e-8a51-3f0f3c1d2e4a"
UUID_A = "0b6f3a7e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
UUID_B = "7d3c2b1a-0f9e-4d8c-b7a6-5f4e3d2c1b0a"
BASE = {"NVMEOF_TRANSPORT": "tcp", "NVMEOF_TRADDR": "192.0.2.10", "NVMEOF_TRSVCID": "4420",
        "NVMEOF_SUBNQN": SUBNQN, "NVMEOF_HOSTNQN": HOSTNQN}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


class FakeSysfs:
    """A /sys with nvme-subsystem and nvme-fabrics controllers, as the kernel shows them."""

    def __init__(self, root):
        self.root = Path(root)
        (self.root / "class" / "nvme-subsystem").mkdir(parents=True, exist_ok=True)

    def subsystem(self, n, nqn, controllers, namespaces, multipath=True):
        """controllers: [(ctrl number, state)]; namespaces: [(name, nsid, uuid)]."""
        sub = self.root / "devices" / "virtual" / "nvme-subsystem" / f"nvme-subsys{n}"
        write(sub / "subsysnqn", nqn)
        (self.root / "class" / "nvme-subsystem" / f"nvme-subsys{n}").symlink_to(
            os.path.relpath(sub, self.root / "class" / "nvme-subsystem"))
        for ctrl, state in controllers:
            cdir = self.root / "devices" / "virtual" / "nvme-fabrics" / "ctl" / f"nvme{ctrl}"
            write(cdir / "state", state)
            write(cdir / "transport", "tcp")
            write(cdir / "address", "traddr=192.0.2.10,trsvcid=4420,src_addr=192.0.2.99")
            write(cdir / "subsysnqn", nqn)
            (sub / f"nvme{ctrl}").symlink_to(os.path.relpath(cdir, sub))
            for name, nsid, uuid in namespaces:
                if multipath:       # hidden per-path device: not a usable block device
                    head, nsnum = re.fullmatch(r"nvme(\d+)n(\d+)", name).groups()
                    path = cdir / f"nvme{head}c{ctrl}n{nsnum}"
                else:
                    path = cdir / name
                write(path / "nsid", str(nsid))
                write(path / "uuid", uuid)
                write(path / "dev", f"259:{nsid}")
        if multipath:
            for name, nsid, uuid in namespaces:
                write(sub / name / "nsid", str(nsid))
                write(sub / name / "uuid", uuid)
                write(sub / name / "dev", f"259:{nsid}")
        return sub


def config(**extra):
    return nvmeof.Config.from_mapping({**BASE, **extra})


# -- the command line -------------------------------------------------------------
def test_connect_command_line_is_exact():
    assert config().connect_command() == [
        "nvme", "connect", "--transport", "tcp", "--traddr", "192.0.2.10", "--trsvcid", "4420",
        "--nqn", SUBNQN, "--hostnqn", HOSTNQN]
    cmd = config(NVMEOF_TRANSPORT="RDMA", NVMEOF_HOSTID="5b4b1c5e-9d1a-4b7e-8a51-3f0f3c1d2e4a",
                 NVMEOF_CTRL_LOSS_TMO="600", NVMEOF_NSID="2").connect_command()
    assert cmd == ["nvme", "connect", "--transport", "rdma", "--traddr", "192.0.2.10", "--trsvcid", "4420",
                   "--nqn", SUBNQN, "--hostnqn", HOSTNQN, "--hostid", "5b4b1c5e-9d1a-4b7e-8a51-3f0f3c1d2e4a",
                   "--ctrl-loss-tmo", "600"]
    fc = {**BASE, "NVMEOF_TRANSPORT": "fc", "NVMEOF_TRADDR": "nn-0x2000001b32812345:pn-0x2100001b32812345"}
    del fc["NVMEOF_TRSVCID"]
    assert nvmeof.Config.from_mapping(fc).connect_command() == [
        "nvme", "connect", "--transport", "fc", "--traddr", "nn-0x2000001b32812345:pn-0x2100001b32812345",
        "--nqn", SUBNQN, "--hostnqn", HOSTNQN]


def conf_file(tmp_path, values, name="mnt-kvfs.conf"):
    path = tmp_path / name
    lines = ["# kvfs settings", "DEVICE=/run/kvfs/mnt-kvfs/device", "OPTIONS=defaults"]
    lines += [f'{k}="{v}"' if i % 2 else f"{k}={v}" for i, (k, v) in enumerate(values.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def admin(*args, env=None, check=False):
    return subprocess.run([sys.executable, "-m", "kvfs.cli.admin", *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=env)


def test_cli_prints_the_command_line_from_a_config_file(tmp_path):
    proc = admin("nvmeof", "command", "--config", conf_file(tmp_path, BASE))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"nvme connect --transport tcp --traddr 192.0.2.10 --trsvcid 4420 "
                           f"--nqn {SUBNQN} --hostnqn {HOSTNQN}\n")


@pytest.mark.parametrize("drop, change, message", [
    ("NVMEOF_SUBNQN", {}, "NVMe-oF config: missing NVMEOF_SUBNQN (the subsystem NQN)"),
    ("NVMEOF_HOSTNQN", {}, "NVMe-oF config: missing NVMEOF_HOSTNQN (this host's NQN"),
    ("NVMEOF_TRSVCID", {}, "NVMe-oF config: missing NVMEOF_TRSVCID (the target port, e.g. 4420)"),
    ("NVMEOF_TRADDR", {}, "NVMe-oF config: missing NVMEOF_TRADDR (the target address)"),
    (None, {"NVMEOF_TRANSPORT": "udp"}, "NVMEOF_TRANSPORT='udp' is not one of tcp, rdma, fc"),
    (None, {"NVMEOF_NSID": "first"}, "NVMEOF_NSID='first' is not a whole number"),
    (None, {"NVMEOF_NSID": "0"}, "NVMEOF_NSID=0 is out of range"),
    (None, {"NVMEOF_NSUUID": "not-a-uuid"}, "NVMEOF_NSUUID='not-a-uuid' is not a UUID"),
    (None, {"NVMEOF_SUBNQN": "kvfs-pool-a"}, "NVMEOF_SUBNQN='kvfs-pool-a' is not an NQN"),
])
def test_bad_config_is_one_line(tmp_path, drop, change, message):
    values = {k: v for k, v in {**BASE, **change}.items() if k != drop}
    for action in ("command", "status", "attach"):
        proc = admin("nvmeof", action, "--config", conf_file(tmp_path, values))
        lines = proc.stderr.splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and proc.stdout == "", proc.stderr
        assert lines[0].startswith("kvfs-admin: ") and message in lines[0], lines[0]


def test_no_settings_at_all(tmp_path):
    empty = conf_file(tmp_path, {})
    proc = admin("nvmeof", "attach", "--if-configured", "--config", empty)
    assert proc.returncode == 0 and proc.stdout == proc.stderr == ""          # the unit's step is a no-op
    proc = admin("nvmeof", "status", "--config", empty)
    assert proc.returncode == 1 and f"no NVMe-oF settings (NVMEOF_*) in {empty}" in proc.stderr
    proc = admin("nvmeof", "status", "--config", tmp_path / "absent.conf")
    assert proc.returncode == 1 and "absent.conf: No such file or directory" in proc.stderr


def test_environment_file_syntax(tmp_path):
    path = tmp_path / "x.conf"
    path.write_text("# comment\n; also\n\nNVMEOF_TRADDR='192.0.2.7'\nNVMEOF_NSID=3\nOPTIONS=a,b\n")
    assert nvmeof.read_env_files([path]) == {"NVMEOF_TRADDR": "192.0.2.7", "NVMEOF_NSID": "3", "OPTIONS": "a,b"}
    (tmp_path / "bad.conf").write_text("NVMEOF_TRADDR 192.0.2.7\n")
    with pytest.raises(nvmeof.NvmeofError, match=r"bad.conf:1: expected NAME=value"):
        nvmeof.read_env_files([tmp_path / "bad.conf"])


# -- finding the namespace ------------------------------------------------------
def test_resolves_by_nqn_and_nsid_or_uuid_in_the_multipath_layout(tmp_path):
    sysfs = FakeSysfs(tmp_path)
    sysfs.subsystem(0, OTHER, [(0, "live")], [("nvme0n1", 1, UUID_B)])
    # Numbers deliberately unrelated: subsystem 3, controllers 4 and 5, heads nvme2n*.
    sysfs.subsystem(3, SUBNQN, [(4, "live"), (5, "connecting")],
                    [("nvme2n1", 1, UUID_A), ("nvme2n2", 2, UUID_B)])
    ns = nvmeof.resolve(config(NVMEOF_NSID="2"), sysfs=tmp_path)
    assert (ns.name, ns.device, ns.nsid, ns.uuid, ns.subsystem) == (
        "nvme2n2", "/dev/nvme2n2", 2, UUID_B, "nvme-subsys3")
    assert nvmeof.resolve(config(NVMEOF_NSUUID=UUID_A.upper()), sysfs=tmp_path).name == "nvme2n1"
    assert nvmeof.resolve(config(NVMEOF_NSID="1", NVMEOF_NSUUID=UUID_A), sysfs=tmp_path).name == "nvme2n1"
    with pytest.raises(nvmeof.NotAttached, match="has no namespace with nsid 2 uuid"):
        nvmeof.resolve(config(NVMEOF_NSID="2", NVMEOF_NSUUID=UUID_A), sysfs=tmp_path)
    with pytest.raises(nvmeof.NvmeofError, match=r"has 2 namespaces \(nvme2n1, nvme2n2\): set NVMEOF_NSID"):
        nvmeof.resolve(config(), sysfs=tmp_path)
    # The other subsystem's namespace with the same UUID_B is never confused with ours.
    assert nvmeof.resolve(config(NVMEOF_NSUUID=UUID_B), sysfs=tmp_path).subsystem == "nvme-subsys3"
    st = nvmeof.status(config(NVMEOF_NSID="1"), sysfs=tmp_path)
    assert st["connected"] and st["subsystems"] == ["nvme-subsys3"]
    assert [(c["name"], c["state"]) for c in st["controllers"]] == [("nvme4", "live"), ("nvme5", "connecting")]
    assert st["device"] == "/dev/nvme2n1" and not st["attached"]        # no such node on this host


def test_resolves_in_the_layout_without_multipath(tmp_path):
    sysfs = FakeSysfs(tmp_path)
    sysfs.subsystem(1, SUBNQN, [(1, "live")], [("nvme1n1", 1, UUID_A), ("nvme1n3", 3, UUID_B)],
                    multipath=False)
    assert nvmeof.resolve(config(NVMEOF_NSID="3"), sysfs=tmp_path).device == "/dev/nvme1n3"


def test_follows_the_namespace_across_a_reconnect_that_renumbers_it(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    FakeSysfs(before).subsystem(1, SUBNQN, [(1, "live")], [("nvme1n1", 1, UUID_A)])
    # After a reconnect the kernel may hand out other numbers; only NQN and nsid are stable.
    FakeSysfs(after).subsystem(0, OTHER, [(0, "live")], [("nvme0n1", 1, UUID_B)])
    FakeSysfs(after).subsystem(6, SUBNQN, [(7, "live")], [("nvme6n1", 1, UUID_A)])
    assert nvmeof.resolve(config(NVMEOF_NSID="1"), sysfs=before).device == "/dev/nvme1n1"
    assert nvmeof.resolve(config(NVMEOF_NSID="1"), sysfs=after).device == "/dev/nvme6n1"


def test_not_connected(tmp_path):
    FakeSysfs(tmp_path).subsystem(0, OTHER, [(0, "live")], [("nvme0n1", 1, UUID_B)])
    with pytest.raises(nvmeof.NotAttached, match=f"subsystem {SUBNQN} is not connected") as err:
        nvmeof.resolve(config(), sysfs=tmp_path)
    assert err.value.errno == errno.ENODEV
    proc = admin("nvmeof", "status", "--config", conf_file(tmp_path, BASE), "--sysfs", tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert f"subsystem   {SUBNQN}  (not connected)" in proc.stdout
    assert f"state       not attached: subsystem {SUBNQN} is not connected" in proc.stdout
    assert "connect     nvme connect --transport tcp --traddr 192.0.2.10" in proc.stdout
    assert nvmeof.subsystems(SUBNQN, sysfs=tmp_path / "nothing") == []


def test_attach_without_nvme_cli_says_so_in_one_line(tmp_path):
    FakeSysfs(tmp_path / "sys")
    env = {"PATH": str(tmp_path / "bin")}               # a host without nvme-cli
    proc = admin("nvmeof", "attach", "--config", conf_file(tmp_path, BASE), "--sysfs", tmp_path / "sys",
                 env=env)
    assert proc.returncode == 1 and proc.stderr == (
        "kvfs-admin: nvme: command not found (install nvme-cli: apt-get install nvme-cli)\n")


def test_attach_when_connected_links_the_namespace_and_kvfs_mounts_through_it(tmp_path):
    """The unit's ExecStartPre step, then its ExecStart, on an already connected namespace."""
    FakeSysfs(tmp_path / "sys").subsystem(2, SUBNQN, [(3, "live")], [("nvme3n1", 1, UUID_A)])
    dev = tmp_path / "dev"
    dev.mkdir()
    (tmp_path / "kvfs").mkdir()
    fs = KvfsMount(tmp_path / "kvfs", size="1G")
    fs.device = dev / "nvme3n1"                         # stands where udev would put the block device
    fs.mkfs()
    link = tmp_path / "run" / "kvfs" / "mnt-kvfs" / "device"
    conf = conf_file(tmp_path, {**BASE, "NVMEOF_NSUUID": UUID_A})
    env = {**os.environ, "DEVICE": "/dev/nvme0n1"}
    proc = admin("nvmeof", "attach", "--config", conf, "--sysfs", tmp_path / "sys", "--dev-root", dev,
                 "--link", link, env=env)
    assert proc.returncode == 1 and proc.stderr == (
        f"kvfs-admin: NVMe-oF is configured, so set DEVICE={link} (the attached namespace), "
        f"not DEVICE='/dev/nvme0n1'\n")
    env["DEVICE"] = str(link)
    proc = admin("nvmeof", "attach", "--config", conf, "--sysfs", tmp_path / "sys", "--dev-root", dev,
                 "--link", link, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"already connected: {SUBNQN} namespace 1 is {dev}/nvme3n1 (linked as {link})\n"
    assert os.readlink(link) == f"{dev}/nvme3n1"
    proc = admin("nvmeof", "status", "--config", conf, "--sysfs", tmp_path / "sys", "--dev-root", dev)
    assert proc.returncode == 0 and "state       attached\n" in proc.stdout, proc.stdout
    assert f"namespace   uuid {UUID_A}: {dev}/nvme3n1 (nsid 1, uuid {UUID_A})" in proc.stdout
    assert "controller  nvme3  live  tcp  traddr=192.0.2.10,trsvcid=4420" in proc.stdout

    fs.device = link
    fs.mount()
    try:
        (fs.mnt / "kv").write_bytes(b"attached" * 1000)
        assert fs.stats()["device"] == str(link)
    finally:
        fs.teardown()
    fs.mount()
    try:
        assert (fs.mnt / "kv").read_bytes() == b"attached" * 1000
    finally:
        fs.teardown()


def test_the_example_settings_file_parses_and_its_nvmeof_lines_make_a_config(tmp_path):
    example = (REPO / "systemd" / "kvfs.conf.example").read_text()
    assert not nvmeof.configured(nvmeof.read_env_files([REPO / "systemd" / "kvfs.conf.example"]))
    enabled = tmp_path / "enabled.conf"
    lines = [line[1:] if line.startswith(("#NVMEOF_", "#DEVICE=")) else line for line in example.splitlines()]
    enabled.write_text("\n".join(lines) + "\n")
    values = nvmeof.read_env_files([enabled])          # as systemd reads it: no trailing comments
    cfg = nvmeof.Config.from_mapping(values)
    assert (cfg.transport, cfg.traddr, cfg.trsvcid, cfg.nsid) == ("tcp", "192.0.2.10", "4420", 1)
    assert values["DEVICE"] == "/run/kvfs/mnt-kvfs/device"
