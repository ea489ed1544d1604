"""kvfs-bench netdev and its emulated namespace (tools/netdev/latencydev.c).

Tiny scales; the JSON's shape, the device's set-up (direct-I/O loop devices) and
that nothing is left behind.  No test asserts a speed or an upper bound on time;
one checks that the emulated device never answers before its latency and, from the
counts the daemon reports on SIGUSR1, that it serves requests side by side.  Needs root, /dev/fuse,
losetup, a C compiler with libfuse3-dev (tools/setup installs it) and fio.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchruns import interrupt_once_running

TOOLS = Path(__file__).resolve().parent.parent / "tools"
BENCH = TOOLS / "kvfs-bench"
MiB = 1 << 20

pytestmark = [
    pytest.mark.skipif(shutil.which("losetup") is None, reason="losetup (util-linux) is not installed"),
    pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed"),
    pytest.mark.skipif(shutil.which("pkg-config") is None
                       or subprocess.run(["pkg-config", "--exists", "fuse3"]).returncode != 0,
                       reason="libfuse3-dev is not installed (tools/setup installs it)"),
]


def load():
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_netdev
        import bench_softpath
        import benchlib
    finally:
        sys.path.remove(str(TOOLS))
    return benchlib, bench_softpath, bench_netdev


def leftovers(path):
    """Mounts, loop devices and processes that still refer to anything under ``path``."""
    with open("/proc/self/mountinfo") as f:
        found = [line for line in f if str(path) in line]
    found += [line for line in subprocess.run(["losetup", "-a"], capture_output=True, text=True)
              .stdout.splitlines() if str(path) in line]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "latencydev" in cmdline and str(path) in cmdline:
            found.append(f"process {pid}: {cmdline}")
    return found


def speeds_without_cpu(node, where="$"):
    """Every "...gbps" key whose dict lacks the matching "...cpu_s_per_gb" key."""
    missing = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key.endswith("gbps") and key[:-len("gbps")] + "cpu_s_per_gb" not in node:
                missing.append(f"{where}.{key}")
            missing += speeds_without_cpu(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            missing += speeds_without_cpu(value, f"{where}[{index}]")
    return missing


def test_netdev_help():
    proc = subprocess.run([sys.executable, str(BENCH), "netdev", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage:" in proc.stdout


def test_netdev_reports_every_figure_and_tears_down(tmp_path):
    pytest.importorskip("torch")
    _, softpath, _ = load()
    chunks, mib = 2, 4
    proc = subprocess.run([sys.executable, str(BENCH), "netdev", "--latency-us", "100", "--chunks", str(chunks),
                           "--chunk-mib", str(mib), "--repeat", "1", "--dev-size", "512M", "--no-lmcache",
                           "--no-sglang", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = chunks * mib * MiB

    config = out["config"]
    assert config["bytes"] == expected and config["latencies_us"] == [100]
    assert config["device_size"] == 512 * MiB
    assert config["lmcache"] is False and config["lmcache_skipped"]
    assert config["sglang"] is False and config["sglang_skipped"] == "--no-sglang"
    # Both loop devices ran in direct-I/O mode, on the daemons the issue describes.
    assert config["loop_dio"] == {"100": {"ext4": 1, "kvfs": 1}}
    namespaces = config["namespaces"]["100"]
    assert namespaces["ext4"]["loop"] != namespaces["kvfs"]["loop"]
    for ns in namespaces.values():
        assert ns["dio"] == 1 and ns["latency_us"] == 100 and ns["size"] == 512 * MiB
        assert ns["daemon_init"] == {"max_background": 128, "congestion_threshold": 96,
                                     "max_write": MiB, "max_read": MiB, "async_dio": 1}

    assert speeds_without_cpu(out) == []
    result = out["latencies"]["100"]
    assert len(result["runs"]) == 1
    run = result["runs"][0]
    assert sorted(run["order"]) == ["ext4", "kvfs"]
    device = run["device"]
    assert device["bytes"] >= expected
    for name in ("write_qd16", "read_qd1", "read_qd16"):
        assert device[name]["gbps"] > 0 and device[name]["cpu_s_per_gb"] >= 0, name
        assert result["medians"]["device"][name] == device[name]
    for side in ("kvfs", "ext4"):
        for name in softpath.FIGURES:
            fig = run[side][name]
            assert fig["bytes"] == fig["expected_bytes"] == expected, (side, name)
            assert fig["gbps"] == pytest.approx(fig["bytes"] / fig["seconds"] / 1e9)
            assert fig["cpu_s_per_gb"] == pytest.approx(fig["cpu_seconds"] / (fig["bytes"] / 1e9))
            if name != softpath.WRITE_PATH:
                assert fig["files_verified"] == chunks
            if name.startswith("cold"):
                assert fig["device_bytes_read"] >= expected, (side, name)   # cold: from the device
            assert result["medians"][side][name]["gbps"] == fig["gbps"]
        assert "lmcache" not in run[side] and "sglang" not in run[side]
        # kvfs.client.read_many, cold, one calling thread: every byte checked, from the device.
        client = run[side]["cold_read_many_1t"]
        assert client["bytes"] == client["expected_bytes"] == expected and client["threads"] == 1
        assert client["files_verified"] == chunks and client["device_bytes_read"] >= expected
        assert client["cpu_s_per_gb"] == pytest.approx(client["cpu_seconds"] / (expected / 1e9))
        if side == "kvfs":
            assert client["files_bypassed"] == chunks and client["daemon_device_bytes_read"] < expected // 2

    # The FUSE floor: latencydev with no latency read through its mount, both ways of opening.
    floors = config["floors"]["100"]
    assert floors["page_cache"]["options"] == ["--page-cache"] and floors["direct_io"]["options"] == []
    reads = [name for name in softpath.FIGURES if name != softpath.WRITE_PATH]
    assert sorted(run["floor"]) == ["direct_io", "page_cache"]
    for floor, figures in run["floor"].items():
        assert floors[floor]["latency_us"] == 0 and floors[floor]["size"] >= expected
        assert sorted(figures) == sorted(reads)
        for name, fig in figures.items():
            assert fig["bytes"] == expected and fig["files_verified"] == chunks, (floor, name)
            if name.startswith("cold") or floor == "direct_io":
                assert fig["daemon_bytes_served"] >= expected, (floor, name)   # the daemon served it
            else:
                assert fig["daemon_bytes_served"] == 0, (floor, name)          # hot: the page cache
            assert fig["gbps"] == pytest.approx(fig["bytes"] / fig["seconds"] / 1e9)
            assert result["medians"]["floor"][floor][name]["gbps"] == fig["gbps"]

    table = result["table"]
    assert sorted(table) == sorted([*softpath.FIGURES, "cold_read_many_1t"])
    for name, row in table.items():
        for floor in ("page_cache", "direct_io"):
            assert (f"floor_{floor}_gbps" in row) == (name in reads), (name, floor)
            if name in reads:
                f = run["floor"][floor][name]
                assert row[f"floor_{floor}_gbps"] == f["gbps"]
                assert row[f"floor_{floor}_over_ext4"] == pytest.approx(f["gbps"] / row["ext4_gbps"])
                assert row[f"kvfs_over_floor_{floor}"] == pytest.approx(row["kvfs_gbps"] / f["gbps"])
    qd1, qd16 = device["read_qd1"]["gbps"], device["read_qd16"]["gbps"]
    for name, row in table.items():
        assert row["speed_ratio"] == pytest.approx(row["kvfs_gbps"] / row["ext4_gbps"])
        if row["ext4_cpu_s_per_gb"]:
            assert row["cpu_ratio"] == pytest.approx(row["kvfs_cpu_s_per_gb"] / row["ext4_cpu_s_per_gb"])
        if name == softpath.WRITE_PATH:
            assert row["kvfs_over_device_write_qd16"] == pytest.approx(
                row["kvfs_gbps"] / device["write_qd16"]["gbps"])
        else:
            assert row["kvfs_over_device_qd1"] == pytest.approx(row["kvfs_gbps"] / qd1)
            assert row["ext4_over_device_qd16"] == pytest.approx(row["ext4_gbps"] / qd16)

    assert leftovers(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_netdev_on_tmpfs_loop_devices(tmp_path):
    """--latency-us tmpfs: loop devices in direct-I/O mode straight on tmpfs files (no latency
    daemon), the same figures, and nothing left behind."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH), "netdev", "--latency-us", "tmpfs", "--chunks", "2",
                           "--chunk-mib", "4", "--repeat", "1", "--dev-size", "256M", "--no-lmcache",
                           "--no-sglang", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["config"]["latencies_us"] == ["tmpfs"]
    assert out["config"]["loop_dio"] == {"tmpfs": {"ext4": 1, "kvfs": 1}}
    for ns in out["config"]["namespaces"]["tmpfs"].values():
        assert ns["backing"] == "tmpfs" and ns["latency_us"] is None and ns["size"] == 256 * MiB
    run = out["latencies"]["tmpfs"]["runs"][0]
    client = run["kvfs"]["cold_read_many_1t"]
    assert client["files_verified"] == 2 and client["device_bytes_read"] >= 8 * MiB
    assert client["files_bypassed"] == 2                  # the device itself, not the mount
    # ... and only the client read it: the daemon did not read the files as well (the
    # block device counted 8 MiB, so a prefetch on top would show here as 8 MiB more).
    assert client["daemon_device_bytes_read"] < 4 * MiB, client
    assert "--- tmpfs: device" in proc.stderr
    assert leftovers(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_netdev_refuses_a_device_it_does_not_know():
    proc = subprocess.run([sys.executable, str(BENCH), "netdev", "--latency-us", "100,ramdisk"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "'ramdisk' is neither microseconds >= 0 nor tmpfs" in proc.stderr


def test_netdev_interrupted_still_tears_down(tmp_path):
    """Ctrl-C while the filesystems are in use leaves no mount, loop device or daemon behind."""
    pytest.importorskip("torch")
    interrupt_once_running([BENCH, "netdev", "--latency-us", "100", "--chunks", "4", "--chunk-mib", "4",
                            "--repeat", "3", "--dev-size", "512M", "--no-lmcache", "--no-sglang",
                            "--workdir", tmp_path],
                           ["repeat 1: "], lambda: leftovers(tmp_path))
    assert leftovers(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def served(ns):
    """What ``ns``'s daemon served since the last call (its SIGUSR1 line), as a dict of ints."""
    return ns.served()


def test_namespace_latency_and_overlap(tmp_path):
    """Each request waits the latency; concurrent requests wait it side by side."""
    benchlib, _, netdev = load()
    latency_ms = 50
    with benchlib.Teardown() as teardown:
        ns = netdev.Namespace("t", netdev.build_daemon(), tmp_path, 64 * MiB, latency_ms * 1000).start(teardown)
        assert ns.dio == 1
        assert ns.init["max_background"] == 128 and ns.init["async_dio"] == 1
        data = os.urandom(MiB)
        buf = benchlib.aligned_buffer(MiB)
        buf[:] = data
        fd = os.open(ns.loop, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwrite(fd, buf, 8 * MiB) == MiB
            benchlib.zero_buffer(buf)
            # Never answered before its latency (a lower bound: a busy host only adds to it).
            start = time.perf_counter()
            assert os.preadv(fd, [memoryview(buf)[:4096]], 8 * MiB) == 4096
            assert time.perf_counter() - start >= latency_ms / 1000 * 0.99
            assert os.preadv(fd, [buf], 8 * MiB) == MiB and bytes(buf) == data
            served(ns)                                  # from here on: only the readers below
            # 16 readers at once: the daemon has more than one of their requests in hand at
            # a time, each waiting its latency side by side with the others.
            errors, took = [], []
            ready = threading.Barrier(16)

            def read_one(index):
                local = benchlib.aligned_buffer(MiB)
                ready.wait()
                began = time.perf_counter()
                try:
                    os.preadv(fd, [local], index * MiB)
                except OSError as exc:
                    errors.append(exc)
                took.append(time.perf_counter() - began)

            threads = [threading.Thread(target=read_one, args=(i,)) for i in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert errors == []
            assert min(took) >= latency_ms / 1000 * 0.99
            stats = served(ns)
            assert stats["reads"] >= 16 and stats["read_bytes"] >= 16 * MiB and stats["writes"] == 0, stats
            assert stats["max_in_flight"] > 1, stats
        finally:
            os.close(fd)
    assert ns.proc.returncode == 0
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("page_cache", [False, True])
def test_the_floor_daemon_opens_with_or_without_the_page_cache(tmp_path, page_cache):
    """--page-cache answers opens without direct_io: a second buffered read is the kernel's."""
    benchlib, _, netdev = load()
    with benchlib.Teardown() as teardown:
        # Read through the mount, no loop device, as the floor reads.
        ns = netdev.Namespace("t", netdev.build_daemon(), tmp_path, 16 * MiB, 0, loop=False,
                              extra_args=("--page-cache",) if page_cache else ()).start(teardown)
        data = os.urandom(4 * MiB)
        fd = os.open(ns.file, os.O_RDWR)
        try:
            assert os.pwrite(fd, data, MiB) == len(data)
            os.fsync(fd)
            assert os.pread(fd, len(data), MiB) == data
            served(ns)
            assert os.pread(fd, len(data), MiB) == data       # read again, the same descriptor
            again = served(ns)["read_bytes"]
        finally:
            os.close(fd)
        assert again == (0 if page_cache else len(data))
    assert ns.proc.returncode == 0
    assert leftovers(tmp_path) == []


def test_namespace_daemon_exits_on_sigterm(tmp_path):
    benchlib, _, netdev = load()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([str(netdev.build_daemon()), "--size", "16M", "--latency-us", "0", str(mnt)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "mounted"
        assert proc.stdout.readline().startswith("init ")
        assert (mnt / "namespace").stat().st_size == 16 * MiB
        assert os.listdir(mnt) == ["namespace"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert not os.path.ismount(mnt)
    assert leftovers(tmp_path) == []


@pytest.mark.lmcache
@pytest.mark.sglang
def test_netdev_engine_rows(tmp_path):
    """With LMCache and SGLang installed (tools/setup --test installs both), the engines'
    cold reads are measured: LMCache's local disk on both sides and the kvfs plugin on
    kvfs; HiCacheFile on both sides and the kvfs backend's batch_get_v1 on kvfs."""
    pytest.importorskip("lmcache")
    pytest.importorskip("sglang")
    proc = subprocess.run([sys.executable, str(BENCH), "netdev", "--latency-us", "100", "--chunks", "1",
                           "--chunk-mib", "4", "--repeat", "1", "--dev-size", "512M",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["config"]["lmcache"] is True and out["config"]["sglang"] is True
    assert speeds_without_cpu(out) == []
    result = out["latencies"]["100"]
    run = result["runs"][0]
    for side in ("kvfs", "ext4"):
        modes = ("buffered", "odirect", "plugin") if side == "kvfs" else ("buffered", "odirect")
        assert sorted(run[side]["lmcache"]) == sorted(modes)
        for mode in modes:
            row = run[side]["lmcache"][mode]
            assert "error" not in row, (side, mode, row)
            assert row["use_odirect"] == (mode == "odirect") and row["plugin"] == (mode == "plugin")
            assert row["retrieve_bytes"] == 4 * MiB and row["retrieve_gbps"] > 0
        backends = ("file", "kvfs") if side == "kvfs" else ("file",)
        assert sorted(run[side]["sglang"]) == sorted(backends)
        for backend in backends:
            row = run[side]["sglang"][backend]
            assert "error" not in row, (side, backend, row)
            assert row["backend"] == backend and row["get_bytes"] == 4 * MiB and row["get_gbps"] > 0
    table = result["table"]
    for mode in ("buffered", "odirect"):
        row = table[f"lmcache_retrieve_{mode}"]
        assert row["speed_ratio"] == pytest.approx(row["kvfs_gbps"] / row["ext4_gbps"])
    # The engine rows: kvfs's client against the stock backend on ext4 (LMCache: its faster mode).
    ext4 = result["medians"]["ext4"]
    plugin = table["lmcache_retrieve_plugin"]
    best = max(("lmcache_retrieve_buffered", "lmcache_retrieve_odirect"), key=lambda n: ext4[n]["gbps"])
    assert plugin["ext4_figure"] == best and plugin["ext4_gbps"] == ext4[best]["gbps"]
    assert plugin["kvfs_gbps"] == run["kvfs"]["lmcache"]["plugin"]["retrieve_gbps"]
    assert plugin["speed_ratio"] == pytest.approx(plugin["kvfs_gbps"] / plugin["ext4_gbps"])
    sglang = table["sglang_get_v1_kvfs"]
    assert sglang["ext4_figure"] == "sglang_get_file"
    assert sglang["kvfs_gbps"] == run["kvfs"]["sglang"]["kvfs"]["get_gbps"]
    assert sglang["ext4_gbps"] == run["ext4"]["sglang"]["file"]["get_gbps"]
    assert sglang["kvfs_over_device_qd16"] == pytest.approx(
        sglang["kvfs_gbps"] / run["device"]["read_qd16"]["gbps"])
    assert leftovers(tmp_path) == []
    assert list(tmp_path.iterdir()) == []
