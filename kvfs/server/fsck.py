"""Offline consistency check and repair.

The check loads the store exactly as mount does (newest checkpoint plus journal
replay, through ``kvfs.server.stack.load_tree``, without a block cache) and then
verifies the resulting state as schema rows (``kvfs.schema``), independently of
the code that maintains it:

* the backup superblock matches the primary;
* the directory tree: every entry names an existing inode, every inode is
  reachable from the root, link counts match, directory parents match;
* block references: every key a file names is in the index, each entry's
  ``refs`` equals the number of times files name it, no entry is unreferenced;
* space: block extents and free extents tile the data region exactly;
* data: every block is read back and its content key recomputed;
* multi-mount protection: the MMP record's state is reported, and a store whose
  record shows a live owner on another host is not checked (``force``: checked
  anyway, read-only); ``repair`` claims the record while it writes.

``repair`` removes files whose blocks are missing or corrupt, drops unreachable
inodes and unreferenced blocks, recomputes link and reference counts, rebuilds
the free-space map, restores a bad primary superblock from the backup, and
writes everything as a fresh checkpoint.
"""
import collections
import concurrent.futures
import logging

import trio

from .. import schema
from ..device import Device
from ..errors import Busy, CorruptBlock, DeviceError, FormatError
from ..namespace import ROOT_INO
from ..store import mmp, read_superblock
from ..store.loader import check_extent
from .stack import load_tree

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


def show(path):
    """A byte path for display; never decoded back (names are bytes end to end)."""
    return path.decode("utf-8", "backslashreplace")


def restore_superblock_from_backup(device):
    head = device.pread_sync(0, 2 * schema.SECTOR)
    schema.Superblock.decode(head[schema.SECTOR:])           # raises if the backup is bad too
    device.pwrite_sync(0, head[schema.SECTOR:])
    device.sync_sync()


def check(path, *, repair=False, verify_data=True, progress=None, force=False):
    """Check (and optionally repair) the kvfs on ``path``. Returns a Report.

    ``progress``: an object with ``update(done, total)`` told the bytes verified so
    far while every block is read back (fsck.kvfs shows it on a terminal).
    ``force``: check (or repair) even a store whose MMP record names a live owner.
    """
    report = Report()
    collector = _LogToReport(report)
    kvfs_log = logging.getLogger("kvfs")
    kvfs_log.addHandler(collector)
    try:
        return _check(path, report, repair, verify_data, progress, force)
    finally:
        kvfs_log.removeHandler(collector)


def _check_mmp(device, sb, report, repair, force):
    """Report the MMP record; refuse a live owner (unless ``force``). Returns the claim of a repair."""
    if not sb.has_mmp:
        report.notes.append("multi-mount protection: none (a format version 1 store)")
        return None
    _, record, damage = mmp.read_record(device, sb)
    if damage is not None:
        state = f"damaged ({damage}): mount treats it as an owner whose heartbeat stopped"
    elif record is None:
        state = "never claimed"
    else:
        state = f"{schema.MMP_STATES[record.state]}, {'last ' * (record.state == schema.MMP_CLEAN)}owner " \
                f"{mmp.describe(record)}"
    report.notes.append(f"multi-mount protection: {state}")
    settings = mmp.MmpSettings(force=force, program="fsck.kvfs")
    try:
        verdict = mmp.probe(device, sb, settings) if not repair else None
        guard = mmp.claim(device, sb, settings) if repair else None
    except Busy as exc:
        raise Busy(f"{exc}; fsck.kvfs checks no store that is in use (--force: check it anyway)") from None
    if verdict is not None and verdict.how == "forced":
        report.notes.append("warning: --force: not checked whether the MMP owner is alive; changes a live "
                            "owner is making may show up as problems")
    elif verdict is not None and verdict.how != "free":
        report.notes.append(f"multi-mount protection: the owner is gone ({verdict.how}); the next mount "
                            f"takes the store over")
    if guard is not None:
        guard.start_background()          # a long repair must not look like a dead owner
    return guard


class State:
    """The durable state as fsck sees it: schema rows, indexed for the checks, edited by repairs."""

    def __init__(self, checkpoint_state, blocks, free):
        self.next_ino = checkpoint_state.next_ino
        self.inodes = {row.ino: row for row in checkpoint_state.inodes}
        self.provisional = [i for i in checkpoint_state.provisional if i in self.inodes]
        self.blocks = {row.key: row for row in blocks}
        self.free = free
        self.paths = {}

    def file_rows(self):
        return [row for row in self.inodes.values() if schema_is_file(row)]

    def to_checkpoint(self):
        return schema.CheckpointState(next_ino=self.next_ino, inodes=list(self.inodes.values()),
                                      blocks=list(self.blocks.values()), free=None,
                                      provisional=self.provisional)


def schema_is_dir(row):
    return (row.mode & 0o170000) == 0o040000


def schema_is_file(row):
    return (row.mode & 0o170000) == 0o100000


def _check(path, report, repair, verify_data, progress, force):
    device = Device.open(path, readonly=not repair)
    guard = None
    try:
        head = device.pread_sync(0, 2 * schema.SECTOR)
        try:
            sb = schema.Superblock.decode(head[:schema.SECTOR])
        except FormatError as exc:
            if not repair:
                read_superblock(device)         # raises, naming the backup if that one is intact
                raise
            sb = schema.Superblock.decode(head[schema.SECTOR:])
            guard = _check_mmp(device, sb, report, repair, force)
            restore_superblock_from_backup(device)
            report.repairs.append(f"primary superblock was bad ({exc}); restored it from the backup")
        if guard is None:
            guard = _check_mmp(device, sb, report, repair, force)
        if head[:schema.SECTOR] != head[schema.SECTOR:]:
            report.problem("backup superblock differs from the primary")
            if repair:
                device.pwrite_sync(schema.SECTOR, device.pread_sync(0, schema.SECTOR))
                report.repairs.append("rewrote the backup superblock")
        try:
            store, index, tree, loaded, skipped = load_tree(device, salvage=True)
        except FormatError:
            raise
        except Exception as exc:
            raise FormatError(f"journal replay failed: {exc!r}") from None
        report.notes.append(f"journal: {loaded.replay_report}")
        for damage in loaded.damage:
            report.problem(f"{damage}: committed changes were lost; mount refuses this store")
        if loaded.damage:
            _account_losses(store, loaded, skipped, report)
        state = State(tree.snapshot(), index.rows(), store.free_extents())
        named = _count_names(state)          # before any repair removes a file
        _check_tree(state, report, repair)
        bad_keys = _check_data(index, state, report, verify_data, progress, store.sb)
        _check_space(store.sb, state, report)
        _check_blocks(state, report, repair, bad_keys, named)
        if repair and (report.problems or report.repairs):
            # Above every generation seen: a newer generation's leftover frames
            # must never replay on top of the repaired state.
            generation = trio.run(store.write_repaired, state.to_checkpoint(), _complement(store.sb, state),
                                  loaded.highest_generation)
            report.repairs.append(f"wrote checkpoint generation {generation}")
        return report
    finally:
        if guard is not None:
            _release(guard, report)
        device.close()


def _release(guard, report):
    try:
        guard.stop_background()
        guard.release_sync()
    except Exception as exc:  # noqa: BLE001 - the repair's outcome stands; say what happened
        report.problem(f"multi-mount protection: the record was not ours at the end of the repair ({exc})")


def _account_losses(store, loaded, skipped, report):
    lost_frames = loaded.replay_report.get("lost_frames", 0)
    applied = len(loaded.records) - skipped
    if store.generation < loaded.highest_generation:
        report.lost.append(f"changes made between checkpoint generation {store.generation} and "
                           f"generation {loaded.highest_generation} (they were in a damaged checkpoint or in "
                           f"journal frames since overwritten)")
    if lost_frames:
        report.lost.append(f"{lost_frames} corrupt journal frame(s) and the records in them")
    if skipped:
        report.lost.append(f"{skipped} of {len(loaded.records)} replayed record(s) that no longer "
                           f"apply were skipped; {applied} applied")
    elif loaded.records:
        report.notes.append(f"all {applied} replayed record(s) after the loss applied")


def _paths(state):
    """inode -> list of (path, parent inode, name), walking from the root; paths are bytes."""
    paths = collections.defaultdict(list)
    paths[ROOT_INO].append((b"/", None, None))
    todo = [(ROOT_INO, b"")]
    seen = {ROOT_INO}
    while todo:
        ino, prefix = todo.pop()
        for name, child in list(state.inodes[ino].entries):
            path = prefix + b"/" + name
            paths[child].append((path, ino, name))
            node = state.inodes.get(child)
            if node is not None and schema_is_dir(node) and child not in seen:
                seen.add(child)
                todo.append((child, path))
    return paths


def _remove_entry(state, parent, name):
    directory = state.inodes[parent]
    directory.entries = [(n, i) for n, i in directory.entries if n != name]


def _check_tree(state, report, repair):
    for ino, row in list(state.inodes.items()):
        if not schema_is_dir(row):
            continue
        for name, child in list(row.entries):
            if child not in state.inodes:
                report.problem(f"directory {ino} entry {name!r} names missing inode {child}")
                if repair:
                    _remove_entry(state, ino, name)
    top = max(state.inodes)
    if state.next_ino <= top:
        report.problem(f"next inode number {state.next_ino} is not above the largest in use ({top})")
        if repair:
            state.next_ino = top + 1
    paths = _paths(state)
    links = collections.Counter()
    subdirs = collections.Counter()
    for row in state.inodes.values():
        if schema_is_dir(row):
            for _, child in row.entries:
                links[child] += 1
                node = state.inodes.get(child)
                if node is not None and schema_is_dir(node):
                    subdirs[row.ino] += 1
                    if node.parent != row.ino:
                        report.problem(f"directory {child} has parent {node.parent}, but is listed in {row.ino}")
                        if repair:
                            node.parent = row.ino
    for ino, row in list(state.inodes.items()):
        if ino != ROOT_INO and ino not in paths:
            report.problem(f"inode {ino} is not reachable from the root")
            if repair:
                del state.inodes[ino]
            continue
        want = 2 + subdirs[ino] if schema_is_dir(row) else links[ino]
        if row.nlink != want:
            where = show(paths[ino][0][0]) if paths[ino] else ino
            report.problem(f"{where}: link count {row.nlink}, expected {want}")
            if repair:
                row.nlink = want
    state.paths = paths


def _check_data(index, state, report, verify_data, progress=None, sb=None):
    """Read back every block and verify its content key; return the bad keys.

    A block whose extent is not a readable piece of the data region (a damaged
    checkpoint) is bad without being read.
    """
    if not verify_data:
        return set()
    bad = set()

    def verify(row):
        try:
            if sb is not None:
                check_extent(sb, row.off, row.length, "its extent")
            index.read_verified_sync(row.key, row.off, row.length, domain=row.domain)
        except (CorruptBlock, DeviceError, FormatError) as exc:
            return row.key, str(exc)
        return row.key, None

    rows = list(state.blocks.values())
    total, done = sum(r.length for r in rows), 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for row, (key, error) in zip(rows, pool.map(verify, rows)):
            if error:
                bad.add(key)
                report.problem(f"block {key.hex()}: {error}")
            done += row.length
            if progress is not None:
                progress.update(done, total)
    return bad


def _count_names(state):
    """How many times the files' durable contents name each key."""
    counted = collections.Counter()
    for row in state.file_rows():
        counted.update(k for k in row.keys if k is not None)
    return counted


def _check_blocks(state, report, repair, bad_keys, named):
    damaged = []
    for row in state.file_rows():
        keys = [k for k in row.keys if k is not None]
        missing = [k for k in keys if k not in state.blocks]
        if missing or any(k in bad_keys for k in keys):
            damaged.append(row)
            what = "missing" if missing else "corrupt"
            for path, _, _ in state.paths.get(row.ino, []) or [(str(row.ino).encode(), None, None)]:
                report.problem(f"{show(path)}: has {what} blocks; reading it gives EIO")
    if repair:
        for row in damaged:
            # The file goes as a whole, every name of it, in this pass; its
            # blocks are never turned into holes.
            names = state.paths.get(row.ino, [])
            for _, parent, name in names:
                if parent in state.inodes:
                    _remove_entry(state, parent, name)
            state.inodes.pop(row.ino, None)
            shown = ", ".join(show(p) for p, _, _ in names) or f"inode {row.ino}"
            report.repairs.append(f"removed damaged file {shown}")
            report.lost.append(f"damaged file {shown}")
    counted = _count_names(state)            # after the repair above removed files
    for key, block in list(state.blocks.items()):
        if key not in bad_keys and block.refs != named[key]:
            report.problem(f"block {key.hex()}: reference count {block.refs}, files name it {named[key]} times")
        if repair:
            if counted[key] == 0 or key in bad_keys:
                del state.blocks[key]
            else:
                block.refs = counted[key]


def _used_extents(state):
    return sorted((b.off, schema.align_up(b.length)) for b in state.blocks.values())


def _check_space(sb, state, report):
    """Block extents and free extents must tile the data region exactly."""
    cursor = sb.data_off
    for off, n in sorted(_used_extents(state) + [(o, n) for o, n in state.free]):
        if off < cursor:
            report.problem(f"extent at {off} overlaps the previous one")
        elif off > cursor:
            report.problem(f"{off - cursor} bytes at {cursor} are neither used nor free (leaked)")
        cursor = max(cursor, off + n)
    if cursor != sb.data_off + sb.data_len:
        report.problem(f"space map ends at {cursor}, data region ends at {sb.data_off + sb.data_len}")


def _complement(sb, state):
    """Repair: the free map as the exact complement of the remaining block extents."""
    complement, cursor = [], sb.data_off
    for off, n in _used_extents(state):
        if off > cursor:
            complement.append((cursor, off - cursor))
        cursor = max(cursor, off + n)
    if cursor < sb.data_off + sb.data_len:
        complement.append((cursor, sb.data_off + sb.data_len - cursor))
    return complement
