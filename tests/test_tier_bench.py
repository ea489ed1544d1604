"""`kvfs-bench tier` end to end, small: it starts its own Ceph cluster and two hosts, and
must report every figure, read B's chunks bit-exact (it raises otherwise; so do its
floor passes), and leave nothing behind. Its figures are not judged here: the
benchmarks page does that."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ceph_cluster import missing_packages

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "kvfs-bench"


def leftovers(prefix):
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(set(line.split()[0] for line in netns.splitlines() if line.startswith(prefix)))


def cluster_owners():
    """The pids named by /tmp/kvc*/owner: the processes whose Ceph cluster folders exist."""
    pids = []
    for owner in Path("/tmp").glob("kvc*/owner"):
        try:
            pids.append(owner.read_text().split()[0])
        except (OSError, IndexError):
            pass                                        # another test's cluster, going away
    return pids


FLOORS = ("floor_fetch_verify", "floor_fetch_verify_page_cache_read", "floor_fetch_verify_keep_read_direct")


@pytest.mark.parametrize("client", [False, True], ids=["plain-reads", "bypass-client"])
def test_tier_bench_reports_every_figure_and_tears_down(tmp_path, client):
    if os.geteuid() != 0 or missing_packages():
        pytest.fail("needs root and the Ceph packages (tools/setup --test installs them)")
    workdir = tmp_path / "work"
    workdir.mkdir()
    rounds, readers = (1, 1) if client else (2, 2)
    proc = subprocess.Popen([sys.executable, str(BENCH), "tier", "--chunks", "3", "--chunk-mib", "2.5",
                             "--repeat", str(rounds), "--readers", str(readers), "--rados-seconds", "1",
                             "--workdir", str(workdir), *(["--client"] if client else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout)
    assert (out["chunks"], out["readers"], out["repeat"]) == (3, readers, rounds) and len(out["rounds"]) == rounds
    size = int(2.5 * (1 << 20))
    for r in out["rounds"]:
        assert r["fetched_bytes"] == 3 * size           # every chunk came from the tier, whole
        assert r["second_read_bytes_from_tier"] == 0 and r["verify_failures"] == 0
        if client:                                      # both reads from B's device, none through FUSE
            assert r["block_maps_served"] == 2 * 3 and r["fuse_read_requests"] == 0 and r["page_fill_bytes"] == 0
            assert r["native_read_bytes"] == 0
        else:
            # Through FUSE. B mounts as root, so the native read plane is on: it answers
            # at least the second read (the cold one may find the fetched file not sealed
            # yet and go to pyfuse3), and no open fills the page cache.
            assert r["block_maps_served"] == 0 and r["page_fill_bytes"] == 0
            assert r["native_read_bytes"] >= 3 * size, r
        for key in ("cold_gb_s", "second_read_gb_s", "open_ms_median"):
            assert r[key] > 0, key
        for key in ("cold_cpu_s_per_gb", "second_read_cpu_s_per_gb"):     # /proc/stat ticks: 0 when quick
            assert r[key] >= 0, key
        assert r["rados_bench"]["seq_read_gb_s"] > 0 and r["rados_bench"]["seq_read_cpu_s_per_gb"] > 0
        assert r["cold_vs_rados_seq"] == round(r["cold_gb_s"] / r["rados_bench"]["seq_read_gb_s"], 3)
        for floor in FLOORS:                            # the same objects, without kvfs
            assert r[floor]["gb_s"] > 0 and r[floor]["cpu_s_per_gb"] >= 0, floor
            assert r[floor]["vs_rados_seq"] == round(r[floor]["gb_s"] / r["rados_bench"]["seq_read_gb_s"], 3)
    assert out["cross_host_cold_read_gb_s"] == statistics.median(r["cold_gb_s"] for r in out["rounds"])
    assert out["cold_vs_rados_seq"] == statistics.median(r["cold_vs_rados_seq"] for r in out["rounds"])
    assert out["floor_fetch_verify_page_cache_read_vs_rados_seq"] == statistics.median(
        r["floor_fetch_verify_page_cache_read"]["vs_rados_seq"] for r in out["rounds"])
    assert list(workdir.iterdir()) == []                # scratch removed
    assert list(Path("/dev/shm").glob("kvfs-bench-floor-*")) == []     # the floor's page-cache files
    tag = proc.pid % 100000                             # tests/ceph_cluster.py names things after the pid
    assert leftovers(f"kvt{tag}-") == []                # the cluster's and the hosts' namespaces
    assert subprocess.run(["ip", "link", "show", f"kvr{tag}"], capture_output=True).returncode != 0
    assert str(proc.pid) not in cluster_owners()        # the cluster's folder
