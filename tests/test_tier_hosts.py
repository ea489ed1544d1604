"""Several kvfs hosts sharing one Ceph cluster (tests/ceph_cluster.py): each host is a
daemon and a store of its own, running in a network namespace of its own, reaching
the cluster over a veth into the cluster's bridge. The test process reads and writes
through their mountpoints like an engine."""
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

import kvfs.client
from ceph_cluster import ceph, make_host, tenant_key, tier_options  # noqa: F401


@pytest.fixture
def hosts(ceph, tmp_path):
    """make(name, tenant, key, **options) -> a mounted host; all unmounted (and fsck'ed) at the end."""
    made = []

    def make(name, tenant, key, *, netns=True, **extra):
        ns = ceph.add_host(name)[0] if netns else None
        host = make_host(tmp_path / name, ns, tier_options(ceph, tenant, key, **extra))
        host.mount()
        made.append(host)
        return host

    yield make
    for host in made:
        # Shown only when the test failed: what each host's tier did, and its tier log lines.
        try:
            tier = {k: v for k, v in host.stats().items() if k.startswith("tier_")}
        except Exception as exc:
            tier = f"no stats: {exc}"
        lines = [line for line in host.log.read_text(errors="replace").splitlines() if "tier" in line]
        print(f"{host.mnt}: {tier}", *lines[-20:], sep="\n  ")
        host.teardown()


def write_chunk(path: Path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def wait_connected(*hosts_, timeout: float = 60.0):
    """Until each host's daemon holds its cluster connection. A mount whose first try
    failed serves locally and tries again every few seconds: on a loaded 2-core CI VM
    the first try sometimes failed (a fresh-clone run here saw one host unconnected 5 s
    after its mount)."""
    deadline = time.monotonic() + timeout
    for host in hosts_:
        while not host.stats()["tier_connected"]:
            assert time.monotonic() < deadline, f"{host.mnt}: not connected to the cluster in {timeout} s"
            time.sleep(0.1)


def wait_published(host, files: int, timeout: float):
    """Until ``host`` has published ``files`` files to the tier."""
    deadline = time.monotonic() + timeout
    while host.stats()["tier_published_files"] < files:
        assert time.monotonic() < deadline, f"{host.mnt}: {files} files not published in {timeout} s"
        time.sleep(0.02)


def read_when_there(path: Path, timeout: float):
    """(bytes, seconds) of the first open that succeeds, retrying ENOENT for ``timeout``."""
    t0 = time.monotonic()
    while True:
        try:
            with open(path, "rb") as f:
                return f.read(), time.monotonic() - t0
        except FileNotFoundError:
            if time.monotonic() - t0 > timeout:
                raise
            time.sleep(0.02)


def test_a_chunk_closed_on_one_host_is_read_on_another(ceph, hosts, tmp_path):
    key = tenant_key(tmp_path, "t1")
    a = hosts("ha", "t1", key)
    b = hosts("hb", "t1", key)
    c = hosts("hc", "t2", tenant_key(tmp_path, "t2"))      # another tenant
    for h in (a, b, c):
        (h.mnt / "model").mkdir()
    data = os.urandom(32 << 20)
    t0 = time.monotonic()
    write_chunk(a.mnt / "model" / "chunk-0001.bin", data)
    closed = time.monotonic()
    got, waited = read_when_there(b.mnt / "model" / "chunk-0001.bin", timeout=60)
    found_after = time.monotonic() - closed
    print(f"32 MiB chunk: written+closed on A in {closed - t0:.2f} s; read bit-exact on B "
          f"{found_after:.2f} s after A's close")
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    sb = b.stats()
    assert sb["tier_hits"] == 1 and sb["tier_fetched_bytes"] == len(data)
    assert found_after < 60       # the goal is 1 s: printed above; this bound only catches "never"
    # The second read on B is local: not a byte more from the tier.
    with open(b.mnt / "model" / "chunk-0001.bin", "rb") as f:
        assert f.read() == data
    assert b.stats()["tier_fetched_bytes"] == len(data)
    # Another tenant's host: no name, no bytes.
    assert not (c.mnt / "model" / "chunk-0001.bin").exists()
    sc = c.stats()
    assert sc["tier_hits"] == 0 and sc["tier_fetched_bytes"] == 0 and sc["tier_verify_failures"] == 0
    sa = a.stats()
    assert sa["tier_published_files"] == 1
    if sa["tier_publish_errors"] == 0:
        assert sa["tier_published_bytes"] == len(data)
    else:
        # A try timed out (PUBLISH_TIMEOUT) after some of its puts had landed: the retry
        # found those (EEXIST, counted as dedup), so the bytes A created are fewer.
        assert sa["tier_published_blocks"] + sa["tier_publish_dedup_blocks"] >= 32
    assert os.listdir(b.mnt / "model") == ["chunk-0001.bin"]     # no temporary name left behind


def test_the_bypass_client_reads_a_fetched_chunk_from_hosts_device(ceph, hosts, tmp_path):
    """kvfs.client (the reads of the LMCache plugin and the SGLang backend) on a name B
    lacks: its lookup fetches the chunk from the tier, the block map waits for the seal,
    and the client reads B's device itself, not a byte through FUSE."""
    key = tenant_key(tmp_path, "t1")
    a = hosts("hba", "t1", key)
    b = hosts("hbb", "t1", key)
    data = os.urandom((8 << 20) + 4097)
    wait_connected(a, b)
    write_chunk(a.mnt / "c.bin", data)
    wait_published(a, 1, timeout=120)          # a try that times out is retried (see the first test)
    before = b.stats()
    buf = bytearray(len(data))
    assert kvfs.client.read_into(b.mnt / "c.bin", buf) == len(data)
    assert buf == data
    s = b.stats()
    assert s["tier_hits"] == before["tier_hits"] + 1 and s["tier_fetched_bytes"] == len(data)
    assert s["block_maps_served"] == before["block_maps_served"] + 1
    assert s["block_maps_unavailable"] == before["block_maps_unavailable"]
    # No byte came through the mount: no page fill (pyfuse3 alone), no READ answered by
    # the daemon (read_requests counts the native read plane's and pyfuse3's alike).
    for key in ("page_fill_bytes", "read_requests", "bytes_read"):
        assert s[key] == before[key], key


def test_views_and_metrics_show_the_tier(ceph, hosts, tmp_path):
    a = hosts("hv", "t1", tenant_key(tmp_path, "t1"), netns=False)
    wait_connected(a)
    write_chunk(a.mnt / "x.bin", b"y" * 5000)
    with open(a.mnt / "x.bin", "rb"):
        pass
    assert not (a.mnt / "absent.bin").exists()
    summary = a.admin("stats", a.mnt).stdout
    misses = a.stats()["tier_misses"]
    assert misses >= 1        # the kernel may look a name up twice; the second is the miss cache's
    assert "tier        connected" in summary and f"0 hits, {misses} misses" in summary, summary
    metrics = a.admin("metrics", a.mnt).stdout
    assert f"kvfs_tier_misses_total {misses}" in metrics and "kvfs_tier_connected 1" in metrics


def test_unreachable_mon_at_mount_serves_locally_with_a_warning(ceph, hosts, tmp_path):
    a = hosts("hm", "t1", tenant_key(tmp_path, "t1"), mon_host=f"{ceph.subnet}.253:6789", tier_deadline="1")
    log = a.log.read_text()
    assert "shared tier unavailable, serving the local store only for now" in log, log
    data = os.urandom(3 << 20)
    write_chunk(a.mnt / "local.bin", data)
    with open(a.mnt / "local.bin", "rb") as f:
        assert f.read() == data
    t0 = time.monotonic()
    assert not (a.mnt / "nowhere.bin").exists()
    assert time.monotonic() - t0 < 1.0 + 1.0
    s = a.stats()
    assert s["tier_connected"] == 0 and s["tier_misses"] >= 1 and s["tier_hits"] == 0


@pytest.mark.parametrize("change, message", [
    (lambda key: os.chmod(key, 0o644), "readable or writable by group or others"),
    (lambda key: key.write_bytes(b"short"), "shorter than 16 bytes"),
])
def test_bad_tier_options_fail_the_mount_clearly(ceph, tmp_path, change, message):
    key = tenant_key(tmp_path, "t1")
    change(key)
    host = make_host(tmp_path / "bad", None, tier_options(ceph, "t1", key))
    with pytest.raises(AssertionError, match=message):
        host.mount()
    assert not host.mounted


def test_dead_osds_local_keeps_working_lookups_keep_their_deadline_publishing_resumes(ceph, hosts, tmp_path):
    key = tenant_key(tmp_path, "t1")
    a = hosts("ka", "t1", key, tier_deadline="1")
    b = hosts("kb", "t1", key, tier_deadline="1")
    first = os.urandom(4 << 20)
    write_chunk(a.mnt / "c1.bin", first)
    assert read_when_there(b.mnt / "c1.bin", timeout=60)[0] == first
    ceph.kill_osd(0)                    # one OSD dead, the other hung: the cluster answers nothing
    ceph.pause_osds()
    try:
        second = os.urandom(4 << 20)
        t0 = time.monotonic()
        write_chunk(a.mnt / "c2.bin", second)
        close_s = time.monotonic() - t0
        with open(a.mnt / "c2.bin", "rb") as f:
            assert f.read() == second            # local data keeps working on A
        with open(b.mnt / "c1.bin", "rb") as f:
            assert f.read() == first             # ... and on B
        t0 = time.monotonic()
        assert not (b.mnt / "c2.bin").exists()   # the tier cannot answer: a miss, in time
        lookup_s = time.monotonic() - t0
        print(f"cluster down: close on A {close_s:.2f} s, lookup miss on B {lookup_s:.2f} s (deadline 1 s)")
        assert lookup_s < 1.0 + 2.0
        assert close_s < 1.0 + 5       # its create's lookup may wait for one deadline, no more
        assert b.stats()["tier_timeouts"] >= 1
    finally:
        ceph.resume_osds(wait=False)
        ceph.replace_osd(0)
        ceph.wait_active()
    third = os.urandom(2 << 20)
    write_chunk(a.mnt / "c3.bin", third)
    got, _ = read_when_there(b.mnt / "c3.bin", timeout=60)   # publishing resumed
    assert got == third
    assert b.stats()["tier_verify_failures"] == 0


def test_a_burst_of_writes_keeps_the_publish_queue_bounded(ceph, hosts, tmp_path):
    a = hosts("qa", "t1", tenant_key(tmp_path, "t1"), tier_queue="4")
    rss_before = a.stats()["rss_bytes"]
    ceph.pause_osds()                   # the publishers hang on their first put
    try:
        t0 = time.monotonic()
        for i in range(40):
            write_chunk(a.mnt / f"burst-{i}.bin", os.urandom(1 << 20))
        burst_s = time.monotonic() - t0
        def accounted(s):       # every offer is queued, dropped, or was taken by a publisher
            taken = s["tier_publish_errors"] + s["tier_published_files"] + s["tier_publish_skipped"] + 2
            return s["tier_queue_len"] + s["tier_queue_drops"] + taken
        deadline = time.monotonic() + 30
        while accounted(a.stats()) < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        s = a.stats()
        print(f"burst of 40 files: {burst_s:.2f} s; queue max {s['tier_queue_max']}, "
              f"drops {s['tier_queue_drops']}, publish errors {s['tier_publish_errors']}, "
              f"rss {s['rss_bytes'] - rss_before:+,} bytes")
        assert s["tier_queue_max"] <= 4 and s["tier_queue_len"] <= 4
        # Each publisher takes an offer, fails after its 10 s timeout, and takes the next:
        # all the others were dropped.
        taken = s["tier_publish_errors"] + s["tier_published_files"] + s["tier_publish_skipped"] + 2
        assert s["tier_queue_drops"] >= 40 - 4 - taken > 0
        assert burst_s < 30          # close() never waited for the tier
        for i in range(40):
            assert (a.mnt / f"burst-{i}.bin").stat().st_size == 1 << 20
    finally:
        ceph.resume_osds()


def test_a_poisoned_object_is_never_served_through_a_mount(ceph, hosts, tmp_path):
    from kvfs.tier.names import TenantNames
    from kvfs.tier.rados import load_rados
    secret = os.urandom(32)
    key = tenant_key(tmp_path, "t1", secret)
    a = hosts("pa", "t1", key)
    data = os.urandom(3 << 20)
    write_chunk(a.mnt / "p.bin", data)
    wait_published(a, 1, timeout=60)
    names = TenantNames("t1", secret.hex().encode())
    victim = names.block_names(data, 1 << 20)[2]
    rados = load_rados()
    ceph_id, keyring = ceph.add_tenant("t1")
    cluster = rados.Rados(conffile=str(ceph.client_conf(ceph_id, keyring)), rados_id=ceph_id)
    cluster.connect(timeout=10)
    try:
        ioctx = cluster.open_ioctx("kvpool")
        ioctx.set_namespace("t1")
        bad = bytearray(data[2 << 20:])
        bad[-1] ^= 0xFF
        for attempt in range(6):                  # the tenant's own credentials, straight to RADOS
            try:
                ioctx.write_full(victim, bytes(bad))
                break
            except rados.TimedOut:
                if attempt == 5:
                    raise
        b = hosts("pb", "t1", key)
        assert not (b.mnt / "p.bin").exists()     # never served
        s = b.stats()
        assert (s["tier_verify_failures"], s["tier_quarantined"], s["tier_hits"]) == (1, 1, 0)
        deadline = time.monotonic() + 20
        while True:                                # quarantined: moved aside, then deleted
            try:
                ioctx.stat(victim)
            except rados.ObjectNotFound:
                break
            except rados.TimedOut:                 # a PG still peering after an earlier test's OSD stop
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ioctx.read("q" + victim, 2 << 20) == bytes(bad)
        ioctx.close()
    finally:
        cluster.shutdown()
