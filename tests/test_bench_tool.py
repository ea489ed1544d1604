"""tools/kvfs-bench on a plain directory: the JSON it prints and the checks it makes.

These tests use tiny chunks and assert on shape and sanity, never on speed.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchruns import interrupt_once_running

TOOLS = Path(__file__).resolve().parent.parent / "tools"
BENCH = TOOLS / "kvfs-bench"
MiB = 1 << 20

READ_COMBINATIONS = [f"{temp}_{mode}_{threads}t"
                     for temp in ("cold", "hot") for mode in ("buffered", "direct") for threads in (1, 4)]


def bench(*args, script=BENCH, expect_rc=0):
    proc = subprocess.run([sys.executable, str(script), *map(str, args)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect_rc, f"rc={proc.returncode}\n{proc.stderr}"
    return proc


def bench_json(*args):
    return json.loads(bench(*args).stdout)


@pytest.fixture
def chunk_dir(tmp_path):
    pytest.importorskip("torch")
    directory = tmp_path / "chunks"
    directory.mkdir()
    return directory


def test_write_reports_positive_throughputs(chunk_dir):
    out = bench_json("write", chunk_dir, "--chunks", 4, "--chunk-mib", 1, "--rewrite")

    assert out["chunks"] == 4
    assert out["chunk_bytes"] == MiB
    assert out["bytes"] == 4 * MiB
    assert out["chunk_shape"] == [2, 32, 256, 32]
    for result in (out, out["rewrite"]):
        assert result["bytes"] == 4 * MiB
        for key in ("write_seconds", "write_gbps", "durable_seconds", "flush_gbps",
                    "total_seconds", "total_gbps"):
            assert result[key] > 0, key

    files = sorted(chunk_dir.iterdir())
    assert len(files) == 4
    assert all(f.stat().st_size == MiB for f in files)
    assert all(f.name.startswith("meta-llama-Meta-Llama-3-8B@1@0@") for f in files)
    assert len({f.read_bytes() for f in files}) == 4, "chunks must differ"


def test_same_seed_gives_identical_chunks(chunk_dir, tmp_path):
    """The rewrite measurement depends on regenerating byte-identical chunks."""
    again = tmp_path / "again"
    other = tmp_path / "other"
    again.mkdir()
    other.mkdir()
    bench("write", chunk_dir, "--chunks", 2, "--chunk-mib", 1)
    bench("write", again, "--chunks", 2, "--chunk-mib", 1)
    bench("write", other, "--chunks", 2, "--chunk-mib", 1, "--seed", 7)

    def contents(d):
        return {f.name: f.read_bytes() for f in d.iterdir()}

    assert contents(chunk_dir) == contents(again)
    assert not set(contents(chunk_dir).values()) & set(contents(other).values())


def test_read_reports_all_eight_combinations(chunk_dir):
    bench("write", chunk_dir, "--chunks", 4, "--chunk-mib", 1)
    out = bench_json("read", chunk_dir)

    assert out["files"] == 4
    assert out["bytes"] == 4 * MiB
    assert out["unsupported"] == []  # tmp_path is on a disk filesystem: O_DIRECT works
    assert sorted(out["gbps"]) == sorted(READ_COMBINATIONS)
    assert sorted(out["seconds"]) == sorted(READ_COMBINATIONS)
    for name in READ_COMBINATIONS:
        assert out["gbps"][name] > 0, name
        assert out["seconds"][name] > 0, name


def test_read_of_empty_directory_fails(tmp_path):
    proc = bench("read", tmp_path, expect_rc=1)
    assert "no files to read" in proc.stderr


def test_short_read_is_an_error(tmp_path):
    """A read returning less than the file size must fail the benchmark."""
    sys.path.insert(0, str(TOOLS))
    try:
        import benchlib
    finally:
        sys.path.remove(str(TOOLS))
    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(8192))
    claimed = [(str(path), 3 * 4096)]  # one page more than is there
    for odirect in (False, True):
        with pytest.raises(benchlib.ShortIO):
            benchlib.read_files(claimed, threads=1, odirect=odirect)


def test_lmcache_without_workload_module_exits_2(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(BENCH, tools / "kvfs-bench")
    shutil.copy(TOOLS / "benchlib.py", tools / "benchlib.py")
    proc = bench("lmcache", script=tools / "kvfs-bench", expect_rc=2)
    assert "lmcache_workload.py is missing" in proc.stderr


@pytest.mark.parametrize("command", ["write", "read", "compare", "lmcache", "softpath", "meta", "netdev", "tier"])
def test_every_subcommand_has_help(command):
    assert "usage:" in bench(command, "--help").stdout


# --------------------------------------------------------------------------
# The modes that set up their own filesystems: softpath, meta, and the CPU
# figures of compare and lmcache.  Tiny scales; correctness, not speed.


def load_benchlib():
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_softpath
        import benchlib
    finally:
        sys.path.remove(str(TOOLS))
    return benchlib, bench_softpath


def leftovers(path):
    """Mounts and loop devices that still refer to anything under ``path``."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line for line in f if str(path) in line]
    loops = [line for line in subprocess.run(["losetup", "-a"], capture_output=True, text=True)
             .stdout.splitlines() if str(path) in line]
    return mounts + loops


def assert_torn_down(workdir):
    assert leftovers(workdir) == []
    assert [p.name for p in Path(workdir).iterdir() if p.name.startswith("kvfs-bench-")] == []


def assert_cpu_figure(fig):
    """A timed figure: positive speed, CPU not negative, CPU-s/GB = CPU / GB."""
    assert fig["seconds"] > 0
    assert fig["gbps"] > 0
    assert fig["gbps"] == pytest.approx(fig["bytes"] / fig["seconds"] / 1e9)
    assert fig["cpu_seconds"] >= 0  # /proc/stat counts in 10 ms ticks: a tiny section may read 0
    assert fig["cpu_s_per_gb"] == pytest.approx(fig["cpu_seconds"] / (fig["bytes"] / 1e9))


def test_softpath_reports_every_figure_and_tears_down(tmp_path):
    pytest.importorskip("torch")
    files, mib = 3, 2
    out = bench_json("softpath", "--files", files, "--file-mib", mib, "--repeat", 1,
                     "--workdir", tmp_path)
    _, softpath = load_benchlib()
    expected = files * mib * MiB

    assert out["config"]["bytes"] == expected
    assert len(out["runs"]) == 1
    run = out["runs"][0]
    assert sorted(run["order"]) == ["ext4", "kvfs"]
    for side in ("kvfs", "ext4"):
        for name in softpath.FIGURES:
            fig = run[side][name]
            assert fig["bytes"] == fig["expected_bytes"] == expected, (side, name)
            assert_cpu_figure(fig)
            if name != softpath.WRITE_PATH:
                assert fig["files_verified"] == files
            if name.startswith("cold"):
                # Cold means the device delivered every byte.
                assert fig["device_bytes_read"] >= expected, (side, name)
        assert run[side]["flush_after_write"]["seconds"] > 0
        # After the hot pass the first file's pages are cached (the test runs as root,
        # so the PFNs are readable), whichever folios hold them. Nearly all: the kernel
        # may reclaim some before they are counted (one CI run counted 510 of kvfs's
        # 512, beside another test; this VM also runs a DAMON "pageout" scheme).
        cache = run[side]["page_cache"]
        assert 0.9 * mib * MiB // 4096 <= cache["pages"] <= mib * MiB // 4096, side
        assert 0 <= cache["pages_in_large_folios"] <= cache["pages"], side
        # With --repeat 1 the medians are that one run.
        for name in softpath.FIGURES:
            assert out["medians"][side][name]["gbps"] == run[side][name]["gbps"]

    assert sorted(out["table"]) == sorted(softpath.FIGURES)
    for name, row in out["table"].items():
        assert row["speed_ratio"] == pytest.approx(row["kvfs_gbps"] / row["ext4_gbps"])
        if row["ext4_cpu_s_per_gb"]:
            assert row["cpu_ratio"] == pytest.approx(row["kvfs_cpu_s_per_gb"] / row["ext4_cpu_s_per_gb"])
    assert sorted(out["targets"]) == sorted(t[0] for t in softpath.TARGETS)
    for name, target in out["targets"].items():
        value = out["table"][target["figure"]][target["ratio"]]
        assert target["value"] == value
        if value is not None:
            want = value >= target["target"] if target["kind"] == "min" else value <= target["target"]
            assert target["met"] is want, name
    assert_torn_down(tmp_path)


def test_softpath_interrupted_still_tears_down(tmp_path):
    """Ctrl-C in the middle of a run leaves no mount and no loop device behind."""
    pytest.importorskip("torch")
    interrupt_once_running([BENCH, "softpath", "--files", "8", "--file-mib", "4", "--repeat", "3",
                            "--workdir", tmp_path], ["repeat 1/3: kvfs", "repeat 1/3: ext4"],
                           lambda: leftovers(tmp_path))
    assert_torn_down(tmp_path)


def test_softpath_cold_check_catches_a_warm_read(tmp_path):
    """The check that makes 'cold' honest fails when caches are not dropped."""
    benchlib, softpath = load_benchlib()

    class NoDrop(softpath.Side):
        def drop_caches(self):
            pass  # what a benchmark that forgot to drop would do

    with benchlib.Teardown() as teardown:
        dev, _ = benchlib.ext4_on_loop(teardown, tmp_path / "img", 256 * MiB, tmp_path / "mnt")
        side = NoDrop("ext4", str(tmp_path / "mnt"), loop_dev=dev)
        contents = [benchlib.aligned_buffer(MiB) for _ in range(2)]
        for index, buf in enumerate(contents):
            benchlib.fill_random(buf, index)
        expected = [benchlib.content_hash(buf) for buf in contents]
        buffers = [benchlib.aligned_buffer(MiB) for _ in range(2)]
        with pytest.raises(softpath.ColdCheckFailed):
            softpath.run_side(side, [memoryview(b) for b in contents], expected, buffers, MiB)
        # And a wrong expected hash is caught as a content mismatch.
        paths = side.paths(1)
        with open(paths[0], "wb") as f:
            f.write(contents[0])
        with pytest.raises(softpath.ContentMismatch):
            softpath.read_pass(paths, buffers, MiB, 1, False)
            softpath.verify(paths, buffers[:1], MiB, [expected[1]])
    assert leftovers(tmp_path) == []


META_RATES = ["create_write_close", "stat", "stat_again", "cold_lookup_hit", "cold_lookup_miss", "unlink",
              "list_create", "list_cold", "list_warm"]


def test_meta_reports_every_figure_and_tears_down(tmp_path):
    files, size, dirs, entries, sample = 60, 10_000, 3, 40, 5
    out = bench_json("meta", "--files", files, "--size", size, "--dirs", dirs, "--list-entries", entries,
                     "--sample", sample, "--workdir", tmp_path)

    assert out["config"]["files"] == files
    for side in ("kvfs", "ext4"):
        result = out[side]
        assert result["bytes_written"] == result["expected_bytes"] == files * size
        for name in META_RATES:
            fig = result[name]
            assert fig["count"] == (entries if name.startswith("list") else files), (side, name)
            assert fig["seconds"] > 0 and fig["per_s"] > 0, (side, name)
            assert fig["per_s"] == pytest.approx(fig["count"] / fig["seconds"])
            assert fig["cpu_seconds"] >= 0
        assert result["stat"]["bytes_counted"] == result["stat_again"]["bytes_counted"] == files * size
        assert result["cold_lookup_hit"]["found"] == files
        assert result["cold_lookup_miss"]["found"] == 0
        assert result["files_after_remount"] == files
        assert result["sample_verified"] == sample
        assert result["umount_seconds"] > 0 and result["remount_seconds"] > 0
    assert out["ext4"]["cold_lookup_hit"]["device_bytes_read"] >= 0

    kvfs = out["kvfs"]
    assert kvfs["stat_again"]["daemon_requests"] == 0, "the kernel answers repeated stats itself"
    memory = kvfs["memory"]
    assert memory["after_remount"]["pid"] != memory["before_umount"]["pid"], "remount starts a new daemon"
    for point in ("at_start", "after_writes", "before_umount", "after_remount", "at_end"):
        assert memory[point]["rss_mib"] > 0
        assert memory[point]["hwm_mib"] >= memory[point]["rss_mib"]
        assert kvfs["rss"][f"{point}_mib"] == memory[point]["rss_mib"]
    assert memory["after_writes"]["metadata_bytes"] > memory["at_start"]["metadata_bytes"]
    probe = kvfs["checkpoint_probe"]
    assert probe["checkpoints_written"] == 1
    assert probe["probes"] > 0 and probe["baseline_probes"] > 0
    assert probe["max_latency_ms"] >= probe["p99_latency_ms"] >= probe["median_latency_ms"] > 0
    assert "checkpoint_probe" not in out["ext4"]

    for name in META_RATES:
        assert out["ratios"][f"{name}_kvfs_over_ext4"] == pytest.approx(
            kvfs[name]["per_s"] / out["ext4"][name]["per_s"])
    targets = out["targets"]
    assert targets["at_goal_scale"] is False
    assert targets["checkpoint_max_latency_ms"]["value"] == probe["max_latency_ms"]
    assert targets["stat_kvfs_over_ext4"]["value"] == out["ratios"]["stat_kvfs_over_ext4"]
    assert all(t["met"] is not None for name, t in targets.items() if name != "at_goal_scale")
    assert_torn_down(tmp_path)


def test_compare_reports_cpu_per_gb_for_every_figure(tmp_path):
    pytest.importorskip("torch")
    out = bench_json("compare", "--chunks", 2, "--chunk-mib", 1, "--repeat", 1,
                     "--filesystems", "kvfs,ext4,fio", "--workdir", tmp_path)
    for fs in ("kvfs", "ext4", "fio"):
        medians = out["medians"][fs]
        speeds = [key for key in medians if key.endswith("_gbps")]
        assert speeds
        for key in speeds:
            cpu = medians[key[:-len("_gbps")] + "_cpu_s_per_gb"]
            assert cpu is not None and cpu >= 0, (fs, key)
    assert_torn_down(tmp_path)


def test_lmcache_compares_odirect_with_odirect(tmp_path):
    pytest.importorskip("lmcache")
    out = bench_json("lmcache", "--chunks", 1, "--store-size", "2G", "--workdir", tmp_path)
    assert out["config"]["modes"] == ["buffered", "odirect"]
    ratios = out["ratios"]
    for name, (kvfs_mode, ext4_mode) in {
            "retrieve_kvfs_buffered_over_ext4_buffered": ("buffered", "buffered"),
            "retrieve_kvfs_odirect_over_ext4_odirect": ("odirect", "odirect"),
            "retrieve_kvfs_odirect_over_ext4_buffered": ("odirect", "buffered")}.items():
        kvfs, ext4 = out["kvfs"][kvfs_mode], out["ext4"][ext4_mode]
        assert kvfs["use_odirect"] == (kvfs_mode == "odirect")
        assert ext4["use_odirect"] == (ext4_mode == "odirect")
        assert ratios[name]["value"] == pytest.approx(kvfs["retrieve_gbps"] / ext4["retrieve_gbps"])
        assert kvfs["retrieve_cpu_s_per_gb"] >= 0
    assert_torn_down(tmp_path)


def test_page_cache_folios_counts_only_cached_pages(tmp_path):
    """The folio probe reports a file's cached pages and maps in nothing that is not cached."""
    benchlib, _ = load_benchlib()
    path = tmp_path / "probe"
    if benchlib.mount_info(str(tmp_path))[1] in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages cannot be dropped from the page cache")
    path.write_bytes(os.urandom(1024 * 4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        # Drop the file's pages, then bring back exactly the first 8.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 8 * 4096, 0)
    finally:
        os.close(fd)
    found = benchlib.page_cache_folios(str(path))
    assert found is not None
    # Readahead may add some past the 8 (a window of a few hundred KiB at most):
    # never fewer than 8, never all 1024 (no probe read through the mapping may
    # fault one in).
    assert 8 <= found["pages"] < 1024
    assert 0 <= found["pages_in_large_folios"] <= found["pages"]
    assert benchlib.page_cache_folios(str(tmp_path / "missing")) is None
