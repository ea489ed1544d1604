"""The janitor: keeps one tenant's part of the tier under a capacity bound, oldest first.

The tier is a cache and nothing refcounts across hosts, so deleting is always safe:
a manifest whose block is gone, or a block no manifest names, is a miss at worst,
never wrong bytes (every block is checked against its name). One host of a tenant
runs it (mount option ``tier_capacity=SIZE`` on that host). Each sweep lists the
tenant's RADOS namespace with sizes and modification times and, when the total is
over the bound, deletes the oldest objects until it is under 90 % of it.
docs/scale-out.md has what this costs at fleet scale and where it stops scaling.
"""
from __future__ import annotations

import logging

import trio

from .backend import TierError

log = logging.getLogger(__name__)

LOW_WATER = 0.9


class Janitor:
    def __init__(self, backend, capacity_bytes: int, *, interval: float = 60.0):
        self.backend, self.capacity, self.interval = backend, capacity_bytes, interval
        self.sweeps = self.deleted = self.deleted_bytes = self.stored_bytes = self.stored_objects = 0

    async def sweep(self) -> int:
        """One pass; returns how many objects it deleted."""
        listing = await self.backend.listing()
        self.sweeps += 1
        total = sum(size for _, size, _ in listing)
        self.stored_bytes, self.stored_objects = total, len(listing)
        if total <= self.capacity:
            return 0
        target, deleted = int(self.capacity * LOW_WATER), 0
        for name, size, _mtime in sorted(listing, key=lambda row: (row[2], row[0])):
            if total <= target:
                break
            if await self.backend.delete(name):
                deleted += 1
                self.deleted_bytes += size
            total -= size
        self.deleted += deleted
        self.stored_bytes, self.stored_objects = total, len(listing) - deleted
        log.info("shared tier janitor: deleted %d objects, %d bytes left (bound %d)", deleted, total, self.capacity)
        return deleted

    async def run(self):
        while True:
            if self.backend.connected:
                try:
                    await self.sweep()
                except TierError as exc:
                    log.info("shared tier janitor: %s", exc)
            await trio.sleep(self.interval)
