"""Named crash points (kvfs/base/crashpoints.py, issue 12): the daemon dies at each one, and recovery holds.

For every point in CRASH_POINTS: mkfs, mount, write a durable base (fsynced
files, unfsynced files, deduplicated copies, a rename target, eviction
victims), unmount, mount again with $KVFS_TEST_CRASH naming the point, run a
workload that reaches it, and see the daemon die there (its log says so). Then,
without the hook: fsck is clean on the crashed store, the remount shows every
file as the oracle (tests/crash_oracle.py) allows (fsynced files byte for byte,
others absent or one complete content that a close or fsync produced), the
daemon's block accounting equals what the surviving files need, and the
point's own promise holds (a rename leaves the old or the new target, never
neither; the other deduplicated copies stay intact; ...). The store ends clean
after a normal unmount too.
"""
import ast
import dataclasses
import os
import random
import re
from pathlib import Path

import pytest

from crash_oracle import Oracle, Workload, check_after_remount, dead
from kvfs.base.crashpoints import CRASH_POINTS, ENV
from kvfsmount import run_tool

BS = 64 << 10
KVFS = Path(__file__).resolve().parent.parent / "kvfs"


def blob(seed, n):
    """``n`` pseudo-random bytes, the same for the same seed (different seeds never share a block)."""
    return random.Random(seed).randbytes(n)


DUP = blob(7, 2 * BS + 1000)                   # three identical copies share these blocks


def base(w):
    """The durable starting point every scenario builds on (made durable by the unmount)."""
    w.put("a", blob(1, 3 * BS + 500), fsync=True)
    w.put("b", blob(2, BS + 100))
    w.put("target", blob(3, 2 * BS + 7), fsync=True)
    w.put("unlinkme", blob(4, 2 * BS))
    for name in ("dup1", "dup2", "dup3"):
        w.put(name, DUP)
    w.put("dup-partial", DUP[:BS] + blob(8, 1000))    # shares the first block only
    for i in range(3):
        w.put(f"v{i}", blob(10 + i, BS + 300 * i))
    w.put("empty", b"")


# -- what each scenario does once the point is armed --------------------------------------

def rewrite_a_fsync(w, fs):
    w.put("a", blob(21, 5 * BS + 123), fsync=True)


def torn_frame(w, fs):
    # Many records, so that the frame spans several sectors: names of 100 bytes make
    # the 60 creates alone about 9 KiB. (With short names the frame was several
    # sectors only if the small files' content records, which their background
    # seals append, were in it too: when the request loop ran ahead of the seals,
    # the frame fit in one sector and its first half held all of it.)
    for i in range(60):
        w.put(f"torn{i:02d}-" + "n" * 94, blob(100 + i, 300 + i))
    w.put("a", blob(21, BS), fsync=True)


def checkpoint_after_changes(w, fs):
    w.put("c1", blob(30, BS + 1), fsync=True)
    w.put("a", blob(31, 2 * BS), fsync=True)
    w.remove("unlinkme")
    w.sync_dir()
    fs.generation_before = fs.stats()["generation"]
    fs.admin("checkpoint", fs.mnt, check=False)


def unlink_then_commit(w, fs):
    w.put("w", blob(40, BS + 5))
    w.remove("unlinkme")
    fd = os.open(w.path("w"), os.O_RDONLY)
    try:
        os.fsync(fd)                           # the commit whose frame frees unlinkme's extents
    finally:
        os.close(fd)


def evict_three(w, fs):
    for i in range(3):
        w.oracle.may_vanish(f"v{i}")
    fs.admin("evict", fs.mnt, *(w.path(f"v{i}") for i in range(3)), check=False)


def rename_fsynced_source(w, fs):
    w.put("tmp", blob(50, 3 * BS), fsync=True)
    w.rename("tmp", "target")


def rename_twice(w, fs):
    w.put("tmp1", blob(51, BS + 9))
    w.rename("tmp1", "target")
    w.sync_dir()
    w.put("tmp2", blob(52, 2 * BS + 9))
    w.rename("tmp2", "target")


def unlink_two_copies(w, fs):
    w.remove("dup1")
    w.sync_dir()
    w.remove("dup2")


def big_rewrite_under_pressure(w, fs):
    w.put("a", blob(60, 32 * BS + 11))


# -- what must hold after the remount, beyond the oracle -------------------------------------

def old(name, seed, n):
    def check(files, fs):
        assert files.get(name) == blob(seed, n), f"{name} is not its old durable content"
    return check


def nothing_of(*prefixes):
    def check(files, fs):
        left = [n for n in files if n.startswith(prefixes)]
        assert not left, f"files whose records never became durable came back: {left}"
    return check


def all_of(*checks):
    def check(files, fs):
        for c in checks:
            c(files, fs)
    return check


def checkpointed(files, fs):
    assert files["c1"] == blob(30, BS + 1) and files["a"] == blob(31, 2 * BS)
    assert "unlinkme" not in files


def new_checkpoint_used(files, fs):
    checkpointed(files, fs)
    assert fs.stats()["generation"] == fs.generation_before + 1, "the new checkpoint was not the one loaded"


def frees_durable(files, fs):
    assert "unlinkme" not in files and files["w"] == blob(40, BS + 5)


def victims(present):
    def check(files, fs):
        for i in range(3):
            name = f"v{i}"
            if present:
                assert files.get(name) == blob(10 + i, BS + 300 * i), f"{name} lost before its eviction was durable"
            else:
                assert name not in files, f"{name} is back although its eviction was durable"
        assert files["a"] == blob(1, 3 * BS + 500)
    return check


def rename_not_done(files, fs):
    assert files["target"] == blob(3, 2 * BS + 7), "the rename target is not its old content"
    assert files["tmp"] == blob(50, 3 * BS), "the fsynced rename source is gone"


def first_rename_kept(files, fs):
    assert files["target"] == blob(51, BS + 9), "the committed rename was lost"
    assert "tmp1" not in files and "tmp2" not in files


def copies(files, fs):
    assert "dup1" not in files, "the committed unlink came back"
    assert files["dup3"] == DUP and files["dup-partial"][:BS] == DUP[:BS]
    assert files.get("dup2", DUP) == DUP


@dataclasses.dataclass
class Scenario:
    crash: str                  # what KVFS_TEST_CRASH says ("name" or "name@N")
    trigger: object             # (Workload, KvfsMount) -> runs until the daemon dies
    check: object               # (files after remount, KvfsMount) -> asserts the point's own promise
    options: tuple = ()
    slow_writes: float = 0.0


SCENARIOS = {
    "block-written": Scenario("block-written@3", rewrite_a_fsync, old("a", 1, 3 * BS + 500)),
    "commit-data-synced": Scenario("commit-data-synced", rewrite_a_fsync, old("a", 1, 3 * BS + 500)),
    "torn-frame": Scenario("torn-frame", torn_frame, all_of(old("a", 1, 3 * BS + 500), nothing_of("torn"))),
    "checkpoint-payload-written": Scenario("checkpoint-payload-written", checkpoint_after_changes, checkpointed),
    "checkpoint-header-written": Scenario("checkpoint-header-written", checkpoint_after_changes,
                                          new_checkpoint_used),
    "frees-discarded": Scenario("frees-discarded", unlink_then_commit, frees_durable),
    "evict-file-removed": Scenario("evict-file-removed@2", evict_three, victims(present=True)),
    "evict-committed": Scenario("evict-committed", evict_three, victims(present=False)),
    "rename-source-sealed": Scenario("rename-source-sealed", rename_fsynced_source, rename_not_done),
    "rename-replaced": Scenario("rename-replaced@2", rename_twice, first_rename_kept),
    "dedup-unlink": Scenario("dedup-unlink@2", unlink_two_copies, copies),
    "flush-backpressure": Scenario("flush-backpressure@3", big_rewrite_under_pressure,
                                   old("a", 1, 3 * BS + 500), options=("dirty_limit=256K",),
                                   slow_writes=0.01),
}


def test_every_crash_point_has_a_scenario_and_is_in_the_code():
    assert set(SCENARIOS) == set(CRASH_POINTS)
    called = set()
    for path in KVFS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    in ("crashpoint", "reached") and node.args and isinstance(node.args[0], ast.Constant)):
                called.add(node.args[0].value)
    assert called <= set(CRASH_POINTS), f"the code names unregistered crash points: {called - set(CRASH_POINTS)}"
    assert set(CRASH_POINTS) <= called, f"registered crash points nothing calls: {set(CRASH_POINTS) - called}"


@pytest.mark.parametrize("point", sorted(CRASH_POINTS))
def test_crash_point(point, kvfs_factory):
    scenario = SCENARIOS[point]
    fs = kvfs_factory(size="256M", block_size="64K", faults=[],
                      mount_options=["commit_interval=60", *scenario.options])
    fs.mkfs()
    fs.mount()
    oracle = Oracle()
    w = Workload(fs.mnt, oracle)
    base(w)
    fs.umount()
    oracle.flushed_all()
    if scenario.slow_writes:
        fs.set_faults([{"op": "write", "effect": "delay", "seconds": scenario.slow_writes}])
    fs.mount(crash=scenario.crash)
    try:
        scenario.trigger(w, fs)
    except OSError as exc:
        assert dead(exc), f"the workload failed other than by the daemon's death: {exc!r}"
    fs.wait_crashed(point, timeout=20)
    fs.set_faults([])

    proc = fs.fsck()                            # the crashed store, as it is
    assert proc.returncode == 0, f"fsck of the crashed store:\n{proc.stdout}\n{proc.stderr}"
    if point == "torn-frame":
        assert "torn frame (payload checksum mismatch)" in proc.stdout, proc.stdout
    fs.mount()
    torn, lost, files = check_after_remount(fs, oracle, BS)
    assert not torn and not lost, f"torn: {torn}\nlost: {lost}"
    scenario.check(files, fs)
    fs.umount()                                 # the fixture's teardown checks fsck once more


def test_unknown_or_malformed_crash_point_refuses_to_mount(kvfs_factory):
    fs = kvfs_factory(size="256M", block_size="64K")
    fs.mkfs()
    for value, says in (("no-such-point", "unknown crash point 'no-such-point'"),
                        ("torn-frame@0", "must be a positive integer"),
                        ("torn-frame@x", "must be a positive integer")):
        proc = run_tool("mount", fs.device, fs.mnt, "-o", f"log={fs.log}", check=False, env={ENV: value})
        assert proc.returncode == 1, proc
        assert says in proc.stderr and ENV in proc.stderr, proc.stderr
        assert not fs.mounted
        if value == "no-such-point":
            assert re.search(r"known: .*torn-frame", proc.stderr), proc.stderr


def test_crash_in_the_checkpoint_after_replay_replays_again(kvfs_factory):
    """Mount folds a replayed journal into a checkpoint before it serves; dying there
    (the new payload over the older slot, no header) leaves the journal to replay again."""
    fs = kvfs_factory(size="256M", block_size="64K", mount_options=["commit_interval=60"])
    fs.mkfs()
    fs.mount()
    oracle = Oracle()
    w = Workload(fs.mnt, oracle)
    base(w)
    fs.umount()
    oracle.flushed_all()
    fs.mount()
    w.put("late", blob(70, 2 * BS + 3), fsync=True)      # in the journal only
    w.remove("unlinkme")
    w.sync_dir()
    fs.kill9()
    with pytest.raises(AssertionError, match="exited before the mount was live"):
        fs.mount(crash="checkpoint-payload-written")
    # mount.kvfs took away the dead FUSE mount the daemon left (no fusermount3 -uz needed).
    assert f" {fs.mnt} " not in open("/proc/self/mounts").read(), "a dead FUSE mount was left behind"
    said = "crash point 'checkpoint-payload-written' reached"
    assert said in fs.log.read_text(), "the daemon did not die in the checkpoint after replay"
    fs.assert_fsck_clean()
    fs.mount()
    torn, lost, files = check_after_remount(fs, oracle, BS)
    assert not torn and not lost, f"torn: {torn}\nlost: {lost}"
    assert files["late"] == blob(70, 2 * BS + 3) and "unlinkme" not in files
    fs.umount()
