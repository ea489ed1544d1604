"""A throwaway Ceph cluster for the tier tests: one mon, two memstore OSDs, no mgr.

Built from Debian 12's packages (ceph-mon, ceph-osd, ceph-common, python3-rados),
by hand: ceph-authtool, monmaptool, ceph-mon --mkfs, ``osd new`` and ceph-osd --mkfs.
No cephadm, no containers, no systemd units.

The daemons run inside a network namespace the harness creates (``kvt<pid>c``) and
listen only on its bridge address (10.N.M.1). The test process reaches them over a
veth pair into that bridge; each test "host" (:meth:`CephCluster.add_host`) is one
more network namespace with a veth into the same bridge. Everything is torn down by
:meth:`CephCluster.stop`: daemons killed by their pid, namespaces and links deleted,
the directory removed. Nothing listens outside the namespaces the harness made.

Each tenant gets a cephx user whose caps are limited to one RADOS namespace of the
pool: ``osd 'allow rw pool=kvpool namespace=<tenant>'``.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

CEPH_PACKAGES = ("ceph-mon", "ceph-osd", "ceph-common", "python3-rados")
POOL = "kvpool"


def _run(*argv, input=None, check=True):
    result = subprocess.run(argv, input=input, capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-800:]}")
    return result.stdout.strip()


def missing_packages():
    """The Ceph binaries this harness needs that are not installed (names of the Debian packages)."""
    need = {"ceph-mon": "ceph-mon", "ceph-osd": "ceph-osd", "ceph-authtool": "ceph-common",
            "monmaptool": "ceph-common"}
    missing = {pkg for tool, pkg in need.items() if shutil.which(tool) is None}
    try:
        from kvfs.tier.rados import load_rados
        load_rados()
    except Exception:
        missing.add("python3-rados")
    return sorted(missing)


class CephCluster:
    def __init__(self, *, osds: int = 2, memstore_mib: int = 384, objectstore: str = "memstore"):
        self.objectstore = objectstore
        tag = f"{os.getpid() % 100000}"
        self.dir = Path(tempfile.mkdtemp(prefix="kvc", dir="/tmp"))   # short: admin sockets <108 bytes
        self.netns = f"kvt{tag}-c"
        self.bridge = f"kvb{tag}"
        self.root_veth = f"kvr{tag}"
        self.subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 250)}"
        self.ip = f"{self.subnet}.1"
        self.osd_count = osds
        self.memstore_bytes = memstore_mib << 20
        self.fsid = str(uuid.uuid4())
        self.conf = self.dir / "ceph.conf"
        self.admin_keyring = self.dir / "client.admin.keyring"
        self.mon = None
        self.osds: dict[int, subprocess.Popen] = {}
        self.osd_uuids: dict[int, str] = {}
        self.hosts: list[str] = []
        self._next_host_ip = 10
        self._links: list[str] = []
        self.started_s = None

    # -- setup -------------------------------------------------------------------------------
    def _conf_text(self):
        d = self.dir
        return f"""[global]
fsid = {self.fsid}
mon_host = {self.ip}:6789
ms_bind_msgr2 = false
public_network = {self.subnet}.0/24
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
run_dir = {d}/run
admin_socket = {d}/run/$name.asok
pid_file = {d}/run/$name.pid
log_file = {d}/log/$name.log
log_to_stderr = false
err_to_stderr = false
mon_cluster_log_file = {d}/log/cluster.log
mon_data = {d}/$name
osd_data = {d}/$name
keyring = {d}/$name.keyring
osd_objectstore = {self.objectstore}
osd_journal_size = 32
osd_journal = {d}/$name/journal
osd_max_object_name_len = 256
osd_max_object_namespace_len = 64
filestore_fd_cache_size = 64
memstore_device_bytes = {self.memstore_bytes}
osd_memory_target = 536870912
osd_pool_default_size = 2
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
osd_crush_update_on_start = true
mon_allow_pool_delete = true
mon_data_avail_crit = 0
mon_data_avail_warn = 0
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_osd_min_down_reporters = 1
osd_heartbeat_interval = 1
osd_heartbeat_grace = 5
mon_max_pg_per_osd = 1000
client_mount_timeout = 5
rados_mon_op_timeout = 5
rados_osd_op_timeout = 5
"""

    def _netns(self, *argv):
        return ["ip", "netns", "exec", self.netns, *argv]

    def _network(self):
        _run("ip", "netns", "add", self.netns)
        _run(*self._netns("ip", "link", "set", "lo", "up"))
        # A fixed MAC: a bridge left to choose takes the lowest of its ports' MACs, so
        # adding a host's veth changed it, and every client that had resolved the mon's
        # address kept sending to the old MAC, which the bridge now drops as another
        # host's (PACKET_OTHERHOST) until its ARP entry was probed again. That cut
        # the test process and older hosts off the cluster for up to tens of seconds.
        mac = "02:6b:76:" + ":".join(f"{random.randrange(256):02x}" for _ in range(3))
        _run(*self._netns("ip", "link", "add", self.bridge, "address", mac, "type", "bridge"))
        _run(*self._netns("ip", "addr", "add", f"{self.ip}/24", "dev", self.bridge))
        _run(*self._netns("ip", "link", "set", self.bridge, "up"))
        # The test process's own way in: a veth from the root namespace into the bridge.
        peer = self.root_veth + "p"
        _run("ip", "link", "add", self.root_veth, "type", "veth", "peer", "name", peer)
        self._links.append(self.root_veth)
        _run("ip", "link", "set", peer, "netns", self.netns)
        _run(*self._netns("ip", "link", "set", peer, "master", self.bridge))
        _run(*self._netns("ip", "link", "set", peer, "up"))
        _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.root_veth)
        _run("ip", "link", "set", self.root_veth, "up")

    def add_host(self, name: str) -> tuple[str, str]:
        """A network namespace for one kvfs "host", with a veth into the cluster's bridge.
        Returns (namespace name, its address)."""
        ns = f"kvt{os.getpid() % 100000}-{name}"
        ip = f"{self.subnet}.{self._next_host_ip}"
        self._next_host_ip += 1
        _run("ip", "netns", "add", ns)
        self.hosts.append(ns)
        veth, peer = f"kvh{len(self.hosts)}{os.getpid() % 10000}", f"kvh{len(self.hosts)}{os.getpid() % 10000}p"
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", veth, "netns", ns)
        _run("ip", "link", "set", peer, "netns", self.netns)
        _run(*self._netns("ip", "link", "set", peer, "master", self.bridge))
        _run(*self._netns("ip", "link", "set", peer, "up"))
        for argv in (("ip", "link", "set", "lo", "up"), ("ip", "addr", "add", f"{ip}/24", "dev", veth),
                     ("ip", "link", "set", veth, "up")):
            _run("ip", "netns", "exec", ns, *argv)
        return ns, ip

    def start(self):
        reap_stale_clusters()
        t0 = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _start(self):
        d = self.dir
        (d / "run").mkdir()
        (d / "log").mkdir()
        (d / "owner").write_text(f"{os.getpid()}\n{self.netns}\n")
        self.conf.write_text(self._conf_text())
        self._network()
        mon_keyring = d / "mon.a.keyring"
        _run("ceph-authtool", "--create-keyring", str(mon_keyring), "--gen-key", "-n", "mon.", "--cap", "mon", "allow *")
        _run("ceph-authtool", "--create-keyring", str(self.admin_keyring), "--gen-key", "-n", "client.admin",
             "--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *")
        _run("ceph-authtool", str(mon_keyring), "--import-keyring", str(self.admin_keyring))
        monmap = d / "monmap"
        _run("monmaptool", "--create", "--add", "a", f"{self.ip}:6789", "--fsid", self.fsid, str(monmap))
        _run("ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(monmap),
             "--keyring", str(mon_keyring))
        self.mon = self._spawn("ceph-mon", "-f", "-c", str(self.conf), "-i", "a")
        with self.admin() as cluster:
            for _ in range(self.osd_count):
                self._make_osd(cluster)
            self._command(cluster, prefix="osd pool create", pool=POOL, pg_num=8, pgp_num=8)
            self._command(cluster, prefix="osd pool application enable", pool=POOL, app="rados")
            self.wait_active(cluster)

    def _spawn(self, *argv):
        return subprocess.Popen(self._netns(*argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(self.dir / "log" / f"{argv[0]}.stderr", "ab"), start_new_session=True)

    def admin(self, timeout: float = 15.0, tries: int = 3):
        rados = _rados()
        for attempt in range(tries):
            cluster = rados.Rados(conffile=str(self.conf), name="client.admin",
                                  conf={"keyring": str(self.admin_keyring)})
            try:
                cluster.connect(timeout=int(timeout))
                return _Closing(cluster)
            except rados.TimedOut:
                cluster.shutdown()
                if attempt == tries - 1:
                    raise

    @staticmethod
    def _command(cluster, **cmd):
        rc, out, err = cluster.mon_command(json.dumps({**cmd, "format": "json"}), b"", timeout=20)
        if rc:
            raise RuntimeError(f"{cmd['prefix']} failed: {rc} {err}")
        return json.loads(out) if out.strip() else None

    def _make_osd(self, cluster):
        osd_uuid = str(uuid.uuid4())
        secret = _run("ceph-authtool", "--gen-print-key")
        rc, out, err = cluster.mon_command(json.dumps({"prefix": "osd new", "uuid": osd_uuid, "format": "json"}),
                                           json.dumps({"cephx_secret": secret}).encode(), timeout=20)
        if rc:
            raise RuntimeError(f"osd new failed: {rc} {err}")
        osd_id = json.loads(out)["osdid"]
        (self.dir / f"osd.{osd_id}").mkdir()
        _run("ceph-authtool", "--create-keyring", str(self.dir / f"osd.{osd_id}.keyring"), "--name",
             f"osd.{osd_id}", "--add-key", secret)
        _run("ceph-osd", "-c", str(self.conf), "-i", str(osd_id), "--mkfs", "--osd-uuid", osd_uuid)
        self.osd_uuids[osd_id] = osd_uuid
        self.start_osd(osd_id)

    def start_osd(self, osd_id: int):
        self.osds[osd_id] = self._spawn("ceph-osd", "-f", "-c", str(self.conf), "-i", str(osd_id))

    def kill_osds(self):
        """SIGKILL every OSD and wait for them (teardown)."""
        for proc in self.osds.values():
            _kill(proc)
        self.osds.clear()

    def kill_osd(self, osd_id: int):
        """SIGKILL one OSD (memstore: its copy of every object is gone with it)."""
        _kill(self.osds.pop(osd_id))

    def pause_osds(self):
        """SIGSTOP every OSD: a cluster that accepts connections and answers nothing."""
        for proc in self.osds.values():
            os.kill(proc.pid, signal.SIGSTOP)

    def pause_mon(self):
        """SIGSTOP the mon: clients cannot authenticate (a mon away at a host's mount)."""
        os.kill(self.mon.pid, signal.SIGSTOP)

    def resume_mon(self):
        os.kill(self.mon.pid, signal.SIGCONT)

    def resume_osds(self, wait: bool = True):
        """SIGCONT the OSDs; with ``wait``, until they are up and the pool takes writes again."""
        for proc in self.osds.values():
            os.kill(proc.pid, signal.SIGCONT)
        if wait:
            self.wait_active()

    def replace_osd(self, osd_id: int):
        """A new, empty OSD under a killed one's id (a replaced disk); it backfills from the other."""
        path = self.dir / f"osd.{osd_id}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        _run("ceph-osd", "-c", str(self.conf), "-i", str(osd_id), "--mkfs", "--osd-uuid", self.osd_uuids[osd_id])
        self.start_osd(osd_id)

    def wait_active(self, cluster=None, timeout: float = 60.0):
        """Until every OSD we run is up and a write to the pool goes through (there is no mgr
        to ask for PG states)."""
        if cluster is None:
            with self.admin() as c:
                return self.wait_active(c, timeout)
        deadline = time.monotonic() + timeout
        while self._command(cluster, prefix="osd stat").get("num_up_osds", 0) < len(self.osds):
            if time.monotonic() > deadline:
                raise RuntimeError(f"OSDs not up after {timeout}s")
            time.sleep(0.2)
        ioctx = cluster.open_ioctx(POOL)
        try:
            ioctx.set_namespace("harness-probe")
            for i in range(64):     # objects in every PG (8), almost surely
                while True:
                    try:
                        ioctx.write_full(f"probe-{i}", b"x")
                        break
                    except Exception as exc:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"the pool takes no writes after {timeout}s: {exc}") from None
                        time.sleep(0.2)
        finally:
            ioctx.close()

    def add_tenant(self, tenant: str) -> tuple[str, Path]:
        """A cephx user for ``tenant``, allowed only its RADOS namespace. Returns (ceph_id, keyring)."""
        name = f"client.kv-{tenant}"
        keyring = self.dir / f"{name}.keyring"
        if keyring.exists():
            return f"kv-{tenant}", keyring
        with self.admin() as cluster:
            self._command(cluster, prefix="auth get-or-create", entity=name,
                          caps=["mon", "allow r", "osd", f"allow rw pool={POOL} namespace={tenant}"])
            rc, out, err = cluster.mon_command(json.dumps({"prefix": "auth get", "entity": name}), b"", timeout=20)
            if rc:
                raise RuntimeError(f"auth get failed: {err}")
        keyring = self.dir / f"{name}.keyring"
        keyring.write_bytes(out)
        os.chmod(keyring, 0o600)
        return f"kv-{tenant}", keyring

    def client_conf(self, ceph_id: str, keyring: Path, *, mon_host: str | None = None) -> Path:
        """A ceph.conf for one client: the mon's address and its keyring, nothing else."""
        path = self.dir / f"{ceph_id}-{mon_host or 'mon'}.conf".replace(":", "_")
        path.write_text(f"[global]\nfsid = {self.fsid}\nmon_host = {mon_host or self.ip + ':6789'}\n"
                        f"keyring = {keyring}\nlog_file = /dev/null\nclient_mount_timeout = 5\n"
                        f"rados_mon_op_timeout = 5\nrados_osd_op_timeout = 5\n")
        return path

    # -- teardown ----------------------------------------------------------------------------
    def stop(self):
        self.kill_osds()
        if self.mon is not None:
            _kill(self.mon)
            self.mon = None
        for ns in self.hosts:
            _pids_in(ns, kill=True)
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.hosts.clear()
        for pid in _pids_of_conf(self.conf):           # daemons we started that slipped through
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _pids_in(self.netns, kill=True)
        for link in self._links:
            subprocess.run(["ip", "link", "delete", link], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)
        keep = os.environ.get("KVFS_CEPH_LOGS")        # a folder to keep the daemons' logs in
        if keep and (self.dir / "log").is_dir():
            shutil.copytree(self.dir / "log", Path(keep) / self.dir.name, dirs_exist_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


class _Closing:
    def __init__(self, cluster):
        self.cluster = cluster

    def __enter__(self):
        return self.cluster

    def __exit__(self, *exc):
        self.cluster.shutdown()


def _rados():
    from kvfs.tier.rados import load_rados
    return load_rados()


def _kill(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _pids_of_conf(conf):
    """Ceph daemons started with ``-c conf`` (ours: the conf is in our own temporary dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(conf).encode() in argv and argv[0].split(b"/")[-1] in (b"ceph-mon", b"ceph-osd"):
                pids.append(int(proc.name))
    return pids


def reap_stale_clusters():
    """Tear down clusters whose test process died without its teardown (a crash, SIGKILL):
    their daemons, network namespaces and folders. Only ours: /tmp/kvc*/owner names them."""
    for owner in Path("/tmp").glob("kvc*/owner"):
        try:
            pid_text, netns = owner.read_text().split()[:2]
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        for stale in _pids_of_conf(owner.parent / "ceph.conf"):
            try:
                os.kill(stale, signal.SIGKILL)
            except ProcessLookupError:
                pass
        prefix = netns[:-1]                                 # kvt<pid>: the hosts' namespaces too
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for ns in names:
            if ns.startswith(prefix):
                _pids_in(ns, kill=True)
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        shutil.rmtree(owner.parent, ignore_errors=True)


def _pids_in(ns, kill=False):
    """The pids running in network namespace ``ns`` (killed with SIGKILL when ``kill``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    pids = [int(p) for p in out if p.isdigit()]
    if kill:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.05)
    return pids


# -- the pytest fixture, shared by the tier test files -------------------------------------------
import pytest   # noqa: E402

_shared = {"cluster": None, "users": 0}


@pytest.fixture(scope="session")
def ceph():
    """One cluster per pytest process, for every tier test file that imports this fixture
    (each importing module gets its own fixture definition; they share the cluster and
    the last one to finish stops it)."""
    if os.geteuid() != 0:
        pytest.fail("the tier tests start Ceph daemons and network namespaces: they need root")
    missing = missing_packages()
    if missing:
        pytest.fail(f"the tier tests need Debian packages: apt-get install -y {' '.join(missing)}",
                    pytrace=False)
    if _shared["cluster"] is None:
        _shared["cluster"] = CephCluster().start()
    _shared["users"] += 1
    try:
        yield _shared["cluster"]
    finally:
        _shared["users"] -= 1
        if not _shared["users"]:
            cluster, _shared["cluster"] = _shared["cluster"], None
            cluster.stop()


# -- kvfs "hosts": a daemon and a store each, in a network namespace of their own --------------
def tenant_key(directory: Path, tenant: str, secret: bytes | None = None) -> Path:
    """A root-only file with ``tenant``'s secret (random unless given)."""
    path = Path(directory) / f"{tenant}.key"
    path.write_bytes((secret or os.urandom(32)).hex().encode())
    os.chmod(path, 0o600)
    return path


def tier_options(cluster: CephCluster, tenant: str, key: Path, **extra) -> list[str]:
    """Mount options for a host of ``tenant`` (its cephx user is made on first use)."""
    ceph_id, keyring = cluster.add_tenant(tenant)
    conf = cluster.client_conf(ceph_id, keyring, mon_host=extra.pop("mon_host", None))
    opts = {"tier": "rados", "ceph_conf": conf, "ceph_id": ceph_id, "ceph_pool": POOL, "tenant": tenant,
            "tenant_key": key, **extra}
    return [f"{k}={v}" for k, v in opts.items()]


def make_host(root: Path, netns: str | None, options: list[str], size="1G"):
    """A KvfsMount whose daemon runs in network namespace ``netns`` (None: this one)."""
    from kvfsmount import TEST_MMP_INTERVAL, KvfsMount

    class TierHost(KvfsMount):
        def mount(self, *more):
            opts = [*self.mount_options, *more, f"log={self.log}", f"mmp_interval={TEST_MMP_INTERVAL}"]
            prefix = ["nsenter", f"--net=/run/netns/{netns}"] if netns else []
            cmd = [*prefix, sys.executable, "-m", "kvfs.cli.mount", str(self.device), str(self.mnt),
                   "-o", ",".join(opts)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode:
                raise AssertionError(f"mount failed ({proc.returncode}): {proc.stderr.strip()}")
            self.pid = self.stats()["pid"]
            return self

    Path(root).mkdir(parents=True, exist_ok=True)
    host = TierHost(root, size=size, mount_options=options)
    host.mkfs()
    return host
