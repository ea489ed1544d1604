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

The files a mount finds are many (a million on a large host) and all enter at
once, oldest modification first; an OrderedDict node and entry for each was
105 bytes a file. ``load()`` keeps them packed instead (:class:`Backlog`, 24
bytes a file) at the head of the queue they would have entered, where they
behave exactly as if inserted one by one (``tests/unit/test_policy.py``
compares the two on random histories).
"""
import array
import bisect
import collections

MAX_FREQUENCY = 3
_GONE = (1 << 64) - 1          # a Backlog size slot: the file has left the backlog


class Backlog:
    """Files in queue order, packed in arrays; files only leave it.

    ``_order`` holds inode numbers in queue order; ``_sorted`` the same numbers
    ascending, with each one's size in ``_sizes`` (``_GONE`` once it left), so
    membership and removal are a bisection and no per-file object exists. The
    arrays are rebuilt without the departed once they are most of them.
    """

    def __init__(self, order=(), size_of=None):
        # ``order``: a list of distinct inode numbers in queue order (the caller's
        # own int objects, so sorting it copies no ints); ``size_of(ino)``: sizes.
        self._order = array.array("Q", order)
        self._sorted = array.array("Q", sorted(order))
        self._sizes = array.array("Q", map(size_of, self._sorted) if order else ())
        self._head = 0
        self._live = len(self._order)
        self.bytes = sum(self._sizes)

    def __len__(self):
        return self._live

    def _slot(self, ino):
        i = bisect.bisect_left(self._sorted, ino)
        if i < len(self._sorted) and self._sorted[i] == ino and self._sizes[i] != _GONE:
            return i
        return None

    def __contains__(self, ino):
        return self._slot(ino) is not None

    def remove(self, ino):
        """Take ``ino`` out; its size, or None if it is not here."""
        i = self._slot(ino)
        if i is None:
            return None
        size, self._sizes[i] = self._sizes[i], _GONE
        self._live -= 1
        self.bytes -= size
        if self._live < len(self._order) // 2 and len(self._order) > 1024:
            self._compact()
        return size

    def head(self):
        """(ino, size) of the first file still here (the queue's oldest); None if empty."""
        order = self._order
        while self._head < len(order):
            i = self._slot(order[self._head])
            if i is not None:
                return order[self._head], self._sizes[i]
            self._head += 1
        return None

    def _compact(self):
        order = self._order
        self._order = array.array("Q", [ino for ino in order[self._head:] if ino in self])
        live = [i for i, size in enumerate(self._sizes) if size != _GONE]
        self._sorted = array.array("Q", [self._sorted[i] for i in live])
        self._sizes = array.array("Q", [self._sizes[i] for i in live])
        self._head = 0


class LRU:
    name = "lru"

    def __init__(self):
        self._order = collections.OrderedDict()      # ino -> size, least recently used first
        self._backlog = Backlog()                    # files found at mount: before all of _order

    def load(self, order, size_of):
        """Enter the files ``order`` lists (least recently used first; sizes from
        ``size_of(ino)``) into an empty policy."""
        assert not len(self), "load() is for a policy that has seen nothing yet"
        self._backlog = Backlog(order, size_of)

    def __contains__(self, ino):
        return ino in self._order or ino in self._backlog

    def __len__(self):
        return len(self._order) + len(self._backlog)

    def insert(self, ino, size):
        self._backlog.remove(ino)
        self._order[ino] = size
        self._order.move_to_end(ino)

    def access(self, ino):
        if ino in self._order:
            self._order.move_to_end(ino)
        else:
            size = self._backlog.remove(ino)
            if size is not None:
                self._order[ino] = size

    def remove(self, ino):
        self._order.pop(ino, None)
        self._backlog.remove(ino)

    def victims(self):
        """Least recently used first, one pass; a file the evictor skips (open, dirty,
        pinned) goes to the back, as if just used."""
        for _ in range(len(self)):
            if not len(self):
                return
            oldest = self._backlog.head()
            ino = oldest[0] if oldest is not None else next(iter(self._order))
            yield ino
            self.access(ino)


class S3FIFO:
    name = "s3fifo"
    SMALL_SHARE = 0.1          # of the bytes tracked, the small FIFO's target

    def __init__(self):
        self._small = collections.OrderedDict()       # ino -> size, oldest first
        self._main = collections.OrderedDict()
        self._ghost = collections.OrderedDict()       # ino -> None: evicted from small, recently
        # ino -> reads since it entered its queue, only for files read at all:
        # most files are never read again before they go (and none has been
        # after a remount), and an entry for each was 50 bytes a file.
        self._freq = {}
        self._small_bytes = self._main_bytes = 0
        self._backlog = Backlog()                     # files found at mount: the small queue's head

    def load(self, order, size_of):
        """Enter the files ``order`` lists (oldest first; sizes from ``size_of(ino)``)
        into an empty policy, as inserts in that order would."""
        assert not len(self) and not self._ghost, "load() is for a policy that has seen nothing yet"
        self._backlog = Backlog(order, size_of)
        self._small_bytes = self._backlog.bytes

    def __contains__(self, ino):
        return ino in self._small or ino in self._main or ino in self._backlog

    def __len__(self):
        return len(self._small) + len(self._main) + len(self._backlog)

    def insert(self, ino, size):
        self.remove(ino)
        if ino in self._ghost:                # evicted while new, and back: it is wanted
            del self._ghost[ino]
            self._main[ino] = size
            self._main_bytes += size
        else:
            self._small[ino] = size
            self._small_bytes += size

    def access(self, ino):
        if ino in self:
            self._freq[ino] = min(self._freq.get(ino, 0) + 1, MAX_FREQUENCY)

    def remove(self, ino):
        if ino in self._small:
            self._small_bytes -= self._small.pop(ino)
        elif ino in self._main:
            self._main_bytes -= self._main.pop(ino)
        else:
            size = self._backlog.remove(ino)
            if size is not None:
                self._small_bytes -= size
        self._freq.pop(ino, None)

    def _small_head(self):
        oldest = self._backlog.head()
        return oldest if oldest is not None else next(iter(self._small.items()))

    def _small_pop(self, ino):
        """Take the small queue's head ``ino`` out of it; its size (still counted in _small_bytes)."""
        size = self._backlog.remove(ino)
        if size is None:
            size = self._small.pop(ino)
        return size

    def _remember(self, ino):
        self._ghost[ino] = None
        while len(self._ghost) > max(len(self._main), 64):
            self._ghost.popitem(last=False)

    def victims(self):
        """Yield files to evict; promotions and second chances happen as the walk goes.

        Bounded: every step either yields a file or lowers a frequency, so the
        walk ends after at most MAX_FREQUENCY + 2 passes over the files.
        """
        budget = (MAX_FREQUENCY + 2) * (len(self) + 1)
        while budget > 0 and len(self):
            budget -= 1
            total = self._small_bytes + self._main_bytes
            small = len(self._small) + len(self._backlog)
            if small and (self._small_bytes > self.SMALL_SHARE * total or not self._main):
                ino, size = self._small_head()
                if self._freq.get(ino, 0) > 0:
                    # Read again while new: it moves to the main queue.
                    self._small_pop(ino)
                    self._small_bytes -= size
                    self._main[ino] = size
                    self._main_bytes += size
                    del self._freq[ino]
                    continue
                self._small[ino] = self._small_pop(ino)   # if the evictor skips it, it waits its turn
                self._remember(ino)
                yield ino
            else:
                ino, size = next(iter(self._main.items()))
                freq = self._freq.get(ino, 0)
                if freq > 0:
                    if freq == 1:
                        del self._freq[ino]
                    else:
                        self._freq[ino] = freq - 1
                    self._main.move_to_end(ino)
                    continue
                self._main.move_to_end(ino)
                yield ino


class NoEviction:
    """``eviction_policy=none``: kvfs never evicts; the engine keeps its own budget
    (LMCache's max_local_disk_size) and a full store answers ENOSPC."""

    name = "none"

    def load(self, order, size_of):
        pass

    def __contains__(self, ino):
        return False

    def __len__(self):
        return 0

    def insert(self, ino, size):
        pass

    def access(self, ino):
        pass

    def remove(self, ino):
        pass

    def victims(self):
        return iter(())


POLICIES = {cls.name: cls for cls in (LRU, S3FIFO, NoEviction)}
DEFAULT_POLICY = "s3fifo"
