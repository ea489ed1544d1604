"""The daemon's policy for Python's cyclic garbage collector: full collections must not stall FUSE.

Why. A daemon holds its namespace as Python objects: an inode, its file data,
block lists, name sets and directory tuples, about nine objects the collector
tracks per file. A full (generation-2) collection walks every tracked object
while it holds the GIL, so the event loop stops for all of it: at 100,000 files
(940,000 live objects) one took about 400 ms, and checkpoints, which allocate
a lot at once, set them off (issue 10: the longest FUSE request during a
checkpoint was 1.9 s).

What. When a full collection ends, every object still tracked has just
survived it: none is garbage. Freezing them then (``gc.freeze()``: moved to the
permanent generation, which collections skip) leaves the next full collection
only what was created since, so its pause is bounded by recent growth instead
of by the size of the namespace. CPython starts a full collection only once the
objects that survived into the old generation exceed a quarter of those the last
one left, so each object is walked by about one full collection before it is
frozen. The objects loaded from the store at mount are frozen before serving.

What it costs. An object frozen and later left in an unreachable reference
cycle is never reclaimed. Objects that die by reference count are freed as
always, frozen or not, and the namespace's objects form no cycles (inodes name
each other by number), so files that come and go free their memory; what can
leak is a cycle among objects that happened to be alive at a freeze (a request
task, a trio object), a few at a time. ``statistics()`` reports the frozen count,
which a churn test checks stays flat (tests/unit/test_gc_policy.py), and the
longest full collection seen.

Counting the frozen objects is itself a walk of all of them
(``gc.get_freeze_count`` follows the permanent generation's list, with the
GIL held: 35 ms for 3 million objects), so it must not run on every stats
request, which `kvfs-admin top` makes every second. The count is taken at
install, on demand (:meth:`~FreezeAfterFullCollections.count_frozen`, the
``count-frozen`` control command) and otherwise when a stats request finds it
older than FROZEN_COUNT_MAX_AGE_S; ``statistics()`` says how old it is.

Checkpoints. A checkpoint used to build its rows, new objects by the million at
a million files, and keep them alive until it was written: a full collection
during that time walked them all (513 ms at a million files, measured by the
metadata benchmark's probe). Rows are now packed one at a time
(kvfs/schema/writer.py), but the cuts still copy the inode and block tables
(a tracked dict of a million entries each), so automatic collections are still
paused while a checkpoint runs (:func:`collections_paused`); garbage that only the collector
can free waits those seconds, everything else is freed by reference counting as
always.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import ContextManager, Iterator, Optional

import trio

from .nested import NestedSetting


@dataclasses.dataclass
class GcStatistics:
    full_collections: int        # generation-2 collections since the policy was installed
    full_collection_max_s: float  # the longest of them: the longest stall they caused
    frozen_objects: int          # objects in the permanent generation, counted frozen_counted_s_ago
    frozen_counted_s_ago: float


class FreezeAfterFullCollections:
    """Installed for the life of a daemon: ``install()``, then ``uninstall()``."""

    def __init__(self) -> None:
        self._started: Optional[float] = None
        self._full = 0
        self._longest = 0.0
        self._installed = False
        self._frozen = 0
        self._counted_at: Optional[float] = None

    def install(self) -> None:
        """Freeze what exists now (the loaded store), then after every full collection."""
        if self._installed:
            return
        gc.freeze()
        gc.callbacks.append(self._on_collection)
        self._installed = True
        self.count_frozen()

    def uninstall(self) -> None:
        """Stop freezing and give the frozen objects back to the collector."""
        if not self._installed:
            return
        gc.callbacks.remove(self._on_collection)
        gc.unfreeze()
        self._installed = False

    def _on_collection(self, phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.monotonic()
            return
        if self._started is not None:
            self._longest = max(self._longest, time.monotonic() - self._started)
            self._started = None
        self._full += 1
        # Everything tracked now survived the collection that just ended (it
        # merged the young generations into the old one): freezing it leaks nothing.
        gc.freeze()

    def count_frozen(self) -> int:
        """Count the frozen objects now (a walk of all of them: see the module's doc)."""
        self._frozen = gc.get_freeze_count()
        self._counted_at = time.monotonic()
        return self._frozen

    def collect_and_count(self) -> int:
        """A full collection now (its survivors are frozen, as after any), then the count.

        Without it the count depends on when the last automatic full collection
        ran: whatever was alive then (requests in flight, up to ``max_tasks``
        request tasks made since) is frozen, and a count taken before that
        collection does not include it. Two counts taken this way differ only by
        what really stayed: live objects that grew, or cycles frozen and lost.
        The pause walks only what is not frozen yet.
        """
        gc.collect()
        return self.count_frozen()

    def statistics(self) -> GcStatistics:
        if self._counted_at is None or time.monotonic() - self._counted_at > FROZEN_COUNT_MAX_AGE_S:
            self.count_frozen()
        return GcStatistics(self._full, self._longest, self._frozen,
                            round(time.monotonic() - self._counted_at, 3))


FROZEN_COUNT_MAX_AGE_S = 60.0


def release_in_pieces(*containers: list | dict) -> None:
    """Empty each list or dict a slice at a time (call it in a worker thread).

    Freeing a million checkpoint rows (or a checkpoint cut's copy of a million-entry
    table) is one C call when the last reference goes: it holds the GIL for all of
    it, in whatever thread drops it, so the event loop stopped (40 ms at 100,000
    files, measured). Deleted in slices, the interpreter can switch to the loop
    between them.
    """
    for big in containers:
        if isinstance(big, dict):
            while big:
                for _ in range(min(RELEASE_SLICE, len(big))):
                    big.popitem()
        else:
            while big:
                del big[-RELEASE_SLICE:]


RELEASE_SLICE = 2048


async def release_off_loop(*containers: list | dict, limiter: Optional[trio.CapacityLimiter] = None) -> None:
    """:func:`release_in_pieces` in a worker thread, even when the caller is cancelled."""
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(release_in_pieces, *containers, limiter=limiter)

def _set_collector(enabled):
    if enabled:
        gc.enable()
    else:
        gc.disable()


_collector = NestedSetting(gc.isenabled, _set_collector, lambda was_enabled: False)


def collections_paused() -> ContextManager[None]:
    """No automatic garbage collection inside (nests; any thread). See the module's doc."""
    return _collector.held()


@contextlib.contextmanager
def frozen_when_loaded() -> Iterator[None]:
    """Collections paused inside, and what exists at the end frozen: the daemon's load.

    With collections paused, every object the load made is still in the youngest
    generation when they resume, so the first collection after it would walk
    them all (0.27 s at 100,000 files, measured at mount). Frozen first, none
    is walked; the daemon's policy then freezes the survivors of each full
    collection as usual.
    """
    with collections_paused():
        yield
        gc.freeze()

