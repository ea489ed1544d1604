"""Eviction policies: the order in which sealed files leave a full store.

A policy sees files by inode number and size, and is told of every insertion
(a file sealed with new content), access (an open for reading) and removal.
``victims()`` yields inode numbers in eviction order; the evictor skips the
ones it may not evict (open, dirty or pinned) and removes the others until
enough space is free. Policies are pure bookkeeping: no I/O, no clock, so they
can be replayed on a trace (``tools/evict-sim``) exactly as the daemon runs them.

``LRU`` is the baseline. ``S3FIFO`` (Yang et al., SOSP 2023) is scan-resistant:
new files enter a small FIFO and are promoted to the main FIFO only if they are
read again while there, so a one-off document scan passes through the small
queue without flushing the hot system-prompt chunks out of the main one; files
the small queue evicted are remembered in a ghost list and go straight to the
main queue if they come back.

The queues are :class:`~kvfs.namespace.packedqueue.PackedQueue`s (32 bytes a
file; an OrderedDict was about 100), and a mount's files enter all at once in
their order through ``load()`` (``tests/unit/test_policy.py`` compares the
policies with OrderedDict versions of themselves on random histories).
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator

from .packedqueue import PackedQueue

MAX_FREQUENCY = 3


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order = PackedQueue()          # least recently used first

    def load(self, order: list[int], size_of: Callable[[int], int]) -> None:
        """Enter the files ``order`` lists (least recently used first; sizes from
        ``size_of(ino)``) into an empty policy, as inserts in that order would."""
        assert not len(self), "load() is for a policy that has seen nothing yet"
        self._order = PackedQueue(order, size_of)

    def __contains__(self, ino):
        return ino in self._order

    def __len__(self):
        return len(self._order)

    def insert(self, ino: int, size: int) -> None:
        self._order.push(ino, size)

    def access(self, ino: int) -> None:
        size = self._order.get(ino)
        if size is not None:
            self._order.push(ino, size)

    def remove(self, ino: int) -> None:
        self._order.remove(ino)

    def victims(self) -> Iterator[int]:
        """Least recently used first, one pass; a file the evictor skips (open, dirty,
        pinned) goes to the back, as if just used."""
        for _ in range(len(self._order)):
            oldest = self._order.first()
            if oldest is None:
                return
            yield oldest[0]
            self.access(oldest[0])


class S3FIFO:
    name = "s3fifo"
    SMALL_SHARE = 0.1          # of the bytes tracked, the small FIFO's target

    def __init__(self) -> None:
        self._small = PackedQueue()                   # oldest first
        self._main = PackedQueue()
        self._ghost = collections.OrderedDict()       # ino -> None: evicted from small, recently
        # ino -> reads since it entered its queue, only for files read at all:
        # most files are never read again before they go (and none has been
        # after a remount), and an entry for each was 50 bytes a file.
        self._freq = {}
        self._small_bytes = self._main_bytes = 0

    def load(self, order: list[int], size_of: Callable[[int], int]) -> None:
        """Enter the files ``order`` lists (oldest first; sizes from ``size_of(ino)``)
        into an empty policy, as inserts in that order would."""
        assert not len(self) and not self._ghost, "load() is for a policy that has seen nothing yet"
        self._small = PackedQueue(order, size_of)
        self._small_bytes = self._small.sizes_total()

    def __contains__(self, ino):
        return ino in self._small or ino in self._main

    def __len__(self):
        return len(self._small) + len(self._main)

    def insert(self, ino: int, size: int) -> None:
        self.remove(ino)
        if ino in self._ghost:                # evicted while new, and back: it is wanted
            del self._ghost[ino]
            self._main.push(ino, size)
            self._main_bytes += size
        else:
            self._small.push(ino, size)
            self._small_bytes += size

    def access(self, ino: int) -> None:
        if ino in self:
            self._freq[ino] = min(self._freq.get(ino, 0) + 1, MAX_FREQUENCY)

    def remove(self, ino: int) -> None:
        size = self._small.remove(ino)
        if size is not None:
            self._small_bytes -= size
        else:
            size = self._main.remove(ino)
            if size is not None:
                self._main_bytes -= size
        self._freq.pop(ino, None)

    def _remember(self, ino):
        self._ghost[ino] = None
        while len(self._ghost) > max(len(self._main), 64):
            self._ghost.popitem(last=False)

    def victims(self) -> Iterator[int]:
        """Yield files to evict; promotions and second chances happen as the walk goes.

        Bounded: every step either yields a file or lowers a frequency, so the
        walk ends after at most MAX_FREQUENCY + 2 passes over the files.
        """
        budget = (MAX_FREQUENCY + 2) * (len(self) + 1)
        while budget > 0 and len(self):
            budget -= 1
            total = self._small_bytes + self._main_bytes
            if len(self._small) and (self._small_bytes > self.SMALL_SHARE * total or not len(self._main)):
                ino, size = self._small.first()
                if self._freq.get(ino, 0) > 0:
                    # Read again while new: it moves to the main queue.
                    self._small.remove(ino)
                    self._small_bytes -= size
                    self._main.push(ino, size)
                    self._main_bytes += size
                    del self._freq[ino]
                    continue
                self._small.push(ino, size)          # if the evictor skips it, it waits its turn
                self._remember(ino)
                yield ino
            else:
                ino, size = self._main.first()
                freq = self._freq.get(ino, 0)
                if freq > 0:
                    if freq == 1:
                        del self._freq[ino]
                    else:
                        self._freq[ino] = freq - 1
                    self._main.push(ino, size)
                    continue
                self._main.push(ino, size)
                yield ino


class NoEviction:
    """``eviction_policy=none``: kvfs never evicts; the engine keeps its own budget
    (LMCache's max_local_disk_size) and a full store answers ENOSPC."""

    name = "none"

    def load(self, order: list[int], size_of: Callable[[int], int]) -> None:
        pass

    def __contains__(self, ino):
        return False

    def __len__(self):
        return 0

    def insert(self, ino: int, size: int) -> None:
        pass

    def access(self, ino: int) -> None:
        pass

    def remove(self, ino: int) -> None:
        pass

    def victims(self) -> Iterator[int]:
        return iter(())


POLICIES = {cls.name: cls for cls in (LRU, S3FIFO, NoEviction)}
DEFAULT_POLICY = "s3fifo"
