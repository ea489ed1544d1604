"""A queue of files (inode number, size) with no Python object per file, for the eviction policies.

An OrderedDict entry (its node, dict slot and fast-node slot) is about 100
bytes; the policies hold every sealed file, so a million files took 100 MB of a
daemon meant to stay under 1 GiB. Here a file costs 32 bytes in four arrays:

- ``_log``: inode numbers in queue order, append-only. A file moved to the
  back is appended again; its earlier entry goes stale.
- ``_inos``: the files' numbers ascending, with ``_sizes`` (``_GONE`` once a
  file left) and ``_at`` (the log index of its live entry) beside them.
  Bisection finds a file.

``_at`` is ``_ORIGINAL`` for a file placed by the constructor or the last
compaction: each of those is in the log exactly once, so that entry is the
live one until the file moves (which sets ``_at``). Filling ``_at`` with real
indices would take a bisection a file at mount.

Inode numbers only grow, so a new file's number is above, or (its seal
finished after a younger file's) a little below, the largest one queued: it is
inserted into the arrays in place, near their end. A number far below it (an
old file back after a compaction dropped its slot) goes into ``_extra`` (ino ->
[size, log index]) instead: rare, and folded into the arrays by the next
compaction. The log
and the arrays are rebuilt once stale entries or departed slots outnumber the
files (amortized O(log n) a call).
"""
import array
import bisect

_GONE = (1 << 64) - 1          # _sizes: the file has left the queue
_ORIGINAL = (1 << 64) - 1      # _at: the file's one log entry, placed by the constructor or a compaction
_SLACK = 1024                  # garbage tolerated beyond the live count before a compaction
# A number not in the arrays goes in place if that moves at most this many
# slots (a few microseconds of memmove), else into _extra.
_NEAR_END = 4096


class PackedQueue:
    __slots__ = ("_log", "_head", "_inos", "_sizes", "_at", "_extra", "_live")

    def __init__(self, order=(), size_of=None):
        """``order``: distinct inode numbers, first to leave first (a list of the caller's
        own ints, so sorting it copies none); ``size_of(ino)``: each one's size."""
        self._log = array.array("Q", order)
        self._inos = array.array("Q", sorted(order))
        self._sizes = array.array("Q", map(size_of, self._inos) if len(order) else ())
        self._reset_positions()
        self._extra = {}
        self._live = len(self._inos)

    def _reset_positions(self):
        self._head = 0
        self._at = array.array("Q", [_ORIGINAL]) * len(self._inos)

    def __len__(self):
        return self._live

    def _slot(self, ino):
        """Index of ``ino`` in _inos (live or departed), or -1."""
        i = bisect.bisect_left(self._inos, ino)
        return i if i < len(self._inos) and self._inos[i] == ino else -1

    def get(self, ino):
        """``ino``'s size, or None if it is not queued."""
        i = self._slot(ino)
        if i >= 0:
            size = self._sizes[i]
            return None if size == _GONE else size
        hit = self._extra.get(ino)
        return None if hit is None else hit[0]

    def __contains__(self, ino):
        return self.get(ino) is not None

    def sizes_total(self):
        return sum(s for s in self._sizes if s != _GONE) + sum(s for s, _ in self._extra.values())

    def push(self, ino, size):
        """Queue ``ino`` at the back, or move it there (with ``size``) if it is queued."""
        at = len(self._log)
        self._log.append(ino)
        inos = self._inos
        i = bisect.bisect_left(inos, ino)
        if i < len(inos) and inos[i] == ino:
            if self._sizes[i] == _GONE:
                self._live += 1
            self._sizes[i], self._at[i] = size, at
        elif ino in self._extra:
            self._extra[ino] = [size, at]
        else:
            self._live += 1
            if len(inos) - i <= _NEAR_END:
                inos.insert(i, ino)
                self._sizes.insert(i, size)
                self._at.insert(i, at)
            else:
                self._extra[ino] = [size, at]
        self._maybe_compact()

    def remove(self, ino):
        """Take ``ino`` out; its size, or None if it was not queued."""
        i = self._slot(ino)
        if i >= 0 and self._sizes[i] != _GONE:
            size, self._sizes[i] = self._sizes[i], _GONE
        elif ino in self._extra:
            size = self._extra.pop(ino)[0]
        else:
            return None
        self._live -= 1
        self._maybe_compact()
        return size

    def _live_at(self, index):
        """(ino, size) if the log entry at ``index`` is its file's live one, else None."""
        ino = self._log[index]
        i = self._slot(ino)
        if i >= 0:
            size, at = self._sizes[i], self._at[i]
            if size != _GONE and (at == index or at == _ORIGINAL):
                return ino, size
            return None
        hit = self._extra.get(ino)
        return (ino, hit[0]) if hit is not None and hit[1] == index else None

    def first(self):
        """(ino, size) of the file at the front, or None if the queue is empty."""
        while self._head < len(self._log):
            hit = self._live_at(self._head)
            if hit is not None:
                return hit
            self._head += 1
        return None

    def __iter__(self):
        """(ino, size) front to back; the queue must not change meanwhile."""
        for index in range(self._head, len(self._log)):
            hit = self._live_at(index)
            if hit is not None:
                yield hit

    def _maybe_compact(self):
        limit = 2 * self._live + _SLACK
        if len(self._log) - self._head > limit or len(self._inos) > limit:
            self._compact()

    def _compact(self):
        live = list(self)
        self._log = array.array("Q", [ino for ino, _ in live])
        live.sort()
        self._inos = array.array("Q", [ino for ino, _ in live])
        self._sizes = array.array("Q", [size for _, size in live])
        self._extra = {}
        self._reset_positions()
