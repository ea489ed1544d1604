"""The native read plane (kvfs/fuse/readplane.c, kvfs/fuse/frontend.py), through a real mount.

What is shown through the daemon's statistics, never through timing:

* READs of a sealed file are answered natively, bit-exact, buffered and
  O_DIRECT; pyfuse3 sees none of them;
* a file with dirty blocks goes the Python way, and goes native once sealed;
* a corrupt block is EIO on the native path (the front end hands the READ to
  Python, which finds the bad block and answers EIO);
* a stalled Python side (a checkpoint blocking the event loop) does not stall
  native READs;
* a file changed under a native READ in hand keeps its old blocks (pinned)
  until that READ has been served from them;
* rewrites, truncates, evictions and unlinks among native reads never yield
  old or wrong bytes (a stress test with several threads).
"""
from __future__ import annotations

import array
import errno
import mmap
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfs.base import crashpoints
from kvfs.fuse.frontend import NativeModuleMissing, load, mount_data
from kvfs.errors import InvalidArgument

from filedata import pattern
from kvfsmount import KvfsMount, drop_kernel_cache, run_tool

MiB = 1 << 20
NATIVE = "native_reads=on"          # said outright: the default (auto) is on only as root


@pytest.fixture
def kvfs(kvfs_factory):
    fs = kvfs_factory(mount_options=[NATIVE])
    fs.mkfs()
    fs.mount()
    return fs


def _native(fs):
    stats = fs.stats()
    return {k: v for k, v in stats.items() if k.startswith("native_") or k == "kernel_read_requests"}


def _read_all(path, direct):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        size = os.fstat(fd).st_size
        buf = mmap.mmap(-1, max(size, 1))          # page aligned, as O_DIRECT needs
        got = 0
        while got < size:
            n = os.preadv(fd, [memoryview(buf)[got:]], got)
            assert n > 0, f"short read at {got} of {size}"
            got += n
        return bytes(buf[:size])
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
def test_a_sealed_files_reads_are_native_and_bit_exact(kvfs, direct):
    # 5 MiB and a bit: whole blocks and a short last one.
    data = pattern(1, 5 * MiB + 12345)
    (kvfs.mnt / "chunk").write_bytes(data)
    kvfs.flush()
    drop_kernel_cache()
    kvfs.admin("drop-caches", kvfs.mnt)
    before = _native(kvfs)
    assert _read_all(kvfs.mnt / "chunk", direct) == data
    after = _native(kvfs)
    assert after["native_reads"] > before["native_reads"]
    assert after["native_read_bytes"] - before["native_read_bytes"] >= len(data)
    assert after["kernel_read_requests"] == before["kernel_read_requests"], "pyfuse3 answered a READ"
    assert after["native_forwarded_reads"] == before["native_forwarded_reads"]
    assert after["native_verify_failures"] == 0 and after["native_device_errors"] == 0
    # The last close withdraws the file: the table holds open files only.
    assert after["native_published_files"] == 0
    assert after["native_withdrawals"] >= 1
    # No page fill with the plane on (it would read the file through Python), but the
    # same statistics as without it: tools read one schema.
    stats = kvfs.stats()
    assert stats["page_fills"] == 0 and stats["page_fill_bytes"] == 0


def test_a_file_with_dirty_blocks_goes_the_python_way_until_sealed(kvfs):
    data = pattern(2, 3 * MiB)
    path = kvfs.mnt / "growing"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        before = _native(kvfs)
        # The writer still has it open: its blocks may be dirty, it is not sealed.
        assert _read_all(path, direct=True) == data
        during = _native(kvfs)
        assert during["native_reads"] == before["native_reads"]
        assert during["native_forwarded_reads"] > before["native_forwarded_reads"]
        assert during["kernel_read_requests"] > before["kernel_read_requests"]
    finally:
        os.close(fd)
    kvfs.flush()                                   # sealed: every block on the device under its key
    assert _read_all(path, direct=True) == data
    after = _native(kvfs)
    assert after["native_reads"] > during["native_reads"]
    assert after["kernel_read_requests"] == during["kernel_read_requests"]


def _offset_in_store(fs, needle):
    """Where ``needle`` (4 KiB of a block's bytes) lies in the store file."""
    with open(fs.device, "rb") as f:
        whole = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            at = whole.find(needle)
        finally:
            whole.close()
    assert at >= 0 and at % 4096 == 0, at
    return at


@pytest.mark.expect_errors(r"fails its checksum")
def test_a_corrupt_block_is_eio_on_the_native_path(kvfs):
    data = pattern(3, 4 * MiB)
    (kvfs.mnt / "chunk").write_bytes(data)
    kvfs.flush()
    at = _offset_in_store(kvfs, data[2 * MiB:2 * MiB + 4096])      # block 2 on the device
    fd = os.open(kvfs.device, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, at + 100)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at + 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_kernel_cache()
    kvfs.admin("drop-caches", kvfs.mnt)
    before = _native(kvfs)
    fd = os.open(kvfs.mnt / "chunk", os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, MiB)
        assert os.preadv(fd, [buf], 0) == MiB and buf[:] == data[:MiB]      # block 0 is fine
        with pytest.raises(OSError) as caught:
            os.preadv(fd, [buf], 2 * MiB)
        assert caught.value.errno == errno.EIO
    finally:
        os.close(fd)
    after = _native(kvfs)
    assert after["native_verify_failures"] > before["native_verify_failures"]
    assert after["native_reads"] > before["native_reads"]                  # block 0 was native
    assert kvfs.stats()["corrupt_reads"] >= 1                              # Python confirmed it
    # Put the byte back: the teardown's fsck must find the store clean.
    fd = os.open(kvfs.device, os.O_RDWR)
    try:
        os.pwrite(fd, byte, at + 100)
        os.fsync(fd)
    finally:
        os.close(fd)


def _mounted_with_stall_point(tmp_path, point):
    """A mount whose daemon blocks at stall point ``point`` until gate/release exists."""
    gate = tmp_path / "gate"
    gate.mkdir()
    (tmp_path / "fs").mkdir()
    fs = KvfsMount(tmp_path / "fs", mount_options=[NATIVE], env={crashpoints.STALL_ENV: f"{point}:{gate}"})
    fs.mkfs()
    fs.mount()
    return fs, gate


def test_a_stalled_python_side_does_not_stall_native_reads(tmp_path):
    fs, gate = _mounted_with_stall_point(tmp_path, "checkpoint")
    try:
        data = pattern(4, 4 * MiB)
        (fs.mnt / "chunk").write_bytes(data)
        fs.flush()
        drop_kernel_cache()
        fd = os.open(fs.mnt / "chunk", os.O_RDONLY | os.O_DIRECT)      # the open needs Python: before
        checkpoint = threading.Thread(target=fs.admin, args=("checkpoint", fs.mnt))
        checkpoint.start()
        try:
            # The event loop is blocked in the checkpoint until gate/release exists.
            while not (gate / "stalled").exists():
                checkpoint.join(0.01)
                assert checkpoint.is_alive(), "the checkpoint ended without reaching its stall point"
            buf = mmap.mmap(-1, len(data))
            assert os.preadv(fd, [buf], 0) == len(data)
            assert buf[:] == data
            # The reads finished while the loop was still blocked: nothing released it.
            assert not (gate / "release").exists() and checkpoint.is_alive()
        finally:
            (gate / "release").touch()
            checkpoint.join(120)
            os.close(fd)
        assert not checkpoint.is_alive()
        stats = _native(fs)
        assert stats["native_reads"] >= 4 and stats["kernel_read_requests"] == 0
    finally:
        fs.teardown()


def test_a_version_changed_under_a_native_read_keeps_its_blocks_until_the_read_is_served(tmp_path):
    """A READ handed out before a change is served from the version it was handed out under:
    its blocks stay pinned, so the rewrite cannot reuse their extents under it (a failed key
    check would send that READ to pyfuse3 late, out of the kernel's order)."""
    fs, gate = _mounted_with_stall_point(tmp_path, "native_read")
    old, new = pattern(5, 4 * MiB), pattern(6, 4 * MiB)
    path = fs.mnt / "chunk"
    try:
        path.write_bytes(old)
        fs.flush()
        drop_kernel_cache()
        used = fs.stats()["used_bytes"]
        assert used >= len(old)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)         # published at this open
        buf = mmap.mmap(-1, MiB)
        got = []
        reader = threading.Thread(target=lambda: got.append(os.preadv(fd, [buf], 0)))
        reader.start()
        try:
            # The plane holds this READ with the old version found, before its device read.
            while not (gate / "stalled").exists():
                reader.join(0.01)
                assert reader.is_alive(), "the READ was served without reaching the stall point"
            # Rewrite every block in place (no O_TRUNC: a truncate waits for direct I/O in flight).
            with open(path, "r+b") as f:
                f.write(new)
            fs.flush()                  # durable: no content names the old blocks any more
            held = fs.stats()
            assert held["native_kept_versions"] == 1
            assert held["used_bytes"] == 2 * used                  # old blocks pinned, new ones stored
        finally:
            (gate / "release").touch()
            reader.join(120)
            os.close(fd)
        assert not reader.is_alive()
        assert got == [MiB] and buf[:] == old[:MiB]              # the version it was handed out under
        stats = fs.stats()
        assert stats["native_reads"] == 1 and stats["native_verify_failures"] == 0
        assert stats["kernel_read_requests"] == 0                 # not forwarded late
        # Collected once the READ is served (at the latest on the next once-a-second pass):
        # the pins are let go and the old blocks freed.
        deadline = time.monotonic() + 60
        while (stats["native_kept_versions"], stats["used_bytes"]) != (0, used):
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
            stats = fs.stats()
        assert path.read_bytes() == new
    finally:
        fs.teardown()


@pytest.mark.parametrize("direct_io", [False, True], ids=["page_cache", "native_direct_io"])
def test_native_direct_io_sends_every_read_to_the_plane_and_mmap_still_works(kvfs_factory, direct_io):
    fs = kvfs_factory(mount_options=[NATIVE, f"native_direct_io={'on' if direct_io else 'off'}"])
    fs.mkfs()
    fs.mount()
    data = pattern(7, 3 * MiB + 100)
    (fs.mnt / "chunk").write_bytes(data)
    fs.flush()
    drop_kernel_cache()
    assert (fs.mnt / "chunk").read_bytes() == data           # buffered, cold
    first = _native(fs)
    assert (fs.mnt / "chunk").read_bytes() == data           # again: hot, if the kernel kept pages
    second = _native(fs)
    if direct_io:
        # No page cache: the bytes go from the native reply into the reader's buffer, every time.
        assert second["native_read_bytes"] - first["native_read_bytes"] >= len(data)
    else:
        # The kernel's page cache answers. Not asked to be exact: a machine under memory
        # pressure (the other test worker) may reclaim a folio range between the reads,
        # and the plane then answers that one READ (CI saw 1 of 4).
        assert second["native_read_bytes"] - first["native_read_bytes"] <= len(data) // 2, \
            "the kernel's page cache did not answer"
    # Shared and private read-only maps work either way (FUSE_DIRECT_IO_ALLOW_MMAP).
    fd = os.open(fs.mnt / "chunk", os.O_RDONLY)
    try:
        for flags in (mmap.MAP_SHARED, mmap.MAP_PRIVATE):
            with mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ) as mapped:
                assert mapped[:] == data
    finally:
        os.close(fd)
    assert second["kernel_read_requests"] == 0


def _cold_chunk_read_with(kvfs_factory, options):
    """Mount with ``options``, write a sealed 2 MiB chunk, read it cold with O_DIRECT; the stats."""
    fs = kvfs_factory(mount_options=options)
    fs.mkfs()
    fs.mount()
    data = pattern(5, 2 * MiB)
    (fs.mnt / "chunk").write_bytes(data)
    fs.flush()
    drop_kernel_cache()
    assert _read_all(fs.mnt / "chunk", direct=True) == data
    return fs.stats()


def test_native_reads_off_serves_everything_through_pyfuse3(kvfs_factory):
    stats = _cold_chunk_read_with(kvfs_factory, ["native_reads=off"])
    assert not any(k.startswith("native_") for k in stats), "native_reads=off still started the plane"
    assert stats["kernel_read_requests"] >= 2


@pytest.mark.parametrize("options", [[], ["native_reads=auto"]], ids=["default", "auto"])
def test_a_root_mount_has_the_plane_by_default(kvfs_factory, options):
    """auto, the default: the daemon runs as root here, so the plane answers READs."""
    assert os.geteuid() == 0
    stats = _cold_chunk_read_with(kvfs_factory, options)
    assert stats["native_threads"] == 4 and stats["native_reads"] >= 2, stats
    assert stats["kernel_read_requests"] == 0, "pyfuse3 answered a READ of a sealed file"


@pytest.mark.parametrize("value, why", [("yes", "use on, off or auto"), ("ON", "use on, off or auto"),
                                        ("", "needs a value")])
def test_native_reads_takes_on_off_or_auto_only(kvfs_factory, value, why):
    fs = kvfs_factory()
    fs.mkfs()
    proc = run_tool("mount", fs.device, fs.mnt, "-o", f"native_reads={value}", check=False, timeout=120)
    assert proc.returncode != 0 and why in proc.stderr, proc.stderr
    assert not os.path.ismount(fs.mnt)


def test_mount_data_takes_kvfs_options_and_refuses_others():
    source, fstype, flags, data = mount_data({"fsname=kvfs:/dev/x", "subtype=kvfs", "allow_other",
                                               "default_permissions"}, 7)
    assert (source, fstype) == ("kvfs:/dev/x", "fuse.kvfs")
    assert data.startswith("fd=7,rootmode=40000,") and "allow_other" in data and "default_permissions" in data
    with pytest.raises(InvalidArgument, match="not supported"):
        mount_data({"max_read=4096"}, 7)


def test_a_missing_native_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvfs.fuse._readplane", None)     # as if it was never built
    with pytest.raises(NativeModuleMissing, match="native read plane is not built.*native_reads=off"):
        load()


def test_a_native_build_that_fails_fails_the_install(tmp_path):
    """The extensions build in the normal install; a compile error must stop it, loudly."""
    repo = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(repo / name, src / name)
    shutil.copytree(repo / "kvfs", src / "kvfs", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(src / "kvfs/fuse/readplane.c", "a") as f:
        f.write("\n#error a deliberately broken native read plane\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "out"), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "deliberately broken native read plane" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("out/*.whl")), "a wheel was built without the native read plane"


def test_the_connection_ends_with_enotconn_after_kill_9(kvfs):
    data = pattern(6, MiB)
    (kvfs.mnt / "chunk").write_bytes(data)
    kvfs.flush()
    kvfs.kill9(detach=False)
    try:
        # A dead mount (tests/crash_oracle.py): ENOTCONN, or ECONNABORTED for what the
        # kernel aborted; never bytes, never a hang.
        for _ in range(2):
            with pytest.raises(OSError) as caught:
                (kvfs.mnt / "chunk").read_bytes()
            assert caught.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    finally:
        kvfs.detach()
    kvfs.mount()
    assert (kvfs.mnt / "chunk").read_bytes() == data


# -- the stress test -------------------------------------------------------------------
# Every 8-byte word of a file says (its file, its version, its own index), so any
# read can be checked on its own: a word from another place or file is wrong
# bytes, and a version older than the last change that finished before the
# reader opened the file is old bytes.
STRESS_FILES = 3
STRESS_SIZE = 3 * MiB + 4096
STRESS_CHANGES = 36


def _version_bytes(file_id, version, size=STRESS_SIZE):
    head = (version << 16) | file_id
    return array.array("Q", [(i << 32) | head for i in range(size // 8)]).tobytes()


def _check_words(chunk, at, file_id, oldest, newest):
    """Raise AssertionError unless every word of ``chunk`` (read at ``at``) is right and not old."""
    words = array.array("Q")
    words.frombytes(chunk[:len(chunk) // 8 * 8])
    for k, w in enumerate(words):
        version = (w >> 16) & 0xFFFF
        if (w & 0xFFFF) != file_id or (w >> 32) != at // 8 + k:
            raise AssertionError(f"file {file_id} at {at + 8 * k}: wrong bytes {w:#x}")
        if not oldest <= version <= newest:
            raise AssertionError(f"file {file_id} at {at + 8 * k}: version {version}, "
                                 f"expected {oldest}..{newest}")


class _Versions:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = [0] * STRESS_FILES          # the last version whose change has returned
        self.begun = [0] * STRESS_FILES         # the last version a change has started to write


def _mutate(fs, versions, rng):
    """One change of one file: rewrite, overwrite, truncate, rename over, unlink or evict."""
    file_id = rng.randrange(STRESS_FILES)
    path = fs.mnt / f"f{file_id}"
    with versions.lock:
        version = versions.begun[file_id] = versions.begun[file_id] + 1
    data = _version_bytes(file_id + 1, version)
    kind = rng.choice(["rewrite", "overwrite", "truncate", "rename", "unlink", "evict"])
    if kind == "evict":
        fs.admin("evict", fs.mnt, str(path), check=False)     # refused while a reader has it open
        kind = "rewrite"
    if kind == "unlink":
        path.unlink(missing_ok=True)
        kind = "rewrite"
    if kind == "rename":
        tmp = fs.mnt / f"tmp{file_id}"
        tmp.write_bytes(data)
        os.rename(tmp, path)
    elif kind in ("overwrite", "truncate"):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if kind == "truncate":
                os.ftruncate(fd, STRESS_SIZE // 3)
            for off in range(0, len(data), MiB):
                assert os.pwrite(fd, data[off:off + MiB], off) == len(data[off:off + MiB])
        finally:
            os.close(fd)
    else:
        path.write_bytes(data)
    if rng.random() < 0.5:
        fs.flush()                              # sealed now: the next opens publish it
    with versions.lock:
        versions.done[file_id] = version
    return kind


def _read_and_check(fs, versions, rng, direct, stop, failures):
    buf = mmap.mmap(-1, MiB)
    while not stop.is_set():
        file_id = rng.randrange(STRESS_FILES)
        with versions.lock:
            oldest = versions.done[file_id]
        try:
            fd = os.open(fs.mnt / f"f{file_id}", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            continue                            # unlinked or evicted just now
        try:
            for at in range(0, STRESS_SIZE, MiB):
                n = os.preadv(fd, [buf], at)
                with versions.lock:
                    newest = versions.begun[file_id]
                _check_words(buf[:n], at, file_id + 1, oldest, newest)
                if n < MiB:
                    break
        except AssertionError as exc:
            failures.append(f"{'O_DIRECT' if direct else 'buffered'}: {exc}")
            return
        finally:
            os.close(fd)


def test_changes_among_native_reads_never_yield_old_or_wrong_bytes(kvfs):
    versions = _Versions()
    for file_id in range(STRESS_FILES):
        (kvfs.mnt / f"f{file_id}").write_bytes(_version_bytes(file_id + 1, 0))
    kvfs.flush()
    start = _native(kvfs)
    stop, failures = threading.Event(), []
    readers = [threading.Thread(target=_read_and_check, args=(kvfs, versions, random.Random(seed), direct,
                                                               stop, failures))
               for seed, direct in enumerate([True, True, False])]
    for t in readers:
        t.start()
    kinds = []
    try:
        rng = random.Random(42)
        for _ in range(STRESS_CHANGES):
            kinds.append(_mutate(kvfs, versions, rng))
            if failures:
                break
    finally:
        stop.set()
        for t in readers:
            t.join(120)
    assert not failures, failures
    end = _native(kvfs)
    assert end["native_reads"] > start["native_reads"], "no READ was native: the test tested nothing"
    assert end["native_withdrawals"] > start["native_withdrawals"]
    assert end["native_forwarded_reads"] > start["native_forwarded_reads"]
    assert {"rewrite", "overwrite", "truncate", "rename"} <= set(kinds), kinds
