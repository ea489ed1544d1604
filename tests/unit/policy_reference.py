"""The eviction policies as they were with OrderedDict queues: the reference that
tests/unit/test_policy.py holds kvfs/namespace/policy.py's packed queues to."""
import collections

MAX_FREQUENCY = 3


class ReferenceLRU:
    name = "lru"

    def __init__(self):
        self._order = collections.OrderedDict()      # ino -> size, least recently used first

    def __contains__(self, ino):
        return ino in self._order

    def __len__(self):
        return len(self._order)

    def insert(self, ino, size):
        self._order[ino] = size
        self._order.move_to_end(ino)

    def access(self, ino):
        if ino in self._order:
            self._order.move_to_end(ino)

    def remove(self, ino):
        self._order.pop(ino, None)

    def victims(self):
        """Least recently used first, one pass; a file the evictor skips (open, dirty,
        pinned) goes to the back, as if just used."""
        for _ in range(len(self._order)):
            if not self._order:
                return
            ino = next(iter(self._order))
            yield ino
            if ino in self._order:
                self._order.move_to_end(ino)


class ReferenceS3FIFO:
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

    def __contains__(self, ino):
        return ino in self._small or ino in self._main

    def __len__(self):
        return len(self._small) + len(self._main)

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
        if ino in self._small or ino in self._main:
            self._freq[ino] = min(self._freq.get(ino, 0) + 1, MAX_FREQUENCY)

    def remove(self, ino):
        if ino in self._small:
            self._small_bytes -= self._small.pop(ino)
        elif ino in self._main:
            self._main_bytes -= self._main.pop(ino)
        self._freq.pop(ino, None)

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
            if self._small and (self._small_bytes > self.SMALL_SHARE * total or not self._main):
                ino, size = next(iter(self._small.items()))
                if self._freq.get(ino, 0) > 0:
                    # Read again while new: it moves to the main queue.
                    del self._small[ino]
                    self._small_bytes -= size
                    self._main[ino] = size
                    self._main_bytes += size
                    del self._freq[ino]
                    continue
                self._small.move_to_end(ino)           # if the evictor skips it, it waits its turn
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
