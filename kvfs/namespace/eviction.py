"""Automatic and manual eviction: a full store makes room instead of failing the engine.

When used space crosses ``high_watermark``, sealed, closed, unpinned files are
removed in the policy's order (``policy.py``) until used space is below
``low_watermark``. A writer that finds no space waits for the same eviction
(back-pressure) and gets ENOSPC only when everything left is open, dirty or
pinned. An evicted file simply disappears from the namespace, so the engine sees
ENOENT, a cache miss, never a short or wrong read.

An eviction is journaled like an unlink: one Remove record per name of the
file, appended together and committed in one journal frame, so after a crash
the file is either whole or gone. Eviction runs on the event loop, between
awaits, so no operation sees a file half removed.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from operator import attrgetter
from stat import S_IFREG
from typing import Any, Iterable

from .. import schema
from ..base.crashpoints import crashpoint
from ..errors import InvalidArgument
from .inodes import Inode, names_of
from .policy import DEFAULT_POLICY, POLICIES

log = logging.getLogger(__name__)
_INO, _MTIME = attrgetter("ino"), attrgetter("mtime")

COMMIT_EVERY_BYTES = 256 << 20    # evicted bytes between commits (frees are reusable only once committed)


@dataclasses.dataclass(frozen=True)
class EvictionStatistics:
    policy: str
    high_watermark: float
    low_watermark: float
    evictions: int
    evicted_bytes: int
    pinned_files: int
    pinned_bytes: int


class Evictor:
    """Owned by the Namespace; sees the tree and asks the namespace to journal and commit."""

    def __init__(self, namespace: Any, *, policy: str = DEFAULT_POLICY, high_watermark: float = 0.9,
                 low_watermark: float = 0.8) -> None:       # namespace: the Namespace (a cycle to import)
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown eviction policy {policy!r} (use {', '.join(sorted(POLICIES))})")
        if not 0 < low_watermark < high_watermark <= 1:
            raise InvalidArgument("watermarks out of order: need 0 < low_watermark < high_watermark <= 100%")
        self.ns = namespace
        self.tree = namespace.tree
        self.policy = POLICIES[policy]()
        self.high, self.low = high_watermark, low_watermark
        self.evictions = self.evicted_bytes = 0
        self.tree.on_drop = self.forget
        # Called with (parent, name, ino) for each name eviction removes: the FUSE layer
        # drops it from the kernel's dentry cache (kvfs/fuse/ops.py). None: not mounted.
        self.entry_removed = None

    # -- what the policy hears -----------------------------------------------
    def load(self) -> None:
        """After mount: every file with content, oldest modification first (no access history survives)."""
        # (_rare None: not provisional, without a property call a file; inodes.py)
        files = [i for i in self.tree.inodes.values()
                 if i.mode & 0o170000 == S_IFREG and (i._rare is None or not i.provisional)]
        # Two stable sorts give (mtime, ino) order with keys that are the
        # inodes' own ints: a key tuple per file was 64 bytes at mount's peak.
        # attrgetter, not a lambda: a Python call per file costs ~1,000 instructions.
        files.sort(key=_INO)
        files.sort(key=_MTIME)
        inodes = self.tree.inodes
        self.policy.load(list(map(_INO, files)), lambda ino: inodes[ino].size_committed)

    def sealed(self, inode: Inode) -> None:
        self.policy.insert(inode.ino, inode.size_committed)

    def accessed(self, inode: Inode) -> None:
        self.policy.access(inode.ino)

    def forget(self, inode: Inode) -> None:
        self.policy.remove(inode.ino)

    # -- space ------------------------------------------------------------------
    def used_fraction(self) -> float:
        capacity = self.ns.journal.capacity_bytes()
        return 1 - max(0, self.ns.journal.available_bytes()) / capacity if capacity else 0.0

    def over_high_watermark(self) -> bool:
        return self.policy.name != "none" and self.used_fraction() > self.high

    def evictable(self, inode: Inode | None) -> bool:
        return (inode is not None and inode.is_file and not inode.opens and not inode.writers
                and not inode.content_dirty and not inode.provisional and not inode.sealing
                and inode.ino not in self.tree.pinned)

    def choose(self, *, free_bytes: int = 0, to_used: float | None = None, older_than_ns: int | None = None,
               inos: Iterable[int] | None = None) -> list[Inode]:
        """The files to evict, in policy order, for one of the ways of asking. No side effects
        beyond the policy's own bookkeeping of the walk."""
        capacity = self.ns.journal.capacity_bytes()
        if to_used is not None:
            free_bytes = max(0, int((self.used_fraction() - to_used) * capacity))
        chosen, planned = [], 0
        if inos is not None:
            return [self.tree.inodes[i] for i in inos if self.evictable(self.tree.inodes.get(i))]
        walk = self.policy.victims()
        # Stop before taking the next victim, not after: the walk moves a file it
        # yields to the back of its queue, as if the evictor had skipped it.
        while older_than_ns is not None or planned < free_bytes:
            ino = next(walk, None)
            if ino is None:
                break
            inode = self.tree.inodes.get(ino)
            if inode is None:
                self.policy.remove(ino)
                continue
            if not self.evictable(inode):
                continue
            if older_than_ns is not None:
                if inode.mtime <= older_than_ns and inode.atime <= older_than_ns:
                    chosen.append(inode)
                continue
            chosen.append(inode)
            planned += inode.size_committed
        return chosen

    async def evict(self, inodes: Iterable[Inode]) -> tuple[int, int]:
        """Remove ``inodes`` (journaled like unlinks, committed); returns (files, bytes)."""
        count = nbytes = since_commit = 0
        for inode in inodes:
            if not self.evictable(inode) or inode.ino not in self.tree.inodes:
                continue                    # changed while an earlier commit was awaited
            size = inode.size_committed
            now = self.ns.now()
            inode.evicted = True
            for parent, name in sorted(names_of(inode)):
                self.ns._emit(schema.Remove(parent, name, now))
                if self.entry_removed is not None:
                    self.entry_removed(parent, name, inode.ino)
            crashpoint("evict-file-removed")
            count += 1
            nbytes += size
            since_commit += size
            if since_commit >= COMMIT_EVERY_BYTES:
                await self.ns.commit()
                since_commit = 0
        if count:
            await self.ns.commit()
            crashpoint("evict-committed")
            self.evictions += count
            self.evicted_bytes += nbytes
            log.info("evicted %d file(s), %d bytes (policy %s, used now %.1f%%)", count, nbytes,
                     self.policy.name, 100 * self.used_fraction())
        return count, nbytes

    async def make_room(self, nbytes: int = 0) -> int:
        """Evict down to the low watermark (and at least ``nbytes``); returns the files evicted."""
        capacity = self.ns.journal.capacity_bytes()
        need = max(int((self.used_fraction() - self.low) * capacity), nbytes)
        if need <= 0 or self.policy.name == "none":
            return 0
        count, _ = await self.evict(self.choose(free_bytes=need))
        return count

    def pinned_bytes(self) -> int:
        return sum(self.tree.inodes[i].size_committed for i in self.tree.pinned if i in self.tree.inodes)

    def statistics(self) -> EvictionStatistics:
        return EvictionStatistics(self.policy.name, self.high, self.low, self.evictions, self.evicted_bytes,
                                  len(self.tree.pinned), self.pinned_bytes())


def older_than(seconds: float, now_ns: int | None = None) -> int:
    """The timestamp (ns) before which a file counts as older than ``seconds``."""
    return (now_ns if now_ns is not None else time.time_ns()) - int(seconds * 1e9)


class Admin:
    """What ``kvfs-admin evict``, ``pin`` and ``unpin`` ask of a running daemon."""

    def __init__(self, namespace: Any, evictor: Evictor) -> None:
        self.ns, self.evictor = namespace, evictor

    async def evict(self, *, to_used: float | None = None, free_bytes: int | None = None,
                    older_than_s: float | None = None, inos: Iterable[int] | None = None,
                    dry_run: bool = False) -> dict[str, Any]:
        if sum(x is not None for x in (to_used, free_bytes, older_than_s, inos)) != 1:
            raise InvalidArgument("evict needs exactly one of to_used, free_bytes, older_than, paths")
        if to_used is not None and not 0 <= to_used <= 1:
            raise InvalidArgument("--to-used must be a percentage from 0 to 100")
        chosen = self.evictor.choose(free_bytes=free_bytes or 0, to_used=to_used, inos=inos,
                                     older_than_ns=None if older_than_s is None else older_than(older_than_s))
        report = {"dry_run": dry_run, "files": len(chosen), "bytes": sum(i.size_committed for i in chosen),
                  "inos": [i.ino for i in chosen][:1000]}
        if not dry_run:
            report["files"], report["bytes"] = await self.evictor.evict(chosen)
        report["used_fraction"] = round(self.evictor.used_fraction(), 4)
        return report

    async def pin(self, inos: Iterable[int], pinned: bool = True) -> dict[str, int]:
        """Pin or unpin files; durable (a checkpoint) before this returns."""
        tree = self.ns.tree
        for ino in inos:
            inode = tree.inodes.get(ino)
            if inode is None or not inode.is_file:
                raise InvalidArgument(f"inode {ino} is not a regular file on this mount")
        before = set(tree.pinned)
        (tree.pinned.update if pinned else tree.pinned.difference_update)(inos)
        try:
            await self.ns.checkpoint()
        except BaseException:
            # Pins are recorded only by checkpoints: one that failed leaves them as
            # they were, so that no later checkpoint (or the skipped one at
            # unmount, Durability.checkpoint_unless_folded) differs from what the caller was told.
            tree.pinned.clear()
            tree.pinned.update(before)
            raise
        return {"pinned_files": len(tree.pinned), "pinned_bytes": self.evictor.pinned_bytes()}
