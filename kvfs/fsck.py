"""Offline consistency check and repair.

The check loads the store exactly as mount does (newest checkpoint plus journal
replay) and then verifies, independently of the code that maintains them:

* the backup superblock matches the primary;
* the directory tree: every entry names an existing inode, every inode is
  reachable from the root, link counts match, directory parents match;
* block references: every key a file names is in the index, each entry's
  ``refs`` equals the number of times files name it, no entry is unreferenced;
* space: block extents and free extents tile the data region exactly;
* data: every block is read back and its content key recomputed.

``repair`` removes files whose blocks are missing or corrupt, drops unreachable
inodes and unreferenced blocks, recomputes link and reference counts, rebuilds
the free-space map, restores a bad primary superblock from the backup, and
writes everything as a fresh checkpoint.
"""
import collections
import concurrent.futures
import logging

import trio

from . import format as fmt
from .blockcache import BlockCache
from .blockindex import BlockIndex, _aligned
from .device import Device
from .errors import CorruptBlock, DeviceError, FormatError
from .extents import Allocator, ExtentStore
from .namespace import ROOT_INO, Namespace

log = logging.getLogger(__name__)


class Report:
    def __init__(self):
        self.problems = []
        self.notes = []
        self.repairs = []

    def problem(self, text):
        self.problems.append(text)

    @property
    def clean(self):
        return not self.problems


def restore_superblock_from_backup(device):
    head = device.pread_sync(0, 2 * fmt.SECTOR)
    fmt.Superblock.decode(head[fmt.SECTOR:])           # raises if the backup is bad too
    device.pwrite_sync(0, head[fmt.SECTOR:])
    device.sync_sync()


def check(path, *, repair=False, verify_data=True):
    """Check (and optionally repair) the kvfs on ``path``. Returns a Report."""
    report = Report()
    device = Device.open(path, readonly=not repair)
    try:
        head = device.pread_sync(0, 2 * fmt.SECTOR)
        try:
            fmt.Superblock.decode(head[:fmt.SECTOR])
        except FormatError as exc:
            if not repair:
                raise
            restore_superblock_from_backup(device)
            report.repairs.append(f"primary superblock was bad ({exc}); restored it from the backup")
        if head[:fmt.SECTOR] != head[fmt.SECTOR:]:
            report.problem("backup superblock differs from the primary")
            if repair:
                device.pwrite_sync(fmt.SECTOR, device.pread_sync(0, fmt.SECTOR))
                report.repairs.append("rewrote the backup superblock")
        store = ExtentStore.open(device)
        report.notes.append(f"journal: {store.replay_report}")
        index = BlockIndex(store)
        cache = BlockCache(index, cache_size=64 << 20, dirty_limit=32 << 20)
        ns = Namespace(cache, store)
        try:
            ns.load(store.checkpoint_state, store.replay_records)
        except Exception as exc:
            raise FormatError(f"journal replay failed: {exc!r}") from None
        store.finish_replay()
        store.set_snapshot_source(ns.snapshot)
        _check_tree(ns, report, repair)
        bad_keys = _check_data(index, report, verify_data)
        _check_blocks(ns, index, report, repair, bad_keys)
        _check_space(store, index, report, repair)
        if repair and (report.problems or report.repairs):
            trio.run(store.checkpoint)
            report.repairs.append(f"wrote checkpoint generation {store.generation}")
        return report
    finally:
        device.close()


def _paths(ns):
    """inode -> list of paths, walking from the root (also marks reachability)."""
    paths = collections.defaultdict(list)
    paths[ROOT_INO].append("/")
    todo = [(ROOT_INO, "")]
    seen = {ROOT_INO}
    while todo:
        ino, prefix = todo.pop()
        for name, (child, _) in list(ns.inodes[ino].entries.by_name.items()):
            path = f"{prefix}/{name.decode(errors='replace')}"
            paths[child].append(path)
            node = ns.inodes.get(child)
            if node is not None and node.is_dir and child not in seen:
                seen.add(child)
                todo.append((child, path))
    return paths


def _check_tree(ns, report, repair):
    for ino, inode in list(ns.inodes.items()):
        if not inode.is_dir:
            continue
        for name, (child, _) in list(inode.entries.by_name.items()):
            if child not in ns.inodes:
                report.problem(f"directory {ino} entry {name!r} names missing inode {child}")
                if repair:
                    inode.entries.remove(name)
    top = max(ns.inodes)
    if ns.next_ino <= top:
        report.problem(f"next inode number {ns.next_ino} is not above the largest in use ({top})")
        if repair:
            ns.next_ino = top + 1
    paths = _paths(ns)
    links = collections.Counter()
    subdirs = collections.Counter()
    for inode in ns.inodes.values():
        if inode.is_dir:
            for _, (child, _) in inode.entries.by_name.items():
                links[child] += 1
                if child in ns.inodes and ns.inodes[child].is_dir:
                    subdirs[inode.ino] += 1
                    if ns.inodes[child].parent != inode.ino:
                        report.problem(f"directory {child} has parent {ns.inodes[child].parent}, "
                                       f"but is listed in {inode.ino}")
                        if repair:
                            ns.inodes[child].parent = inode.ino
    for ino, inode in list(ns.inodes.items()):
        if ino != ROOT_INO and ino not in paths:
            report.problem(f"inode {ino} is not reachable from the root")
            if repair:
                ns._drop_inode(inode)
            continue
        want = 2 + subdirs[ino] if inode.is_dir else links[ino]
        if inode.nlink != want:
            report.problem(f"{paths[ino][0] if paths[ino] else ino}: link count {inode.nlink}, expected {want}")
            if repair:
                inode.nlink = want
    ns.paths = paths


def _check_data(index, report, verify_data):
    """Read back every block and verify its content key; return the bad keys."""
    if not verify_data:
        return set()
    bad = set()

    def verify(key, off, length):
        try:
            index._read_verified(key, off, length)
        except (CorruptBlock, DeviceError) as exc:
            return key, str(exc)
        return key, None

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(verify, key, e.off, e.length) for key, e in index.entries.items()]
        for job in jobs:
            key, error = job.result()
            if error:
                bad.add(key)
                report.problem(f"block {key.hex()}: {error}")
    return bad


def _check_blocks(ns, index, report, repair, bad_keys):
    counted = collections.Counter()
    damaged = []
    for inode in ns.inodes.values():
        if not inode.is_file:
            continue
        keys = [k for k in inode.committed if k is not None]
        missing = [k for k in keys if k not in index.entries]
        if missing or any(k in bad_keys for k in keys):
            damaged.append(inode)
            what = "missing" if missing else "corrupt"
            for path in ns.paths.get(inode.ino, [str(inode.ino)]):
                report.problem(f"{path}: has {what} blocks; reading it gives EIO")
        counted.update(k for k in keys if k in index.entries)
    if repair:
        for inode in damaged:
            # Missing keys cannot be dereferenced when the file goes.
            inode.committed = [k if k in index.entries else None for k in inode.committed]
            for path in ns.paths.get(inode.ino, []):
                _remove_path(ns, path)
            report.repairs.append(f"removed damaged file {', '.join(ns.paths.get(inode.ino, [])) or inode.ino}")
        counted = collections.Counter()
        for inode in ns.inodes.values():
            if inode.is_file:
                counted.update(k for k in inode.committed if k is not None)
    for key, entry in list(index.entries.items()):
        if entry.refs != counted[key]:
            report.problem(f"block {key.hex()}: reference count {entry.refs}, files name it {counted[key]} times")
        if repair:
            if counted[key] == 0 or key in bad_keys:
                del index.entries[key]
                index.used_bytes -= _aligned(entry.length)
            else:
                entry.refs = counted[key]
                entry.pins = 0


def _remove_path(ns, path):
    parts = path.strip("/").split("/")
    ino = ROOT_INO
    for part in parts[:-1]:
        ino = ns.inodes[ino].entries.get(part.encode())
    name = parts[-1].encode()
    if ns.inodes.get(ino) and ns.inodes[ino].entries.get(name) is not None:
        ns._emit(["rm", ino, name, ns.now()])


def _check_space(store, index, report, repair):
    sb = store.sb
    used = sorted((e.off, _aligned(e.length)) for e in index.entries.values())
    free = store.allocator.extents()
    cursor = sb.data_off
    for off, n in sorted(used + [(o, n) for o, n in free]):
        if off < cursor:
            report.problem(f"extent at {off} overlaps the previous one")
        elif off > cursor:
            report.problem(f"{off - cursor} bytes at {cursor} are neither used nor free (leaked)")
        cursor = max(cursor, off + n)
    if cursor != sb.data_off + sb.data_len:
        report.problem(f"space map ends at {cursor}, data region ends at {sb.data_off + sb.data_len}")
    if repair:
        complement, cursor = [], sb.data_off
        for off, n in used:
            if off > cursor:
                complement.append((cursor, off - cursor))
            cursor = max(cursor, off + n)
        if cursor < sb.data_off + sb.data_len:
            complement.append((cursor, sb.data_off + sb.data_len - cursor))
        store.allocator = Allocator(sb.data_off, sb.data_len, complement)
        store._pending_frees = []
