"""Prometheus metrics: ``kvfs-admin metrics`` and the ``metrics_port=`` HTTP endpoint.

The exposition is checked with prometheus_client's own text parser, and its
numbers against known workloads (8 identical files, one cold read).
"""
import os
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfs.server import metrics
from kvfsmount import run_tool

MiB = 1 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, name, sample=None, **labels):
    fam = families[name]
    for s in fam.samples:
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"{sample or name} {labels} not in {fam.samples}")


def listening_address(port):
    """The local address of the TCP socket listening on ``port`` (from /proc/net/tcp*)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.split(":")
                if int(hexport, 16) == port and state == "0A":            # LISTEN
                    found.append(addr)
    return found


@pytest.fixture
def metered(kvfs_factory):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    port = free_port()
    fs.mount(f"metrics_port={port}")
    fs.port = port
    return fs


def test_exposition_parses_and_counts_known_workloads(metered):
    fs = metered
    chunk = os.urandom(4 * MiB)
    for rank in range(8):                                 # an MLA model at TP=8
        (fs.mnt / f"rank{rank}.bin").write_bytes(chunk)
    cold = os.urandom(6 * MiB)
    (fs.mnt / "cold.bin").write_bytes(cold)
    fs.flush()
    fs.admin("drop-caches", fs.mnt)
    before = fs.stats()["device_bytes_read"]
    assert (fs.mnt / "cold.bin").read_bytes() == cold

    text = fs.admin("metrics", fs.mnt).stdout
    fams = parse(text)
    assert all(name.startswith("kvfs_") for name in fams)
    for fam in fams.values():
        for s in fam.samples:
            if fam.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name
            assert not (fam.type == "gauge" and s.name.endswith("_total")), s.name
    assert fams["kvfs_cache_hits"].type == "counter"
    assert fams["kvfs_device_read_bytes"].type == "counter"
    assert fams["kvfs_used_bytes"].type == "gauge"
    assert fams["kvfs_device_read_latency_seconds"].type == "histogram"

    # 8 identical 4 MiB files and one of 6 MiB: logical 38 MiB over 10 MiB stored.
    assert value(fams, "kvfs_used_bytes") == 10 * MiB
    assert value(fams, "kvfs_logical_bytes") == 38 * MiB
    assert value(fams, "kvfs_dedup_ratio") == pytest.approx(3.8, rel=0.01)
    assert value(fams, "kvfs_unique_blocks") == 10
    assert value(fams, "kvfs_files") == 9
    assert value(fams, "kvfs_dedup_hits", "kvfs_dedup_hits_total") == 28
    # A cold read of 6 MiB read about 6 MiB from the device (no more than a few metadata sectors besides).
    read = value(fams, "kvfs_device_read_bytes", "kvfs_device_read_bytes_total") - before
    assert 6 * MiB <= read <= 6 * MiB + 64 * 1024, read
    assert value(fams, "kvfs_info", device_kind="file", mountpoint=str(fs.mnt)) == 1

    hist = [s for s in fams["kvfs_device_read_latency_seconds"].samples if s.name.endswith("_bucket")]
    counts = [s.value for s in hist]
    assert counts == sorted(counts) and hist[-1].labels["le"] == "+Inf"
    # The histogram times the daemon's Python device reads (the superblock and journal at
    # mount, at least); the native read plane's reads of cold.bin are not in it.
    assert counts[-1] == value(fams, "kvfs_device_read_latency_seconds",
                               "kvfs_device_read_latency_seconds_count") >= 1

    as_json = fs.admin("metrics", "--json", fs.mnt).stdout
    assert '"kvfs_used_bytes"' in as_json


def test_http_endpoint_answers_on_the_configured_port_on_loopback_only(metered):
    fs = metered
    (fs.mnt / "a").write_bytes(b"x" * MiB)
    with urllib.request.urlopen(f"http://127.0.0.1:{fs.port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        fams = parse(resp.read().decode())
    assert value(fams, "kvfs_written_bytes", "kvfs_written_bytes_total") == MiB
    assert value(fams, "kvfs_info", mountpoint=str(fs.mnt)) == 1
    assert listening_address(fs.port) == ["0100007F"]         # 127.0.0.1, nothing else
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{fs.port}/other", timeout=10)
    assert err.value.code == 404
    fs.umount()
    with pytest.raises(OSError):                              # the port is released with the mount
        urllib.request.urlopen(f"http://127.0.0.1:{fs.port}/metrics", timeout=5)


def test_every_numeric_statistic_is_exported_or_deliberately_not(metered):
    stats = metered.stats()
    missing = sorted(k for k, v in stats.items()
                     if k not in metrics.METRICS and k not in metrics.NOT_EXPORTED
                     and not isinstance(v, str))
    assert not missing, f"statistics with no metric (add them to kvfs.server.metrics.METRICS): {missing}"


def test_metrics_port_in_use_fails_the_mount_with_one_line(kvfs_factory):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_tool("mount", fs.device, fs.mnt, "-o", f"metrics_port={port}", check=False, timeout=120)
    assert proc.returncode != 0 and not fs.mounted
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"metrics_port: cannot listen on 127.0.0.1 port {port}" in lines[0], proc.stderr


@pytest.mark.parametrize("option, message", [
    ("metrics_port=0", "'metrics_port': '0' must be a TCP port from 1 to 65535"),
    ("metrics_port=http", "'metrics_port': 'http' is not a whole number"),
    ("metrics_port=9100,metrics_addr=localhost", "'metrics_addr': 'localhost' is not an IPv4 or IPv6 address"),
    ("metrics_addr=127.0.0.1", "'metrics_addr' needs 'metrics_port' too"),
])
def test_bad_metrics_options_are_one_line_errors(kvfs_factory, option, message):
    fs = kvfs_factory(size="1G")
    fs.mkfs()
    proc = run_tool("mount", fs.device, fs.mnt, "-o", option, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not fs.mounted


def test_exposition_escapes_label_values():
    text = metrics.exposition({"mountpoint": '/mnt/a "b"\\c\nd', "device": "/dev/x", "used_bytes": 1})
    fams = parse(text)
    assert value(fams, "kvfs_info", mountpoint='/mnt/a "b"\\c\nd') == 1


def test_grafana_dashboard_uses_only_metrics_kvfs_exports():
    import json
    import re
    from pathlib import Path
    dash = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana-kvfs.json").read_text())
    exported = {name for name, _, _ in metrics.METRICS.values()} | {"kvfs_info"}
    exported |= {f"kvfs_device_read_latency_seconds_{s}" for s in ("bucket", "sum", "count")}
    used = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= set(re.findall(r"\bkvfs_[a-z0-9_]+", target["expr"]))
    used |= set(re.findall(r"\bkvfs_[a-z0-9_]+", json.dumps(dash["templating"])))
    assert used and not used - exported, sorted(used - exported)
    # Counters are only ever used through rate()/increase(), never as raw levels.
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bkvfs_[a-z0-9_]+_total\b", target["expr"]):
                assert re.search(rf"(rate|increase)\({name}\b", target["expr"]), target["expr"]
