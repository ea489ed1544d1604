"""Leases: a bypass reader's hold on a sealed file's blocks (kvfs.client, issue 35).

A client that may read the device itself (root, or the mount's ``bypass_group``)
asks for a file's block map; the namespace answers it only for a file whose
content is exactly what its stored blocks say (:meth:`BypassLeases.lease_blocks`:
sealed, nobody writing, no dirty block, no O_TRUNC window), and only under a
lease. The client then reads and verifies the blocks on its own, and ends the
lease (:meth:`BypassLeases.end_leases`), which says whether what it read is
still the file: the file's ``content_version`` (bumped on every change before
the change is answered) is the one the lease was granted at, and the lease had
not expired. A client that hears "no" throws its bytes away and reads through
the mount. So a client returns only bytes that were the file's content at the
moment its lease ended, and, every block being checked against its key, only
those.

While a lease is held its blocks are pinned in the index (the pins of
kvfs/blockindex/), so an unlink, rewrite, truncate or eviction that drops their
last reference leaves the extents allocated and unreused until the lease ends:
the client reads the bytes it was told of, not a newer file's. A lease ends
at the latest ``seconds`` after it was granted (mount option ``lease_seconds``),
released or not, so a client killed with -9 pins space for that long at most.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Sequence

import trio

from ..blockcache.port import CachePort
from ..errors import KvfsError
from .inodes import VIEW_BIT, Inode
from .port import LeaseGrant

DEFAULT_LEASE_SECONDS = 5.0
MIN_LEASE_SECONDS, MAX_LEASE_SECONDS = 0.1, 3600.0
MOST_LEASES = 1 << 16           # held at once: a client in a loop cannot pin the whole store


@dataclasses.dataclass(frozen=True)
class LeaseStatistics:
    leases_held: int
    lease_bytes_held: int        # bytes of the extents held leases name (each extent once)
    lease_deferred_bytes: int    # of those, extents no durable content names: freed when their leases end
    leases_granted: int
    leases_released: int         # ended by the client, content unchanged: its bytes stand
    leases_stale: int            # ended by the client after a change, past expiry or unknown: it read again
    leases_expired: int          # ended by time, never released (a client killed, or too slow)
    leases_refused: int          # asked for a file not on the device as it is (dirty, open for writing), or too many


class Lease:
    __slots__ = ("inode", "generation", "keys", "expires", "nbytes")

    def __init__(self, inode: Inode, keys: list[bytes], expires: float, nbytes: int) -> None:
        self.inode, self.generation, self.keys = inode, inode.content_version, keys
        self.expires, self.nbytes = expires, nbytes


class LeaseTable:
    """The leases held; each pins its blocks through ``cache`` until it ends."""

    def __init__(self, cache: CachePort, *, seconds: float = DEFAULT_LEASE_SECONDS,
                 clock: Callable[[], float] = time.monotonic, most: int = MOST_LEASES) -> None:
        self.cache, self.clock, self.most = cache, clock, most
        self.seconds = check_lease_seconds(seconds)
        self.held: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self.sweeping = False
        self._s = dict.fromkeys(("granted", "released", "stale", "expired", "refused"), 0)

    def grant(self, inode: Inode, blocks: list) -> tuple[int, float] | None:
        """Pin ``blocks`` ((off, length, key, salt) or None) for a new lease on ``inode``: (id, seconds)."""
        self.expire()
        if len(self.held) >= self.most:
            self.refused()
            return None
        keys = [b[2] for b in blocks if b is not None]
        self.cache.hold_blocks(keys)
        lease_id = next(self._ids)
        nbytes = sum(b[1] for b in blocks if b is not None)
        self.held[lease_id] = Lease(inode, keys, self.clock() + self.seconds, nbytes)
        self._s["granted"] += 1
        return lease_id, self.seconds

    def refused(self) -> None:
        self._s["refused"] += 1

    def end(self, ids: Sequence[int]) -> list[bool]:
        """End each lease; per id whether the bytes read under it are still the file's content."""
        now = self.clock()
        out = []
        for lease_id in ids:
            lease = self.held.pop(lease_id, None)
            valid = lease is not None and now <= lease.expires and \
                lease.inode.content_version == lease.generation
            if lease is not None:
                self.cache.let_go_blocks(lease.keys)
            self._s["released" if valid else "stale"] += 1
            out.append(valid)
        self.expire()
        return out

    def expire(self) -> None:
        """End every lease past its time."""
        now = self.clock()
        for lease_id in [i for i, lease in self.held.items() if lease.expires < now]:
            self.cache.let_go_blocks(self.held.pop(lease_id).keys)
            self._s["expired"] += 1

    def next_expiry(self) -> float | None:
        return min((lease.expires for lease in self.held.values()), default=None)

    def statistics(self) -> LeaseStatistics:
        keys, nbytes = set(), 0
        for lease in self.held.values():       # leases last seconds: a few thousand at most
            keys.update(lease.keys)
            nbytes += lease.nbytes
        s = self._s
        return LeaseStatistics(len(self.held), nbytes, self.cache.unreferenced_bytes(keys), s["granted"],
                               s["released"], s["stale"], s["expired"], s["refused"])


def check_lease_seconds(seconds: Any) -> float:
    """``lease_seconds`` as a float, or ValueError saying what is allowed."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        raise ValueError(f"lease_seconds must be a number of seconds, not {seconds!r}") from None
    if not (math.isfinite(value) and MIN_LEASE_SECONDS <= value <= MAX_LEASE_SECONDS):
        raise ValueError(f"lease_seconds must be from {MIN_LEASE_SECONDS} to {MAX_LEASE_SECONDS:g} seconds, "
                         f"not {seconds!r}")
    return value


class BypassLeases:
    """Mixed into :class:`~kvfs.namespace.Namespace`: block maps under leases for the FUSE layer."""

    leases: LeaseTable

    async def lease_blocks(self, ino: int) -> LeaseGrant | None:
        """A sealed file's blocks as they lie on the device, under a new lease; None if the
        file is not exactly its stored blocks now (or too many leases are held).

        A file closed but not sealed yet (just written, or just fetched from the shared
        tier by the lookup that named it) is sealed first, as ``user.kvfs.key`` does:
        the client then reads the device instead of falling back to the mount."""
        inode = None if ino & VIEW_BIT else self.tree.inodes.get(ino) or self.tree.orphans.get(ino)
        if inode is None or not inode.is_file:
            self.leases.refused()
            return None
        if inode.content_dirty:                 # seal returns at once for a file with a writer, or unlinked
            try:
                await self.seal(inode)
            except KvfsError:
                pass                            # logged by the seal; not ready below: refused
        # The client asks by path, without an open (so the daemon does not also read
        # the file for it): an idle file's live content is built for the grant and
        # dropped again after (the lease pins the blocks themselves).
        with self.idle.holding(inode):
            if inode.data is None and inode.ino in self.tree.inodes:
                self.idle.live_data(inode)
            if not self._lease_ready(inode):
                self.leases.refused()
                return None
            size = inode.data.size
            blocks = self.cache.stored_extents(inode.data)
            if blocks is None:
                self.leases.refused()
                return None
            blocks = blocks[:-(-size // self.block_size)]          # none past the end
            granted = self.leases.grant(inode, blocks)
        if granted is None:
            return None
        self.evictor.accessed(inode)            # a bypass read is a read: eviction keeps it recent
        self._sweep_leases_soon()
        return LeaseGrant(granted[0], granted[1], inode.content_version, size, self.block_size, blocks)

    def end_leases(self, ids: Sequence[int]) -> list[bool]:
        """End the leases ``ids``; per id, whether what was read under it is still the file's content."""
        return self.leases.end(ids)

    # The native read plane's pins (kvfs/fuse/frontend.py): the blocks of a version it may
    # still read stay allocated, and unreused, until it lets go of them.
    def hold_blocks(self, keys: Sequence[bytes]) -> None:
        self.cache.hold_blocks(keys)

    def let_go_blocks(self, keys: Sequence[bytes]) -> None:
        self.cache.let_go_blocks(keys)

    @staticmethod
    def _lease_ready(inode: Inode) -> bool:
        data = inode.data
        return data is not None and not (inode.writers or inode.page_writers or inode.content_dirty
                                         or inode.pre_truncate is not None or data.failed or data.dirty_count)

    def _sweep_leases_soon(self) -> None:
        if not self.leases.sweeping and self._nursery is not None:
            self.leases.sweeping = True
            self._nursery.start_soon(self._sweep_leases)

    async def _sweep_leases(self) -> None:
        """End leases as they expire, so that a client killed with -9 gives the space back; ends
        when none is held (the next grant starts it again)."""
        try:
            while True:
                self.leases.expire()
                expiry = self.leases.next_expiry()
                if expiry is None:
                    return
                await trio.sleep(max(expiry - self.leases.clock(), 0) + 0.01)
        finally:
            self.leases.sweeping = False
