"""Attach an NVMe-oF namespace for kvfs: build ``nvme connect``, find the block device.

The configuration is the kvfs service's environment file (``/etc/kvfs/*.conf``,
systemd EnvironmentFile syntax) or the environment systemd builds from it:

    NVMEOF_TRANSPORT=tcp                 tcp, rdma or fc
    NVMEOF_TRADDR=192.0.2.10             target address
    NVMEOF_TRSVCID=4420                  target port (tcp, rdma)
    NVMEOF_SUBNQN=nqn.2024-01.io.example:kvfs     subsystem NQN
    NVMEOF_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:...   this host's NQN
    NVMEOF_NSID=1                        optional: the namespace id, or
    NVMEOF_NSUUID=...                    optional: the namespace UUID
    NVMEOF_HOSTID=...                    optional: nvme connect --hostid
    NVMEOF_CTRL_LOSS_TMO=600             optional: nvme connect --ctrl-loss-tmo

The namespace's block device is found by subsystem NQN (and nsid or UUID) under
``<sysfs>/class/nvme-subsystem``, never as a fixed ``/dev/nvmeXnY``: controller
and namespace numbers are handed out at connect time and can change after a
reconnect. Two layouts exist:

- native multipath (Debian's default): the namespace head ``nvmeXnY`` is a child
  of the subsystem, ``nvme-subsysN/nvmeXnY``, and each controller has hidden
  per-path devices ``nvmeXcZnY`` that are not usable block devices;
- without multipath: the namespace is a child of a controller,
  ``nvme-subsysN/nvmeZ/nvmeZnY``.

Each namespace directory has ``nsid`` and (when the target reports one) ``uuid``;
each controller has ``state`` (live, connecting, resetting, ...), ``transport``
and ``address``. ``sysfs`` is a parameter so tests can build such a tree.
"""
import dataclasses
import errno
import os
import re
import shlex
import subprocess
import time

from ..errors import KvfsError

SYSFS = "/sys"
DEV = "/dev"
TRANSPORTS = ("tcp", "rdma", "fc")
REQUIRED = {
    "NVMEOF_TRANSPORT": "the transport: tcp, rdma or fc",
    "NVMEOF_TRADDR": "the target address",
    "NVMEOF_TRSVCID": "the target port, e.g. 4420",
    "NVMEOF_SUBNQN": "the subsystem NQN",
    "NVMEOF_HOSTNQN": "this host's NQN, e.g. the content of /etc/nvme/hostnqn",
}
OPTIONAL = ("NVMEOF_NSID", "NVMEOF_NSUUID", "NVMEOF_HOSTID", "NVMEOF_CTRL_LOSS_TMO")
_NAMESPACE = re.compile(r"nvme\d+n\d+")
_CONTROLLER = re.compile(r"nvme\d+")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class NvmeofError(KvfsError):
    """nvme-cli or the kernel refused (EIO)."""


class NvmeofConfigError(NvmeofError):
    """The NVMe-oF settings are missing or malformed."""

    errno = errno.EINVAL


class NvmeofTimeout(NvmeofError):
    errno = errno.ETIMEDOUT


class NotAttached(NvmeofError):
    """The subsystem or namespace is not (yet) visible in sysfs."""

    errno = errno.ENODEV


@dataclasses.dataclass(frozen=True)
class Config:
    transport: str
    traddr: str
    trsvcid: str | None
    subnqn: str
    hostnqn: str
    nsid: int | None = None
    uuid: str | None = None
    hostid: str | None = None
    ctrl_loss_tmo: int | None = None

    @classmethod
    def from_mapping(cls, values):
        """Build from NVMEOF_* keys; a missing or bad key is one NvmeofError line naming it."""
        get = {k: str(v).strip() for k, v in values.items() if k.startswith("NVMEOF_") and str(v).strip()}
        transport = get.get("NVMEOF_TRANSPORT", "").lower()
        need = dict(REQUIRED)
        if transport == "fc":
            need.pop("NVMEOF_TRSVCID")             # FC addresses carry no port
        for key, what in need.items():
            if key not in get:
                raise NvmeofConfigError(f"NVMe-oF config: missing {key} ({what})")
        if transport not in TRANSPORTS:
            raise NvmeofConfigError(f"NVMe-oF config: NVMEOF_TRANSPORT={get['NVMEOF_TRANSPORT']!r} is not one of "
                              f"{', '.join(TRANSPORTS)}")
        for key in ("NVMEOF_SUBNQN", "NVMEOF_HOSTNQN"):
            if not get[key].startswith("nqn."):
                raise NvmeofConfigError(f"NVMe-oF config: {key}={get[key]!r} is not an NQN (nqn.YYYY-MM.domain:...)")
        nsid = _int(get, "NVMEOF_NSID", 1, 0xFFFFFFFE)
        tmo = _int(get, "NVMEOF_CTRL_LOSS_TMO", -1, 1 << 31)
        uuid = get.get("NVMEOF_NSUUID")
        if uuid is not None:
            uuid = uuid.lower()
            if not _UUID.fullmatch(uuid):
                raise NvmeofConfigError(f"NVMe-oF config: NVMEOF_NSUUID={uuid!r} is not a UUID")
        trsvcid = get.get("NVMEOF_TRSVCID")
        if trsvcid is not None and transport != "fc":
            _int(get, "NVMEOF_TRSVCID", 1, 65535)
        return cls(transport, get["NVMEOF_TRADDR"], trsvcid, get["NVMEOF_SUBNQN"], get["NVMEOF_HOSTNQN"],
                   nsid, uuid, get.get("NVMEOF_HOSTID"), tmo)

    def connect_command(self):
        """The exact nvme-cli command line that connects this subsystem."""
        cmd = ["nvme", "connect", "--transport", self.transport, "--traddr", self.traddr]
        if self.trsvcid is not None and self.transport != "fc":
            cmd += ["--trsvcid", self.trsvcid]
        cmd += ["--nqn", self.subnqn, "--hostnqn", self.hostnqn]
        if self.hostid:
            cmd += ["--hostid", self.hostid]
        if self.ctrl_loss_tmo is not None:
            cmd += ["--ctrl-loss-tmo", str(self.ctrl_loss_tmo)]
        return cmd

    def which(self):
        """The namespace asked for, in words ("nsid 1", "uuid ..."), or None for "the only one"."""
        parts = ([f"nsid {self.nsid}"] if self.nsid is not None else []) + \
                ([f"uuid {self.uuid}"] if self.uuid else [])
        return " ".join(parts) or None


def _int(values, key, low, high):
    if key not in values:
        return None
    try:
        number = int(values[key], 0)
    except ValueError:
        raise NvmeofConfigError(f"NVMe-oF config: {key}={values[key]!r} is not a whole number") from None
    if not low <= number <= high:
        raise NvmeofConfigError(f"NVMe-oF config: {key}={number} is out of range ({low}..{high})")
    return number


def configured(values):
    """Whether ``values`` has any NVMEOF_* setting at all (else attaching is not wanted)."""
    return any(k.startswith("NVMEOF_") and str(v).strip() for k, v in values.items())


def read_env_files(paths):
    """Merge systemd EnvironmentFile-style files (later files win); missing files are an error."""
    values = {}
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise NvmeofError(f"{path}: {exc.strerror}") from None
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            name, sep, value = line.removeprefix("export ").partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
                raise NvmeofConfigError(f"{path}:{number}: expected NAME=value")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            values[name.strip()] = value
    return values


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class Namespace:
    name: str           # nvme1n1
    device: str         # /dev/nvme1n1
    nsid: int | None
    uuid: str | None
    subsystem: str      # nvme-subsys1


def subsystems(subnqn, sysfs=SYSFS):
    """sysfs directories of the subsystems whose NQN is ``subnqn``."""
    base = os.path.join(sysfs, "class", "nvme-subsystem")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    return [os.path.join(base, n) for n in names if _read(os.path.join(base, n, "subsysnqn")) == subnqn]


def controllers(subsystem_dir):
    out = []
    for name in sorted(os.listdir(subsystem_dir)):
        path = os.path.join(subsystem_dir, name)
        if _CONTROLLER.fullmatch(name) and os.path.isdir(path):
            out.append({"name": name, "state": _read(os.path.join(path, "state")),
                        "transport": _read(os.path.join(path, "transport")),
                        "address": _read(os.path.join(path, "address"))})
    return out


def namespaces(subsystem_dir, dev=DEV):
    """The usable namespace block devices of one subsystem (either sysfs layout)."""
    found = {}
    places = [subsystem_dir] + [os.path.join(subsystem_dir, c["name"]) for c in controllers(subsystem_dir)]
    for place in places:
        for name in sorted(os.listdir(place)):
            path = os.path.join(place, name)
            if name in found or not _NAMESPACE.fullmatch(name) or not os.path.isdir(path):
                continue
            nsid = _read(os.path.join(path, "nsid"))
            uuid = _read(os.path.join(path, "uuid"))
            found[name] = Namespace(name, os.path.join(dev, name),
                                    int(nsid) if nsid and nsid.isdigit() else None,
                                    uuid.lower() if uuid and uuid.strip("0-") else None,
                                    os.path.basename(subsystem_dir))
    return list(found.values())


def resolve(config, sysfs=SYSFS, dev=DEV):
    """The Namespace that ``config`` names; NotAttached if it is not visible, NvmeofError if ambiguous."""
    subs = subsystems(config.subnqn, sysfs)
    if not subs:
        raise NotAttached(f"subsystem {config.subnqn} is not connected")
    every = [ns for s in subs for ns in namespaces(s, dev)]
    match = [ns for ns in every
             if (config.nsid is None or ns.nsid == config.nsid)
             and (config.uuid is None or ns.uuid == config.uuid)]
    if not match:
        have = ", ".join(f"{ns.name} (nsid {ns.nsid})" for ns in every) or "none"
        if config.which():
            raise NotAttached(f"subsystem {config.subnqn} has no namespace with {config.which()} "
                              f"(it has: {have})")
        raise NotAttached(f"subsystem {config.subnqn} shows no namespace yet")
    if len(match) > 1:
        names = ", ".join(ns.name for ns in match)
        raise NvmeofConfigError(f"subsystem {config.subnqn} has {len(match)} namespaces ({names}): "
                          f"set NVMEOF_NSID or NVMEOF_NSUUID")
    return match[0]


def status(config, sysfs=SYSFS, dev=DEV):
    """The attach state as a dict (``kvfs-admin nvmeof status``)."""
    subs = subsystems(config.subnqn, sysfs)
    out = {"subnqn": config.subnqn, "namespace_wanted": config.which() or "the only one",
           "connect_command": shlex.join(config.connect_command()),
           "connected": bool(subs), "subsystems": [os.path.basename(s) for s in subs],
           "controllers": [c for s in subs for c in controllers(s)],
           "attached": False, "device": None, "nsid": None, "uuid": None, "problem": None}
    try:
        ns = resolve(config, sysfs, dev)
    except NvmeofError as exc:
        out["problem"] = str(exc)
    else:
        present = os.path.exists(ns.device)
        out.update(attached=present, device=ns.device, nsid=ns.nsid, uuid=ns.uuid,
                   problem=None if present else f"{ns.device} does not exist (yet): udev has not made it")
    return out


def attach(config, *, sysfs=SYSFS, dev=DEV, link=None, timeout=30.0, run=subprocess.run):
    """Connect (unless already connected), wait for the namespace, point ``link`` at it.

    Returns (Namespace, whether nvme connect was run).
    """
    connected = False
    try:
        ns = resolve(config, sysfs, dev)
    except NotAttached:
        if not subsystems(config.subnqn, sysfs):
            _connect(config, run)
            connected = True
        ns = _wait(config, sysfs, dev, timeout)
    if not os.path.exists(ns.device):
        ns = _wait(config, sysfs, dev, timeout)
    if link:
        _point(link, ns.device)
    return ns, connected


def _connect(config, run):
    cmd = config.connect_command()
    try:
        proc = run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise NvmeofError("nvme: command not found (install nvme-cli: apt-get install nvme-cli)") from None
    except subprocess.TimeoutExpired:
        raise NvmeofTimeout(f"{shlex.join(cmd)}: no answer within 120 s") from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise NvmeofError(f"nvme connect to {config.subnqn} at {config.traddr} failed "
                          f"(exit {proc.returncode}){': ' + said[-1] if said else ''}")


def _wait(config, sysfs, dev, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            ns = resolve(config, sysfs, dev)
            if os.path.exists(ns.device):
                return ns
            problem = f"{ns.device} did not appear"
        except NotAttached as exc:
            problem = str(exc)
        if time.monotonic() >= deadline:
            raise NvmeofTimeout(f"NVMe-oF namespace not ready after {timeout:g} s: {problem}")
        time.sleep(0.2)


def _point(link, target):
    os.makedirs(os.path.dirname(link) or ".", exist_ok=True)
    tmp = f"{link}.tmp{os.getpid()}"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(target, tmp)
    os.replace(tmp, link)
