"""A damaged device through the real tools (issue 12, "Hostile and damaged input").

Zeroed superblocks, checkpoint slots, journal and data, a truncated device, a
newer format version, and seeded random damage of the metadata: mount.kvfs and
fsck.kvfs each give a clear refusal (non-zero exit, one line on stderr, no
traceback, no hang) and write nothing to a device they refused, or the mount
serves correct data: a file reads back as written or fails with EIO, never with
other bytes.

The base store is made by mkfs.kvfs and written through a real mount; the
superblock is edited through kvfs.schema (decode, change a field, encode), never
by hand-written offsets, so these tests follow format changes.
"""
import errno
import hashlib
import os
import random
import subprocess

import pytest

from kvfs import schema
from filedata import pattern, write_file
from kvfsmount import KvfsMount, run_tool
from unit.helpers import poke

MiB = 1 << 20
S = schema.SECTOR
TIMEOUT = 120
FILES = {"a": pattern(11, 3 * MiB + 17), "dir/b": pattern(12, MiB), "dir/c": b"small file",
         "d": pattern(13, 2 * MiB)}


# -- building blocks ------------------------------------------------------------------

def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 * MiB), b""):
            h.update(chunk)
    return h.hexdigest(), os.path.getsize(path)


def superblock(path):
    with open(path, "rb") as f:
        return schema.Superblock.decode(f.read(S))


def zero(path, off, n):
    poke(path, off, bytes(n))


def assert_one_line_error(proc, prog, *, contains=()):
    assert proc.returncode != 0, f"{prog} accepted a damaged device:\n{proc.stdout}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and "internal error" not in proc.stderr
    for text in contains:
        assert text in lines[0], lines[0]
    return lines[0]


def try_mount(fs):
    return run_tool("mount", fs.device, fs.mnt, "-o", f"log={fs.log}", check=False, timeout=TIMEOUT)


def try_fsck(fs, *extra):
    return run_tool("fsck", *extra, fs.device, check=False, timeout=TIMEOUT)


def refused_without_writes(fs, *, contains=()):
    """mount.kvfs and fsck.kvfs both refuse ``fs``'s device, and leave it as it was."""
    before = digest(fs.device)
    mount_line = assert_one_line_error(try_mount(fs), "mount.kvfs", contains=contains)
    assert not fs.mounted
    fsck_line = assert_one_line_error(try_fsck(fs), "fsck.kvfs", contains=contains)
    assert digest(fs.device) == before, "a tool that refused the device wrote to it"
    return mount_line, fsck_line


def check_files(fs, expected, *, allow_missing=()):
    """Every file reads back as written, or fails with EIO; names in allow_missing may be absent."""
    outcome = {}
    for name, data in expected.items():
        path = fs.mnt / name
        try:
            got = path.read_bytes()
        except FileNotFoundError:
            assert name in allow_missing, f"{name} vanished"
            outcome[name] = "absent"
            continue
        except OSError as exc:
            assert exc.errno == errno.EIO, f"{name}: {exc}"
            outcome[name] = "EIO"
            continue
        assert got == data, f"{name}: wrong bytes ({len(got)} bytes, expected {len(data)})"
        outcome[name] = "ok"
    return outcome


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """A store made by mkfs.kvfs, written in two mounts (two checkpoints), cleanly unmounted."""
    root = tmp_path_factory.mktemp("golden")
    fs = KvfsMount(root, size="64M")
    fs.mkfs()
    fs.mount()
    try:
        (fs.mnt / "dir").mkdir()
        for name in ("a", "dir/b"):
            write_file(fs.mnt / name, FILES[name])
        fs.umount()
        fs.mount()
        for name in ("dir/c", "d"):
            write_file(fs.mnt / name, FILES[name])
        fs.umount()
    finally:
        if fs.mounted:
            fs.umount()
    fs.assert_fsck_clean()
    return fs.device


@pytest.fixture
def store(golden, tmp_path):
    """A copy of the golden store to damage (KvfsMount: ends with nothing mounted)."""
    fs = KvfsMount(tmp_path, size="64M")
    subprocess.run(["cp", "--sparse=always", str(golden), str(fs.device)], check=True)
    yield fs
    if fs.mounted:
        fs.umount()


# -- zeroed regions ---------------------------------------------------------------------

def test_zeroed_primary_superblock_is_refused_until_fsck_restores_the_backup(store):
    zero(store.device, 0, S)
    mount_line, _ = refused_without_writes(store, contains=("backup superblock is intact",))
    assert "fsck.kvfs --repair" in mount_line
    repaired = try_fsck(store, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "restored it from the backup" in repaired.stdout
    store.mount()
    assert check_files(store, FILES) == dict.fromkeys(FILES, "ok")
    store.umount()
    store.assert_fsck_clean()


def test_both_superblocks_zeroed_is_refused(store):
    zero(store.device, 0, 2 * S)
    refused_without_writes(store, contains=("no kvfs superblock",))


def test_zeroed_checkpoint_slots(store):
    """The newest slot zeroed: the older slot is used (or mount refuses); both zeroed: refused."""
    sb = superblock(store.device)
    slots = (sb.checkpoint_a_off, sb.checkpoint_b_off)
    newest = max(slots, key=lambda off: _slot_generation(store.device, sb, off))
    zero(store.device, newest, S)
    proc = try_mount(store)
    if proc.returncode:
        assert_one_line_error(proc, "mount.kvfs")
    else:
        # Rolled back to the older checkpoint plus what its journal holds: the files
        # written since may be absent, but nothing reads back wrong.
        outcome = check_files(store, FILES, allow_missing=("dir/c", "d"))
        assert outcome["a"] == outcome["dir/b"] == "ok", outcome
        store.umount()
        store.assert_fsck_clean()
    for off in slots:
        zero(store.device, off, S)
    refused_without_writes(store, contains=("no valid checkpoint",))


def _slot_generation(path, sb, off):
    with open(path, "rb") as f:
        header = schema.decode_checkpoint_header(os.pread(f.fileno(), S, off), sb.checkpoint_len, sb.hash_seed)
    return -1 if header is None else header[0]


def _with_journal_frames(fs):
    """Mount, write and fsync two more files, then crash: their records are only in the journal."""
    fs.mount()
    extra = {"j1": pattern(21, MiB + 5), "j2": pattern(22, 5000)}
    for name, data in extra.items():
        write_file(fs.mnt / name, data, fsync=True)
    fs.kill9()
    return extra


def test_zeroed_first_journal_frame_is_refused(store):
    """A lost frame followed by a committed one proves committed changes would be lost."""
    _with_journal_frames(store)
    sb = superblock(store.device)
    zero(store.device, sb.journal_off, S)
    refused = try_mount(store)
    if refused.returncode == 0:
        pytest.fail("mount accepted a journal whose first committed frame is gone")
    assert_one_line_error(refused, "mount.kvfs", contains=("fsck.kvfs --repair",))
    before = digest(store.device)
    check = try_fsck(store)
    assert check.returncode == 1 and "Traceback" not in check.stdout + check.stderr
    assert digest(store.device) == before
    repaired = try_fsck(store, "--repair")
    assert repaired.returncode == 0 and "lost:" in repaired.stdout, repaired.stdout
    store.mount()
    assert check_files(store, FILES) == dict.fromkeys(FILES, "ok")
    store.umount()


def test_zeroed_journal_rolls_back_to_the_checkpoint(store):
    """A wholly zeroed journal cannot be told from an empty one: the store shows its last
    checkpoint (the files fsynced since are gone; docs/reliability.md says so), never wrong data."""
    extra = _with_journal_frames(store)
    sb = superblock(store.device)
    zero(store.device, sb.journal_off, sb.journal_len)
    store.mount()
    assert check_files(store, FILES | extra, allow_missing=tuple(extra)) == (
        dict.fromkeys(FILES, "ok") | dict.fromkeys(extra, "absent"))
    store.umount()
    store.assert_fsck_clean()


@pytest.mark.expect_errors(r"fails its checksum")
def test_zeroed_data_region_reads_give_eio_never_wrong_bytes(store):
    sb = superblock(store.device)
    zero(store.device, sb.data_off, sb.data_len)
    store.mount()
    outcome = check_files(store, FILES)
    assert set(outcome.values()) == {"EIO"}, outcome
    store.umount()
    check = try_fsck(store, "--no-data")
    assert check.returncode == 0, check.stdout         # the metadata itself is fine
    check = try_fsck(store)
    assert check.returncode == 1 and "reading it gives EIO" in check.stdout, check.stdout


# -- truncated devices and newer formats ------------------------------------------------

def test_truncated_device_is_refused(store):
    size = os.path.getsize(store.device)
    os.truncate(store.device, size - MiB)
    refused_without_writes(store, contains=("truncated",))
    os.truncate(store.device, schema.MIN_DEVICE_SIZE // 2)
    refused_without_writes(store, contains=("too small",))


def rewritten_superblocks(path, **changes):
    """Both superblocks with fields changed, re-encoded (checksum right) by kvfs.schema."""
    with open(path, "rb") as f:
        sector = f.read(S)
    values = dict(zip(schema.Superblock.FIELDS, schema.SUPERBLOCK.unpack_from(sector)))
    values.update(changes)
    encoded = schema.Superblock(**values).encode()
    poke(path, 0, encoded + encoded)


def test_newer_format_version_is_refused(store):
    rewritten_superblocks(store.device, version=schema.FORMAT_VERSION + 1)
    mount_line, _ = refused_without_writes(store, contains=("unsupported kvfs format version",))
    assert str(schema.FORMAT_VERSION + 1) in mount_line


# -- seeded random damage through the real tools -------------------------------------------

def damage(path, seed):
    """A few random writes into the metadata area, mostly where its bytes are."""
    rng = random.Random(seed)
    sb = superblock(path)
    hot = [(0, 2 * S), (sb.checkpoint_a_off, 2 * S), (sb.checkpoint_b_off, 2 * S), (sb.journal_off, 4 * S)]
    for _ in range(rng.randint(1, 4)):
        base, span = rng.choice(hot)
        off = base + rng.randrange(span)
        kind = rng.choice(["flip", "bytes", "zero"])
        if kind == "flip":
            with open(path, "rb") as f:
                old = os.pread(f.fileno(), 1, off)[0]
            poke(path, off, bytes([old ^ (1 << rng.randrange(8))]))
        elif kind == "bytes":
            poke(path, off, rng.randbytes(rng.randint(1, 64)))
        else:
            zero(path, off - off % S, S)


@pytest.mark.parametrize("seed", range(8))
def test_randomly_damaged_metadata_through_the_tools(store, seed):
    damage(store.device, seed)
    before = digest(store.device)
    check = try_fsck(store)
    assert check.returncode in (0, 1) and "Traceback" not in check.stdout + check.stderr
    if check.returncode == 1 and check.stderr:
        assert_one_line_error(check, "fsck.kvfs")
    assert digest(store.device) == before, "fsck without --repair wrote to the device"
    proc = try_mount(store)
    if proc.returncode:
        assert_one_line_error(proc, "mount.kvfs")
        assert digest(store.device) == before, "a refused mount wrote to the device"
        return
    check_files(store, FILES)
    store.umount()
