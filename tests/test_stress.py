"""A bounded concurrency stress test through a real mount, with an oracle (issue 12, "Concurrency").

Seventeen workers (tests/stress_workers.py) run for a fixed time on eight
overlapping names in two directories of a store with 64 KiB blocks, a 2 MiB
cache and a 1 MiB dirty limit (so writers wait for flushes and reads go to the
device): publishers write a new content to a temp file and rename it over a
name, rewriters rewrite a name in place with O_TRUNC (write-only descriptors
are direct_io, read-write ones go through the page cache), unlinkers,
renamers between the names (across the directories too), fsyncs of files and
directories, buffered readers, O_DIRECT readers with aligned buffers, mmap
readers, and a worker that empties the daemon's clean cache or flushes it.
Contents repeat (whole-file and per-block dedup) and most sizes are not block
multiples. tests/stress_oracle.py says what each read may return (its
docstring is the precise rule for O_TRUNC rewrites); any other result, an
ENOENT on a name that was never absent, a short write, or an unexpected
outcome of a rename or unlink fails the test with the name, offset, expected
and read bytes.

No operation may take longer than stress_workers.OP_LIMIT: a hang fails the
test with each stuck worker's operation, its kernel and Python stacks and the
daemon threads' wait channels, and then aborts the FUSE connection.

Afterwards: every name holds exactly its last content; the block statistics
(unique blocks, used bytes, logical bytes, files) equal what the surviving
files need; umount, fsck clean (refcounts against the namespace), remount,
the same again.

``test_stress[plain]`` runs 45 s, ``test_stress[native]`` 30 s with the native
read plane on, ``test_stress[faults]`` 30 s with the fault-injecting device at a low rate (read delays, read EIO and short reads
that io_retry absorbs, write delays): readers must never see EIO, wrong bytes
or short reads, and no block may fail its checksum. One JSON summary line per
run (``pytest -s``) gives the operations by kind and the faults injected. For
a longer manual run set
``KVFS_STRESS_SECONDS`` (both runs), and ``KVFS_STRESS_SEED`` to vary the workload::

    KVFS_STRESS_SECONDS=1800 .venv/bin/python -m pytest -x -q -s tests/test_stress.py
"""
import os
import time

import pytest

from stress_oracle import content
from stress_workers import DIRS, NAMES, Stress

SECONDS = os.environ.get("KVFS_STRESS_SECONDS")
SEED = int(os.environ.get("KVFS_STRESS_SEED", "20250612"))
# mmp_interval: kvfsmount's 0.25 s heartbeat fences a daemon whose heartbeat is 3.5 s
# overdue. In one CI run the faults stress had operations take up to 7.8 s (0.3 s when
# run alone) while the other worker's test drove the same disk, a heartbeat came 3.56 s
# late, and the daemon fenced itself mid-run (EROFS): MMP doing its job, on a stall this
# test does not mean to judge (tests/test_mmp_mounted.py does). 2 s allows 10.5 s; each
# mount then waits 4 s to claim the store.
OPTIONS = ["cache_size=2M", "dirty_limit=1M", "eviction_policy=none", "mmp_interval=2"]
LOW_FAULT_RATE = {"seed": 12, "rules": [
    {"op": "read", "effect": "delay", "seconds": 0.02, "probability": 0.05},
    {"op": "read", "effect": "eio", "probability": 0.01},
    {"op": "read", "effect": "short", "probability": 0.01},
    {"op": "write", "effect": "delay", "seconds": 0.01, "probability": 0.1},
]}


def align_up(n, to=4096):
    return -(-n // to) * to


def expected_space(final, bs):
    """(unique blocks, used bytes, logical bytes) that the files in ``final`` need."""
    blocks = {(seed, i, min(bs, length - i * bs)) for seed, length in final.values()
              for i in range(-(-length // bs))}
    # A block of zeros is a hole, not stored (a one-byte tail can be the zero low byte of a word).
    blocks = {(seed, i, n) for seed, i, n in blocks if any(content(seed, i * bs + n)[i * bs:])}
    return len(blocks), sum(align_up(n) for _, _, n in blocks), sum(length for _, length in final.values())


def verify(fs, final, bs, when, *, space=True):
    listed = {f"{d}/{n}" for d in DIRS for n in os.listdir(fs.mnt / d)}
    assert listed == set(final), f"{when}: names {sorted(listed)}, expected {sorted(final)}"
    for name, spec in final.items():
        got = (fs.mnt / name).read_bytes()
        assert got == content(*spec), f"{when}: {name} is not its last content {spec} ({len(got)} bytes)"
    if not space:
        return
    stats = fs.stats()
    unique, used, logical = expected_space(final, bs)
    figures = {k: stats[k] for k in ("unique_blocks", "used_bytes", "logical_bytes", "files")}
    assert figures == {"unique_blocks": unique, "used_bytes": used, "logical_bytes": logical,
                       "files": len(final)}, (f"{when}: statistics {figures} disagree with the files "
                                              f"present: {unique} unique blocks, {used} bytes used, "
                                              f"{logical} logical, {len(final)} files: {final}")
    assert set(final) <= set(NAMES)


def abort_connection(fs, conn):
    """Unblock every system call stuck in this mount, then clean up like an operator."""
    try:
        with open(f"/sys/fs/fuse/connections/{conn}/abort", "w") as f:
            f.write("1")
    except OSError:
        pass
    fs.kill9()


@pytest.mark.parametrize("faulty, seconds, native", [
    pytest.param(False, 45, False, id="plain"),     # 90 and 60 s took CI past 30 minutes
    pytest.param(True, 30, False, id="faults"),
    # The native read plane answers the READs of sealed files (kvfs/fuse/readplane.c);
    # the fault-injecting device keeps reads in Python, so it runs without faults.
    pytest.param(False, 30, True, id="native"),
])
def test_stress(kvfs_factory, faulty, seconds, native):
    seconds = float(SECONDS or seconds)
    options = OPTIONS + (["io_retry=3"] if faulty else []) + (["native_reads=on"] if native else [])
    fs = kvfs_factory(size="4G", block_size="64K", mount_options=options,
                      faults=LOW_FAULT_RATE if faulty else None)
    fs.mkfs()
    fs.mount()
    bs = fs.stats()["block_size"]
    conn = os.minor(os.stat(fs.mnt).st_dev)
    stress = Stress(fs.mnt, bs, seconds, SEED + faulty)
    t0 = time.monotonic()
    hang = stress.run(fs.pid, lambda: abort_connection(fs, conn))
    elapsed = time.monotonic() - t0
    assert hang is None, "a worker hung:\n" + hang
    stats = fs.stats()
    extra = {"eio_seen_by_readers": stress.counts["read_eio"],
             "faults_injected": stats.get("faults_injected", {}),
             "device_io_retries": stats["device_io_retries"], "corrupt_reads": stats["corrupt_reads"],
             "writers_throttled": stats["writers_throttled"], "dedup_hits": stats["dedup_hits"],
             **{k: stats.get(k) for k in ("kernel_page_drops", "kernel_page_drops_late",
                                          "kernel_page_drops_last_late", "kernel_page_drops_failed")}}
    print(stress.summary("faults" if faulty else "native" if native else "plain", elapsed, extra))
    assert not stress.failures, (f"{len(stress.failures)} failure(s), the first ones:\n"
                                 + "\n".join(stress.failures[:5]))
    # No bit flips in the plan: a checksum failure would be a block read from the wrong place.
    assert stats["corrupt_reads"] == 0, stats
    # Every kind of operation ran often enough for the run to mean something.
    for kind in ("publish_rename", "rewrite_o_trunc", "unlink", "rename", "fsync", "read_buffered",
                 "read_o_direct", "read_mmap"):
        assert stress.counts[kind] >= 20, dict(stress.counts)
    if faulty:
        assert all(stats["faults_injected"][k] > 0 for k in ("delay", "eio", "short")), stats
    if native:      # the plane served and withdrew, and nothing failed its check
        assert stats["native_reads"] > 0 and stats["native_withdrawals"] > 0, stats
        assert stats["native_verify_failures"] == 0, stats
    final = stress.history.final()
    assert final, "the run left no file at all"
    fs.flush()
    # Unlinked files the kernel still remembers keep their blocks until it forgets
    # them, so the space figures are compared only after the remount.
    verify(fs, final, bs, "after the run", space=False)
    fs.umount()
    fs.assert_fsck_clean()
    if faulty:
        fs.set_faults([])
    fs.mount()
    verify(fs, final, bs, "after umount, fsck and mount")


