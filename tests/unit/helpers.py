"""Shared helpers for the in-process unit tests.

Everything here uses the real kvfs layers over a real sparse store file; the
only thing this module adds is the plumbing every test needs (mkfs, assemble
the stack, run its background tasks, persist, close, fsck).
"""
import contextlib
import json
import os
import stat

import trio
import trio.testing

import time

import msgpack
from hypothesis import strategies as st

from kvfs import schema
from kvfs.device import Device
from kvfs.device import testfaults as kvfs_faults
from kvfs.server import fsck
from kvfs.server.daemon import MountOptions
from kvfs.namespace import ROOT_INO
from kvfs.server.stack import Filesystem
from kvfs.store import MmpSettings, mmp
from kvfs.store.loader import load
from kvfs.store.mkfs import make_filesystem

BS = 64 << 10                 # smallest legal block size: keeps the tests fast
DEV_SIZE = schema.MIN_DEVICE_SIZE
FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755


def mkfs(tmp_path, *, size=DEV_SIZE, block_size=BS, name="store.kvfs"):
    """A freshly formatted sparse store file; returns its path."""
    path = tmp_path / name
    make_filesystem(str(path), size, block_size)
    return path


class Clock:
    """A deterministic ``now`` for the namespace: 1 µs steps from a fixed epoch."""

    def __init__(self, start=1_700_000_000_000_000_000):
        self.t = start

    def __call__(self):
        self.t += 1000
        return self.t


def options(*, cache_size=32 * BS, dirty_limit=16 * BS, read_depth=8, flush_workers=4, io_retry=0.0,
            **more):
    # io_retry 0: an injected EIO is an error at once (tests of the retry window set it).
    return MountOptions(cache_size=cache_size, dirty_limit=dirty_limit, read_depth=read_depth,
                        flush_workers=flush_workers, io_retry=io_retry, **more)


def slow_writes(seconds):
    """A fault plan (kvfs/device/testfaults.py) that delays every device write by ``seconds``."""
    return [{"op": "write", "effect": "delay", "seconds": seconds}]


def write_plan(path, plan):
    """Replace a fault plan file the way a test must: atomically, by rename; then wait
    until a running device has had time to reload it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan))
    os.replace(tmp, path)
    time.sleep(kvfs_faults.RELOAD_INTERVAL * 1.5)


def open_fs(path, *, now=None, readonly=False, faults=None, **kw):
    """The whole stack over ``path``, built by ``kvfs.server.stack.Filesystem.open`` as the daemon builds it.

    ``now`` is the namespace's clock (a :class:`Clock` for deterministic
    timestamps); without it the real clock is used. ``faults`` is a fault
    plan for the device, handed over the way a test hands it to a daemon
    ($KVFS_TEST_FAULTS, read once while the device is opened).
    """
    saved = os.environ.get(kvfs_faults.ENV)
    if faults is not None:
        os.environ[kvfs_faults.ENV] = json.dumps(faults)
    try:
        return Filesystem.open(str(path), options(**kw), readonly=readonly,
                               now=time.time_ns if now is None else now)
    finally:
        if faults is not None:
            if saved is None:
                del os.environ[kvfs_faults.ENV]
            else:
                os.environ[kvfs_faults.ENV] = saved


@contextlib.asynccontextmanager
async def running(fs, *, commit_interval=None, persist=True):
    """Run the cache's flush workers (and optionally ``Namespace.run``).

    On a normal exit everything is made durable: all dirty data flushed, file
    contents recorded, the journal committed and a checkpoint written.
    """
    async with trio.open_nursery() as nursery:
        await nursery.start(fs.cache.run)
        if commit_interval is not None:
            await nursery.start(fs.ns.run, commit_interval)
        yield nursery
        if persist:
            await fs.ns.flush_all()
            await fs.ns.checkpoint()
        nursery.cancel_scope.cancel()


def assert_fsck_clean(path):
    """Run the offline checker (with data verification); it must find nothing."""
    report = fsck.check(str(path))
    assert report.clean, "fsck found problems:\n  " + "\n  ".join(report.problems)
    return report


def close_and_check(fs):
    """Close the stack's device and fsck the store; it must come back clean."""
    path = fs.device.path
    fs.close()
    return assert_fsck_clean(path)


def flip_byte(path, off):
    """Corrupt one byte of the store file in place (behind the device's back)."""
    fd = os.open(str(path), os.O_RDWR)
    try:
        old = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return old


def poke(path, off, data):
    fd = os.open(str(path), os.O_RDWR)
    try:
        os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def peek(path, off, n):
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def pattern(seed, n):
    """``n`` deterministic, incompressible-looking bytes (distinct per seed)."""
    out = bytearray()
    x = (seed * 2654435761 + 1) & 0xFFFFFFFF
    while len(out) < n:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        out += x.to_bytes(4, "little")
    return bytes(out[:n])


async def write_file(ns, parent, name, data, *, mode=FILE_MODE, sync=True):
    """Create a file, write ``data``, optionally fsync it, close it; returns ino (one lookup held)."""
    ino = ns.make(parent, name, mode, 0, 0)
    fh, _, _ = ns.open(ino, os.O_WRONLY)
    if data:
        await ns.write(fh, 0, data)
    if sync:
        await ns.fsync(fh)
    await ns.release(fh)
    return ino


async def fill_files(ns, files, dirs=10):
    """``files`` files of 4 KiB with distinct contents, spread over ``dirs`` new directories."""
    parents = [ns.make(ROOT_INO, b"d%02d" % d, DIR_MODE, 0, 0) for d in range(dirs)]
    for i in range(files):
        ino = ns.make(parents[i % dirs], b"chunk-%06d.pt" % i, FILE_MODE, 0, 0)
        fh, _, _ = ns.open(ino, os.O_WRONLY)
        await ns.write(fh, 0, (i + 1).to_bytes(8, "little") * 512)
        await ns.release(fh)


async def read_all(ns, ino, size=None):
    fh, _, _ = ns.open(ino, os.O_RDONLY)
    try:
        n = ns.inode(ino).size if size is None else size
        return bytes(await ns.read(fh, 0, n))        # a copy: reads may return views of cache buffers
    finally:
        await ns.release(fh)


def lookup_path(ns, path):
    ino = ROOT_INO
    for part in path.strip("/").split("/"):
        ino = ns.tree.dir(ino).entries.get(part.encode())
        if ino is None:
            return None
    return ino


async def wait_until(predicate, *, what="condition", limit_s=20.0):
    """Poll ``predicate`` between trio checkpoints, bounded by *real* time.

    Device I/O runs in worker threads, so progress is measured in wall-clock
    time even under a mock clock.
    """
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.testing.wait_all_tasks_blocked()
        await trio.lowlevel.checkpoint()
        if not predicate():
            await trio.to_thread.run_sync(time.sleep, 0.002)
    return True


# -- multi-mount protection: a claim's time, standing still until it sleeps ---------------

class World:
    """Time that passes only when a probe or claim sleeps; ``during_sleep`` is what happens meanwhile."""

    def __init__(self):
        self.now = 0.0
        self.slept = []
        self.during_sleep = lambda: None

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds
        self.during_sleep()

    def clock(self):
        return self.now


def mmp_settings(world, host="host-b", interval=0.25, **kw):
    """MmpSettings for ``host`` whose sleeps and clock are ``world``'s."""
    return MmpSettings(interval=interval, host_id=host, hostname=host, sleep=world.sleep, clock=world.clock, **kw)


def on_disk(device, sb):
    """The MMP record on the device now."""
    return mmp.read_record(device, sb)[1]


# -- hostile checkpoints over a fuzzing image (tests/unit/fuzzing.py's Image) --------------

S = schema.SECTOR

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.binary(max_size=40)
    | st.text(max_size=10) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8) | st.integers(), inner,
                                                                 max_size=4),
    max_leaves=30)
modes = st.sampled_from([0o100644, 0o40755, 0o120777, 0o10644, 0o20644, 0, 0o170000, 0o777, -1])


def loaded_state(img):
    device = Device.open(img.path, readonly=True)
    try:
        return load(device)
    finally:
        device.close()


def slot_offset(img, state):
    """The slot that is not in use: a newer generation written there wins."""
    return (img.sb.checkpoint_a_off, img.sb.checkpoint_b_off)[1 - state.active_slot]


def write_checkpoint(img, state, wire, generation=None):
    """The damage: ``wire`` as the newest checkpoint, checksums right; journal then of an older generation."""
    payload = msgpack.packb(wire)
    if S + len(payload) > img.sb.checkpoint_len:
        return None
    generation = state.generation + 1 if generation is None else generation
    return [(slot_offset(img, state), schema.encode_checkpoint_header(generation, payload, img.sb.hash_seed)
             + payload)]


def hostile_writes(img, wire):
    """write_checkpoint's writes for ``wire`` on the image now; None when msgpack cannot
    encode it or it does not fit a slot (the case is then skipped)."""
    try:
        return write_checkpoint(img, loaded_state(img), wire)
    except (OverflowError, ValueError, TypeError):
        return None


def real_wire(img):
    """The image's newest checkpoint payload, as the msgpack map it is on the device."""
    state = loaded_state(img)
    off = (img.sb.checkpoint_a_off, img.sb.checkpoint_b_off)[state.active_slot]
    _, length, _ = schema.decode_checkpoint_header(img.read(off, S), img.sb.checkpoint_len, img.sb.hash_seed)
    return msgpack.unpackb(img.read(off + S, length), strict_map_key=False)


KEYS = ["next_ino", "inodes", "blocks", "free", "provisional", "pinned"]
EDITS = ["row-field", "dup-row", "drop-row", "dangling-entry", "cycle", "dir-hardlink", "block-field",
         "overlap-blocks", "overlap-free", "free-field", "dup-block", "top-type", "provisional", "root-type"]
hostile_ints = st.one_of(st.sampled_from([-1, -(1 << 63), 0, 1, 2, 15, 16, (1 << 63) - 1, (1 << 64) - 1]),
                         st.integers(-1000, 1 << 40))


def intact(dirs):
    """The directory rows whose payload an earlier "row-field" edit left a [parent, [entries]] pair."""
    return [r for r in dirs if len(r) > 9 and isinstance(r[9], list) and len(r[9]) == 2
            and isinstance(r[9][1], list)]


@st.composite
def hostile_state(draw, wire):
    wire = json.loads(json.dumps(wire, default=lambda b: {"__b": b.hex()}),
                      object_hook=lambda o: bytes.fromhex(o["__b"]) if "__b" in o else o)
    inodes, blocks, free = wire["inodes"], wire["blocks"], wire.setdefault("free", [])
    dirs = [r for r in inodes if r[1] & 0o170000 == 0o040000]
    files = [r for r in inodes if r[1] & 0o170000 == 0o100000]
    for edit in draw(st.lists(st.sampled_from(EDITS), min_size=1, max_size=3)):
        if edit == "row-field":
            row = draw(st.sampled_from(inodes))
            row[draw(st.integers(0, len(row) - 1))] = draw(hostile_ints | msgpack_values)
        elif edit == "dup-row":
            inodes.append(list(draw(st.sampled_from(inodes))))
        elif edit == "drop-row":
            inodes.remove(draw(st.sampled_from(inodes)))
        elif edit == "dangling-entry" and intact(dirs):
            draw(st.sampled_from(intact(dirs)))[9][1].append([b"ghost", draw(hostile_ints)])
        elif edit == "cycle" and intact(dirs):
            a, b = draw(st.sampled_from(intact(dirs))), draw(st.sampled_from(intact(dirs)))
            b[9][1].append([b"loop", a[0]])
            a[9][0] = b[0]
        elif edit == "dir-hardlink" and intact(dirs):
            draw(st.sampled_from(intact(dirs)))[9][1].append([b"again", draw(st.sampled_from(dirs))[0]])
        elif edit == "block-field" and blocks:
            row = draw(st.sampled_from(blocks))
            row[draw(st.integers(0, 3))] = draw(hostile_ints | msgpack_values)
        elif edit == "overlap-blocks" and len(blocks) > 1 and type(blocks[1][1]) is int:
            blocks[0][1] = blocks[1][1] + draw(st.sampled_from([0, S, -S]))
        elif edit == "overlap-free" and blocks and free:
            free.append([blocks[0][1], draw(st.sampled_from([S, BS, 1 << 30]))])
        elif edit == "free-field" and free:
            ext = draw(st.sampled_from(free))
            ext[draw(st.integers(0, 1))] = draw(hostile_ints)
        elif edit == "dup-block" and blocks:
            blocks.append(list(blocks[0]))
        elif edit == "top-type":
            wire[draw(st.sampled_from(KEYS))] = draw(msgpack_values)
        elif edit == "provisional":
            wire["provisional"] = draw(st.lists(hostile_ints | st.sampled_from([r[0] for r in files]), max_size=3))
        elif edit == "root-type":
            for root in (r for r in inodes if r[0] == ROOT_INO):
                root[1] = draw(modes)
        if not isinstance(wire.get("inodes"), list) or not inodes:
            break
    return wire
