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


@pytest.mark.parametrize("command", ["write", "read", "compare", "lmcache"])
def test_every_subcommand_has_help(command):
    assert "usage:" in bench(command, "--help").stdout
