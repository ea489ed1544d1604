"""fsck repairs and the command-line tools' errors, through real mounts and the real tools.

Found in the review of issue 7; the sections below keep its item numbers.
5: fsck --repair removes a damaged file under any (non-UTF-8) name in one pass, never
   turning it into zeros. 8: a store whose durable state proves a newer generation
   existed is refused by mount, reported by fsck, and salvaged by --repair. 9: bad
   option values are refused with one line before anything is created or mounted, and
   no command prints an ExceptionGroup or a traceback. 13: absolute device paths, and
   one fsck output format.
"""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs import schema as fmt
from kvfsmount import TEST_MMP_INTERVAL, run_tool

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
FSCK_PREFIXES = ("note: ", "PROBLEM: ", "repaired: ", "lost: ", "STILL BROKEN: ")


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


def put(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def corrupt_where(store, needle):
    """Flip one byte of the only place ``needle`` occurs in the store file."""
    with open(store, "r+b") as dev:
        blob = dev.read()
        at = blob.find(needle)
        assert at > 0 and blob.find(needle, at + 1) == -1
        dev.seek(at)
        dev.write(bytes([blob[at] ^ 0xFF]))


def flip(store, off):
    with open(store, "r+b") as dev:
        dev.seek(off)
        old = dev.read(1)
        dev.seek(off)
        dev.write(bytes([old[0] ^ 0xFF]))


def superblock(store):
    with open(store, "rb") as f:
        return fmt.Superblock.decode(f.read(fmt.SECTOR))


def journal_frames(store):
    """(offset, generation, seq, payload_len) of the replayable frame chain at the journal start."""
    sb = superblock(store)
    frames, cursor = [], 0
    with open(store, "rb") as f:
        while True:
            f.seek(sb.journal_off + cursor)
            header = fmt.decode_journal_header(f.read(fmt.SECTOR), sb.hash_seed)
            if header is None or (frames and header[:2] != (frames[-1][1], frames[-1][2] + 1)):
                return frames
            frames.append((cursor, header[0], header[1], header[2]))
            cursor += fmt.frame_size(header[2])


def assert_one_line(proc, *phrases):
    err = proc.stderr
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert "Traceback" not in err and "ExceptionGroup" not in err and "Exceptions from Trio" not in err
    for phrase in phrases:
        assert phrase in err, err


def assert_fsck_format(proc):
    """One output format: nothing on stderr, every stdout line but the verdict has its kind prefix."""
    assert proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines
    for line in lines[:-1]:
        assert line.startswith(FSCK_PREFIXES), line
    assert not lines[-1].startswith(FSCK_PREFIXES)


# -- item 5 -------------------------------------------------------------------

def test_repair_removes_damaged_files_under_non_utf8_names_in_one_pass(kvfs_factory):
    fs = kvfs_factory(size="256M")
    fs.mkfs()
    fs.mount()
    mnt = bytes(fs.mnt)
    latin1 = "naïve".encode("latin-1")
    victims = {b"\xff\xfe/victim": 1, "café".encode() + b"/" + latin1: 2, b"\xff/sub/victim": 3}
    bystanders = {b"\xff\xfe/keep": 11, "café".encode() + b"/ok": 12, b"\xff/sub/keep": 13, b"plain": 14}
    for d in (b"\xff\xfe", "café".encode(), b"\xff", b"\xff/sub"):
        os.mkdir(os.path.join(mnt, d))
    for name, seed in {**victims, **bystanders}.items():
        put(os.path.join(mnt, name), pattern(seed, 2 * MiB + 5000))
    os.link(os.path.join(mnt, b"\xff/sub/victim"), os.path.join(mnt, b"\xff\xfe/victim-link"))
    fs.umount()
    for seed in victims.values():
        corrupt_where(fs.device, pattern(seed, 2 * MiB + 5000)[MiB + 8192:MiB + 8192 + 64])

    check = fs.fsck()
    assert check.returncode == 1
    assert_fsck_format(check)
    for shown in ("/\\xff\\xfe/victim", "/café/na\\xefve", "/\\xff/sub/victim", "/\\xff\\xfe/victim-link"):
        assert f"PROBLEM: {shown}: has corrupt blocks" in check.stdout, check.stdout

    repaired = fs.fsck("--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert_fsck_format(repaired)
    assert repaired.stdout.count("repaired: removed damaged file") == 3, repaired.stdout
    assert "STILL BROKEN" not in repaired.stdout
    assert "leaked" not in repaired.stdout and "reference count" not in repaired.stdout
    assert "now checks clean" in repaired.stdout.splitlines()[-1]
    fs.assert_fsck_clean()

    fs.mount()
    for name in [*victims, b"\xff\xfe/victim-link"]:
        assert not os.path.lexists(os.path.join(mnt, name)), name     # gone, not zeros
    for name, seed in bystanders.items():
        with open(os.path.join(mnt, name), "rb") as f:
            assert f.read() == pattern(seed, 2 * MiB + 5000), name


# -- item 8 -------------------------------------------------------------------

def _newer_checkpoint_then_frame(fs):
    """Gen 2 in slot B, gen 3 in slot A, then a gen-3 journal frame with flushed files; crash."""
    fs.mkfs()
    fs.mount()
    fs.admin("checkpoint", fs.mnt)                                  # generation 2, slot B
    put(fs.mnt / "in-gen3-checkpoint", pattern(21, MiB + 17))
    fs.admin("checkpoint", fs.mnt)                                  # generation 3, slot A
    put(fs.mnt / "in-gen3-journal", pattern(22, 3 * MiB + 99))
    (fs.mnt / "dir-in-journal").mkdir()
    put(fs.mnt / "dir-in-journal" / "f", pattern(23, 100))
    fs.flush()                                                      # generation-3 frames
    assert fs.stats()["generation"] == 3
    fs.kill9()
    frames = journal_frames(fs.device)
    assert frames and {g for _, g, _, _ in frames} == {3}


def test_corrupt_newest_checkpoint_is_refused_reported_and_salvaged(kvfs_factory):
    fs = kvfs_factory(size="256M")
    _newer_checkpoint_then_frame(fs)
    sb = superblock(fs.device)
    flip(fs.device, sb.checkpoint_a_off + fmt.SECTOR + 3)           # one byte of slot A's payload

    mount = run_tool("mount", fs.device, fs.mnt, check=False)
    assert mount.returncode != 0 and not fs.mounted
    assert_one_line(mount, "generation 3", "fsck.kvfs --repair")

    check = fs.fsck()
    assert check.returncode == 1
    assert_fsck_format(check)
    assert "PROBLEM: checkpoint slot A holds generation 3" in check.stdout, check.stdout

    repaired = fs.fsck("--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert_fsck_format(repaired)
    assert "lost: changes made between checkpoint generation 2 and generation 3" in repaired.stdout
    assert "wrote checkpoint generation 4" in repaired.stdout
    fs.assert_fsck_clean()

    fs.mount()
    # The gen-3 frames applied on top of generation 2; the gen-3 checkpoint's own file is lost.
    assert (fs.mnt / "in-gen3-journal").read_bytes() == pattern(22, 3 * MiB + 99)
    assert (fs.mnt / "dir-in-journal" / "f").read_bytes() == pattern(23, 100)
    assert not (fs.mnt / "in-gen3-checkpoint").exists()
    put(fs.mnt / "after", b"still writable")
    fs.remount()
    assert (fs.mnt / "after").read_bytes() == b"still writable"
    assert (fs.mnt / "in-gen3-journal").read_bytes() == pattern(22, 3 * MiB + 99)


def test_corrupt_committed_journal_frame_is_refused_and_later_frames_salvaged(kvfs_factory):
    fs = kvfs_factory(size="256M")
    fs.mkfs()
    fs.mount()
    put(fs.mnt / "first", pattern(31, MiB))
    fs.flush()
    put(fs.mnt / "second", pattern(32, MiB + 1))
    fs.flush()
    fs.kill9()
    frames = journal_frames(fs.device)
    assert len(frames) >= 2
    sb = superblock(fs.device)
    off, generation, seq, length = frames[0]
    flip(fs.device, sb.journal_off + off + fmt.JOURNAL_FRAME.size + length // 2)

    mount = run_tool("mount", fs.device, fs.mnt, check=False)
    assert mount.returncode != 0 and not fs.mounted
    assert_one_line(mount, "journal frame 0", "fsck.kvfs --repair")
    check = fs.fsck()
    assert check.returncode == 1 and "PROBLEM: journal frame 0 of generation 1 is corrupt" in check.stdout

    repaired = fs.fsck("--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert_fsck_format(repaired)
    assert "lost: 1 corrupt journal frame(s)" in repaired.stdout
    fs.assert_fsck_clean()
    fs.mount()
    assert (fs.mnt / "second").read_bytes() == pattern(32, MiB + 1)
    assert not (fs.mnt / "first").exists()                # its records were in the lost frame


def test_torn_last_frame_is_still_dropped_silently(kvfs_factory):
    fs = kvfs_factory(size="256M")
    fs.mkfs()
    fs.mount()
    put(fs.mnt / "kept", pattern(41, MiB))
    fs.flush()
    put(fs.mnt / "torn", pattern(42, MiB))
    fs.flush()
    fs.kill9()
    frames = journal_frames(fs.device)
    off, _, _, length = frames[-1]
    flip(fs.device, superblock(fs.device).journal_off + off + fmt.JOURNAL_FRAME.size + length // 2)
    check = fs.fsck()
    assert check.returncode == 0, check.stdout
    assert "torn frame" in check.stdout
    fs.mount()
    assert (fs.mnt / "kept").read_bytes() == pattern(41, MiB)


# -- item 9 -------------------------------------------------------------------

@pytest.mark.parametrize("args, phrase", [
    (["--size", "64M", "--block-size", "100K"], "block size must be a power of two"),
    (["--size", "64M", "--block-size", "32M"], "block size must be a power of two"),
    (["--size", "10M"], "device too small"),
])
def test_mkfs_with_bad_values_leaves_no_file(tmp_path, args, phrase):
    store = tmp_path / "new.kvfs"
    proc = run_tool("mkfs", *args, store, check=False)
    assert proc.returncode == 1
    assert_one_line(proc, "mkfs.kvfs: ", phrase)
    assert not store.exists()


def test_mkfs_refuses_a_too_small_resize_without_touching_the_file(tmp_path):
    store = tmp_path / "old.kvfs"
    run_tool("mkfs", "--size", "64M", store)
    before = store.read_bytes()
    proc = run_tool("mkfs", "--force", "--size", "10M", store, check=False)
    assert proc.returncode == 1
    assert_one_line(proc, "device too small")
    assert store.read_bytes() == before


@pytest.mark.parametrize("option, phrase", [
    ("commit_interval=-1", "commit_interval"),
    ("commit_interval=nan", "commit_interval"),
    ("commit_interval=inf", "commit_interval"),
    ("commit_interval=0", "commit_interval"),
    ("commit_interval=soon", "not a number"),
    ("read_depth=0", "positive"),
    ("flush_workers=-2", "positive"),
    ("max_tasks=1.5", "whole number"),
    ("cache_size=0", "cache_size"),
    ("cache_size=lots", "invalid size"),
    ("dirty_limit=2G,cache_size=1G", "exceeds"),
    ("write_delay_ms=-5", "write_delay_ms"),
    ("allow_other=yes", "takes no value"),
    ("log=", "needs a value"),
    ("log=/nonexistent-dir/kvfs.log", "does not exist"),
])
@pytest.mark.parametrize("mode", ["daemon", "foreground"])
def test_bad_mount_option_is_one_line_and_mounts_nothing(kvfs_factory, option, phrase, mode):
    fs = kvfs_factory(size="64M")
    fs.mkfs()
    extra = ["-f"] if mode == "foreground" else []
    proc = run_tool("mount", *extra, fs.device, fs.mnt, "-o", option, check=False, timeout=60)
    assert proc.returncode == 1
    assert_one_line(proc, "mount.kvfs: ", phrase)
    assert not fs.mounted


def test_commit_interval_at_the_minimum_mounts(kvfs_factory):
    fs = kvfs_factory(size="64M", mount_options=["commit_interval=0.05"])
    fs.mkfs()
    fs.mount()
    put(fs.mnt / "f", b"x" * 1000)
    assert (fs.mnt / "f").read_bytes() == b"x" * 1000


# -- item 13 ------------------------------------------------------------------

def test_failure_inside_the_daemon_is_one_line_not_an_exception_group(kvfs_factory):
    """The final checkpoint at unmount fails inside trio's nursery (injected EIO on the
    checkpoint slots): the foreground mount.kvfs ends with one 'prog: message' line."""
    import json
    import time
    from kvfs.device import testfaults as faults
    fs = kvfs_factory(size="64M", faults=[])
    fs.mkfs()
    sb = superblock(fs.device)
    env = {**os.environ, faults.ENV: f"@{fs.faults_file}"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfs.cli.mount", "-f", str(fs.device), str(fs.mnt),
                             "-o", f"mmp_interval={TEST_MMP_INTERVAL}"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(fs.mnt):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        put(fs.mnt / "f", pattern(3, 1 << 20))
        fs.set_faults([{"op": "write", "range": [sb.checkpoint_a_off, sb.journal_off], "effect": "eio"}])
        pid = json.loads(run_tool("admin", "stats", "--json", fs.mnt).stdout)["pid"]
        assert pid == proc.pid
        subprocess.run(["umount", str(fs.mnt)], check=True)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "Traceback" not in stderr and "ExceptionGroup" not in stderr and "Exceptions from Trio" not in stderr
    lines = [line for line in stderr.splitlines() if not line[:4].isdigit()]    # log lines have a date
    assert lines and all(line.startswith("mount.kvfs: ") for line in lines), stderr
    assert any("final checkpoint failed" in line for line in lines), stderr
    fs.set_faults([])
    fs.assert_fsck_clean()                  # the journal still holds everything committed
    fs.mount()
    assert (fs.mnt / "f").read_bytes() == pattern(3, 1 << 20)


def test_relative_device_path_becomes_absolute_in_fsname_and_stats(kvfs_factory):
    fs = kvfs_factory(size="64M")
    fs.mkfs()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "kvfs.cli.mount", "store.kvfs", "mnt",
                    "-o", f"mmp_interval={TEST_MMP_INTERVAL}"], cwd=fs.root, env=env,
                   check=True, capture_output=True, timeout=120)
    want = str(fs.device.resolve())
    assert fs.stats()["device"] == want
    with open("/proc/self/mountinfo") as f:
        mine = [line.split(" - ")[1].split() for line in f if f" {fs.mnt.resolve()} " in line]
    assert mine and mine[0][:2] == ["fuse.kvfs", f"kvfs:{want}"], mine


def test_fsck_has_one_output_format_with_loader_warnings_as_notes(kvfs_factory):
    fs = kvfs_factory(size="64M")
    fs.mkfs()
    fs.mount()
    fs.admin("checkpoint", fs.mnt)                      # generation 2 in slot B; slot A keeps gen 1
    put(fs.mnt / "victim", pattern(51, MiB))
    fs.umount()                                        # generation 3 into slot A
    sb = superblock(fs.device)
    gens = {}
    with open(fs.device, "rb") as f:
        for slot, off in (("A", sb.checkpoint_a_off), ("B", sb.checkpoint_b_off)):
            f.seek(off)
            gens[slot] = fmt.decode_checkpoint_header(f.read(fmt.SECTOR), sb.checkpoint_len, sb.hash_seed)[0]
    older = min(gens, key=gens.get)
    flip(fs.device, (sb.checkpoint_a_off if older == "A" else sb.checkpoint_b_off) + fmt.SECTOR + 1)
    corrupt_where(fs.device, pattern(51, MiB)[4096:4160])

    check = fs.fsck()
    assert check.returncode == 1
    assert_fsck_format(check)
    assert f"note: warning: checkpoint slot {older}" in check.stdout, check.stdout
    assert "PROBLEM: /victim: has corrupt blocks" in check.stdout
    repaired = fs.fsck("--repair")
    assert repaired.returncode == 0
    assert_fsck_format(repaired)
    fs.assert_fsck_clean()


def test_fsck_of_a_missing_device_is_one_line(tmp_path):
    proc = run_tool("fsck", tmp_path / "nothing.kvfs", check=False)
    assert proc.returncode == 1
    assert_one_line(proc, "fsck.kvfs: ")
