"""Who may see what through /.kvfs/by-hash, and what it serves (issue 7, items 1, 2 and 6).

The mounts here use ``allow_other`` and live under a directory every user may
enter, because parts of each test run as other uids. This machine's venv
Python lives where only root may enter, so the unprivileged side runs the
system Python (``/usr/bin/python3``) with a small probe script.
"""
import errno
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from userprobe import run_probe
from kvfsmount import KvfsMount, run_tool

MiB = 1 << 20
ALICE = 1000
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
REPO = Path(__file__).resolve().parent.parent

# Runs as another uid: each op is [name, path, *args]; prints one JSON result per op,
# {"ok": value} or {"errno": n}.
PROBE = r"""
import json, os, sys

def stat_of(path):
    s = os.stat(path)
    return [s.st_uid, s.st_gid, s.st_mode, s.st_size, s.st_mtime_ns, s.st_ino]

def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return len(text)

OPS = {
    "listdir": lambda p: sorted(os.listdir(p)),
    "stat": stat_of,
    "read": lambda p: open(p, "rb").read().decode("latin-1"),
    "write": write,
    "mkdir": lambda p, mode: os.mkdir(p, int(mode, 8)),
    "chmod": lambda p, mode: os.chmod(p, int(mode, 8)),
    "getxattr": lambda p, name: os.getxattr(p, name).decode(),
    "listxattr": lambda p: sorted(os.listxattr(p)),
}
"""


def as_user(uid, *ops):
    """Run probe ops as ``uid`` (its own group, no supplementary groups); returns their results."""
    return run_probe(uid, PROBE, ops, timeout=60)


def one(uid, *op):
    return as_user(uid, op)[0]


def by_hash(fs, key=""):
    return fs.mnt / ".kvfs" / "by-hash" / key


def key_of(path):
    return os.getxattr(path, "user.kvfs.key").decode()


NOTES = "alice's notes\n" * 100
SECRET = "-----BEGIN PRIVATE KEY-----\nalice\n" * 50


def make_alice(fs):
    """Issue 7's repro: alice (uid 1000) has alice/ 0700 with notes.txt 0644 and key.pem 0600."""
    home = fs.mnt / "alice"
    results = as_user(ALICE, ["mkdir", home, "700"],
                      ["write", home / "notes.txt", NOTES], ["chmod", home / "notes.txt", "644"],
                      ["write", home / "key.pem", SECRET], ["chmod", home / "key.pem", "600"])
    assert all("ok" in r for r in results), results
    notes, pem = key_of(home / "notes.txt"), key_of(home / "key.pem")   # root reads the keys
    assert notes != pem
    return home, notes, pem


# -- item 1: the view bypassed directory permissions ------------------------------------

def test_by_hash_is_root_only_by_default(shared_kvfs):
    fs = shared_kvfs()
    home, notes, pem = make_alice(fs)
    view = by_hash(fs)
    # The repro: uid 65534 listed both files (owner, size, mtime) and read notes.txt.
    assert one(NOBODY, "listdir", view) == {"errno": errno.EACCES}
    for key in (notes, pem):
        assert one(NOBODY, "stat", view / key) == {"errno": errno.EACCES}
        assert one(NOBODY, "read", view / key) == {"errno": errno.EACCES}
    # Alice herself gets nothing either: by default the view is root's.
    assert one(ALICE, "read", view / notes) == {"errno": errno.EACCES}
    st = os.stat(view)
    assert stat.S_IMODE(st.st_mode) == 0o500 and st.st_uid == os.getuid()
    # Root (and only root) keeps the view.
    assert {notes, pem} <= set(os.listdir(view))
    assert (view / notes).read_text() == NOTES
    assert (view / pem).read_text() == SECRET


def test_by_hash_owner_mode_shows_only_own_reachable_readable_files(shared_kvfs):
    fs = shared_kvfs("by_hash=owner")
    home, notes, pem = make_alice(fs)
    view = by_hash(fs)
    # Another user sees none of alice's objects, whether listing or naming them.
    assert one(NOBODY, "listdir", view) == {"ok": []}
    for key in (notes, pem):
        assert one(NOBODY, "stat", view / key) == {"errno": errno.ENOENT}
        assert one(NOBODY, "read", view / key) == {"errno": errno.ENOENT}
    # Alice sees her own files, which she can reach and read by their paths.
    listing, st, text = as_user(ALICE, ["listdir", view], ["stat", view / pem], ["read", view / pem])
    assert sorted(listing["ok"]) == sorted([notes, pem])
    uid, _, mode, size, _, _ = st["ok"]
    assert uid == ALICE and size == len(SECRET) and stat.S_IMODE(mode) == 0o400
    assert text == {"ok": SECRET}
    # Root still sees everything: it could reach it anyway.
    assert (view / notes).read_text() == NOTES
    # Once alice cannot search alice/, she cannot reach the files, so the view hides them.
    assert one(ALICE, "chmod", home, "600") == {"ok": None}
    assert as_user(ALICE, ["listdir", view], ["read", view / notes]) == [
        {"ok": []}, {"errno": errno.ENOENT}]
    # A file its owner may not read is hidden too, even where the directory is open.
    assert one(ALICE, "chmod", home, "700") == {"ok": None}
    assert one(ALICE, "chmod", home / "key.pem", "200") == {"ok": None}
    assert as_user(ALICE, ["listdir", view], ["stat", view / pem]) == [
        {"ok": [notes]}, {"errno": errno.ENOENT}]
    # Files another user may read by path but does not own stay out of its view.
    assert one(ALICE, "chmod", home, "755") == {"ok": None}
    assert one(NOBODY, "read", home / "notes.txt") == {"ok": NOTES}
    assert one(NOBODY, "listdir", view) == {"ok": []}


# -- item 2: content probes and the statistics --------------------------------------------

@pytest.mark.parametrize("mode", ["root", "owner"])
def test_guess_and_stat_reveals_nothing(shared_kvfs, mode):
    fs = shared_kvfs(f"by_hash={mode}")
    _, _, pem = make_alice(fs)
    mine = fs.mnt / "nobody"
    right, wrong = mine / "right", mine / "wrong"
    results = as_user(NOBODY, ["mkdir", mine, "700"], ["write", right, SECRET],
                      ["write", wrong, SECRET.replace("alice", "bobby")],
                      ["getxattr", right, "user.kvfs.key"], ["getxattr", wrong, "user.kvfs.key"],
                      ["stat", right], ["stat", wrong])
    assert all("ok" in r for r in results), results
    guessed, other = results[3]["ok"], results[4]["ok"]
    # Dedup domains (issue 12): a right guess does not even name alice's content;
    # nobody's copy is keyed in nobody's own domain.
    assert guessed != pem and other != pem and guessed != other
    probes = as_user(NOBODY, ["stat", by_hash(fs, guessed)], ["stat", by_hash(fs, other)])
    if mode == "root":
        assert probes == [{"errno": errno.EACCES}] * 2
        return
    # Each probe shows the guesser's own file: a right guess looks exactly like a wrong one.
    for probe, own in zip(probes, (results[5]["ok"], results[6]["ok"])):
        uid, gid, view_mode, size, mtime, _ = probe["ok"]
        assert (uid, gid, size, mtime) == (NOBODY, NOBODY, own[3], own[4])
        assert stat.S_IMODE(view_mode) == stat.S_IMODE(own[2]) & 0o500
    # After the guesser deletes its copy, alice's remains invisible to it.
    os.unlink(right)
    assert one(NOBODY, "stat", by_hash(fs, guessed)) == {"errno": errno.ENOENT}


def test_stats_readable_only_by_root_and_the_mount_owner(shared_kvfs):
    fs = shared_kvfs()
    before = fs.stats()                                # root: the mount's owner here
    assert before["pid"] == fs.pid
    got, names = as_user(NOBODY, ["getxattr", fs.mnt, "user.kvfs.stats"], ["listxattr", fs.mnt])
    assert got == {"errno": errno.EACCES}
    assert "user.kvfs.stats" not in names["ok"]
    proc = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         SYSTEM_PYTHON, "-m", "kvfs.cli.admin", "stats", str(fs.mnt)],
        capture_output=True, text=True, timeout=60, cwd="/", env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "statistics are readable only by root and the mount's owner" in lines[0]


# -- item 6: the view served content other than the one its key names --------------------

def rewrite_same_size(path, data):
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


def test_view_serves_its_key_after_a_rewrite_with_restored_mtime(shared_kvfs):
    fs = shared_kvfs()
    path = fs.mnt / "chunk"
    x, y = os.urandom(2 * MiB + 5), os.urandom(2 * MiB + 5)
    path.write_bytes(x)
    kx = key_of(path)
    assert by_hash(fs, kx).read_bytes() == x
    rewrite_same_size(path, y)
    assert path.read_bytes() == y
    ky = key_of(path)
    assert ky != kx
    assert by_hash(fs, ky).read_bytes() == y           # the review saw x here
    assert not by_hash(fs, kx).exists()
    assert by_hash(fs, ky).stat().st_ino != os.stat(path).st_ino


def test_open_view_descriptor_keeps_its_content(shared_kvfs):
    fs = shared_kvfs()
    path = fs.mnt / "chunk"
    x, y = os.urandom(3 * MiB + 7), os.urandom(3 * MiB + 7)
    path.write_bytes(x)
    kx = key_of(path)
    fd = os.open(by_hash(fs, kx), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == x[:4096]
        path.write_bytes(y)                            # a rewrite ...
        assert key_of(path) != kx
        fs.flush()                                     # ... made durable: x's blocks lose their refs
        fs.admin("drop-caches", fs.mnt)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # make the kernel ask the daemon again
        assert os.pread(fd, len(x), 0) == x            # the review saw y here
        os.unlink(path)
        fs.flush()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, len(x), 0) == x
        assert os.fstat(fd).st_size == len(x)
    finally:
        os.close(fd)
    assert not by_hash(fs, kx).exists()
    deadline = time.monotonic() + 10                   # the kernel sends RELEASE after close returns
    while fs.stats()["used_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fs.stats()["used_bytes"] == 0              # closing the view let go of x's blocks


def test_view_of_gone_content_is_enoent(shared_kvfs):
    fs = shared_kvfs()
    path = fs.mnt / "chunk"
    x, y = os.urandom(MiB), os.urandom(MiB)
    path.write_bytes(x)
    kx = key_of(path)
    view = by_hash(fs, kx)
    assert view.stat().st_size == len(x)               # the kernel now holds a dentry for it
    path.write_bytes(y)
    assert key_of(path) != kx                          # y is recorded: x is gone
    with pytest.raises(FileNotFoundError):
        open(view, "rb")                               # the review read y here (cached dentry)
    with pytest.raises(FileNotFoundError):
        view.stat()
    assert kx not in os.listdir(by_hash(fs))
    ky = key_of(path)
    assert by_hash(fs, ky).read_bytes() == y
    os.unlink(path)
    with pytest.raises(FileNotFoundError):
        by_hash(fs, ky).stat()


def test_bad_by_hash_value_is_a_one_line_error(tmp_path):
    fs = KvfsMount(tmp_path)
    fs.mkfs()
    proc = run_tool("mount", fs.device, fs.mnt, "-o", "by_hash=everyone", check=False)
    assert proc.returncode != 0 and not fs.mounted
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "by_hash" in proc.stderr and "everyone" in proc.stderr
    fs.assert_fsck_clean()
