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
    """What a check found. Every text is one line; the CLI prints each under its prefix."""

    def __init__(self):
        self.problems = []
        self.notes = []
        self.repairs = []
        self.lost = []             # what a repair could not recover

    def problem(self, text):
        self.problems.append(text)

    @property
    def clean(self):
        return not self.problems


class _LogToReport(logging.Handler):
    """Loader and layer warnings during a check become report notes, not bare stderr lines."""

    def __init__(self, report):
        super().__init__(logging.WARNING)
        self.report = report

    def emit(self, record):
        self.report.notes.append(f"{record.levelname.lower()}: {record.getMessage()}")


class _SalvagingNamespace(Namespace):
    """A namespace that, while ``salvaging``, skips replayed records that do not apply.

    Used only when durable state proves that records were lost: the records
    after the loss were written against a state fsck no longer has, so some of
    them name inodes, names or extents that do not exist (or are taken). A
    skipped record may have applied partly; the checks after loading find and
    repair what that left behind (references are recounted, the free map is
    rebuilt, unreachable inodes dropped).
    """

    salvaging = False

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.skipped = 0

    def apply(self, rec):
        if not self.salvaging:
            return super().apply(rec)
        try:
            super().apply(rec)
        except Exception:               # noqa: BLE001 - any record that does not apply is skipped
            self.skipped += 1


def show(path):
    """A byte path for display; never decoded back (names are bytes end to end)."""
    return path.decode("utf-8", "backslashreplace")


def restore_superblock_from_backup(device):
    head = device.pread_sync(0, 2 * fmt.SECTOR)
    fmt.Superblock.decode(head[fmt.SECTOR:])           # raises if the backup is bad too
    device.pwrite_sync(0, head[fmt.SECTOR:])
    device.sync_sync()


def check(path, *, repair=False, verify_data=True):
    """Check (and optionally repair) the kvfs on ``path``. Returns a Report."""
    report = Report()
    collector = _LogToReport(report)
    kvfs_log = logging.getLogger("kvfs")
    kvfs_log.addHandler(collector)
    try:
        return _check(path, report, repair, verify_data)
    finally:
        kvfs_log.removeHandler(collector)


def _check(path, report, repair, verify_data):
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
        store = ExtentStore.open(device, salvage=True)
        report.notes.append(f"journal: {store.replay_report}")
        for damage in store.damage:
            report.problem(f"{damage}: committed changes were lost; mount refuses this store")
        index = BlockIndex(store)
        cache = BlockCache(index, cache_size=64 << 20, dirty_limit=32 << 20)
        ns = _SalvagingNamespace(cache, store)
        ns.salvaging = bool(store.damage)
        try:
            ns.load(store.checkpoint_state, store.replay_records)
        except Exception as exc:
            raise FormatError(f"journal replay failed: {exc!r}") from None
        ns.salvaging = False
        if store.damage:
            _account_losses(store, ns, report)
        store.finish_replay()
        store.set_snapshot_source(ns.snapshot)
        named = _count_names(ns)          # before any repair removes a file
        _check_tree(ns, report, repair)
        bad_keys = _check_data(index, report, verify_data)
        _check_space(store, index, report)
        _check_blocks(ns, index, report, repair, bad_keys, named)
        if repair:
            _rebuild_free_map(store, index)
        if repair and (report.problems or report.repairs):
            # Above every generation seen: a newer generation's leftover frames
            # must never replay on top of the repaired state.
            store.generation = max(store.generation, store.highest_generation)
            trio.run(store.checkpoint)
            report.repairs.append(f"wrote checkpoint generation {store.generation}")
        return report
    finally:
        device.close()


def _account_losses(store, ns, report):
    lost_frames = store.replay_report.get("lost_frames", 0)
    applied = len(store.replay_records) - ns.skipped
    if store.generation < store.highest_generation:
        report.lost.append(f"changes made between checkpoint generation {store.generation} and "
                           f"generation {store.highest_generation} (they were in a damaged checkpoint or in "
                           f"journal frames since overwritten)")
    if lost_frames:
        report.lost.append(f"{lost_frames} corrupt journal frame(s) and the records in them")
    if ns.skipped:
        report.lost.append(f"{ns.skipped} of {len(store.replay_records)} replayed record(s) that no longer "
                           f"apply were skipped; {applied} applied")
    elif store.replay_records:
        report.notes.append(f"all {applied} replayed record(s) after the loss applied")


def _paths(ns):
    """inode -> list of (path, parent inode, name), walking from the root; paths are bytes."""
    paths = collections.defaultdict(list)
    paths[ROOT_INO].append((b"/", None, None))
    todo = [(ROOT_INO, b"")]
    seen = {ROOT_INO}
    while todo:
        ino, prefix = todo.pop()
        for name, (child, _) in list(ns.inodes[ino].entries.by_name.items()):
            path = prefix + b"/" + name
            paths[child].append((path, ino, name))
            node = ns.inodes.get(child)
            if node is not None and node.is_dir and child not in seen:
                seen.add(child)
                todo.append((child, path))
    return paths


def _forget_inode(ns, inode):
    """Take an inode out of the namespace without touching block references.

    fsck recounts every reference from the remaining files afterwards, so the
    inode's blocks (some of which may be missing from the index) need no
    dereferencing here.
    """
    ns.inodes.pop(inode.ino, None)
    if inode.is_file:
        ns._forget_content_key(inode)
        inode.committed = []


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
                _forget_inode(ns, inode)
            continue
        want = 2 + subdirs[ino] if inode.is_dir else links[ino]
        if inode.nlink != want:
            where = show(paths[ino][0][0]) if paths[ino] else ino
            report.problem(f"{where}: link count {inode.nlink}, expected {want}")
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


def _count_names(ns):
    """How many times the files' durable contents name each key."""
    counted = collections.Counter()
    for inode in ns.inodes.values():
        if inode.is_file:
            counted.update(k for k in inode.committed if k is not None)
    return counted


def _check_blocks(ns, index, report, repair, bad_keys, named):
    damaged = []
    for inode in ns.inodes.values():
        if not inode.is_file:
            continue
        keys = [k for k in inode.committed if k is not None]
        missing = [k for k in keys if k not in index.entries]
        if missing or any(k in bad_keys for k in keys):
            damaged.append(inode)
            what = "missing" if missing else "corrupt"
            for path, _, _ in ns.paths.get(inode.ino, []) or [(str(inode.ino).encode(), None, None)]:
                report.problem(f"{show(path)}: has {what} blocks; reading it gives EIO")
    if repair:
        for inode in damaged:
            # The file goes as a whole, every name of it, in this pass; its
            # blocks are never turned into holes.
            names = ns.paths.get(inode.ino, [])
            now = ns.now()
            for _, parent, name in names:
                directory = ns.inodes.get(parent)
                if directory is not None and directory.entries.get(name) == inode.ino:
                    directory.entries.remove(name)
                    directory.mtime = directory.ctime = now
            _forget_inode(ns, inode)
            shown = ", ".join(show(p) for p, _, _ in names) or f"inode {inode.ino}"
            report.repairs.append(f"removed damaged file {shown}")
            report.lost.append(f"damaged file {shown}")
    counted = _count_names(ns)            # after the repair above removed files
    for key, entry in list(index.entries.items()):
        if key not in bad_keys and entry.refs != named[key]:
            report.problem(f"block {key.hex()}: reference count {entry.refs}, files name it {named[key]} times")
        if repair:
            if counted[key] == 0 or key in bad_keys:
                del index.entries[key]
                index.used_bytes -= _aligned(entry.length)
            else:
                entry.refs = counted[key]
                entry.pins = 0


def _check_space(store, index, report):
    """Block extents and free extents must tile the data region exactly."""
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


def _rebuild_free_map(store, index):
    """Repair: the free map becomes the exact complement of the remaining block extents."""
    sb = store.sb
    used = sorted((e.off, _aligned(e.length)) for e in index.entries.values())
    complement, cursor = [], sb.data_off
    for off, n in used:
        if off > cursor:
            complement.append((cursor, off - cursor))
        cursor = max(cursor, off + n)
    if cursor < sb.data_off + sb.data_len:
        complement.append((cursor, sb.data_off + sb.data_len - cursor))
    store.allocator = Allocator(sb.data_off, sb.data_len, complement)
    store._pending_frees = []
