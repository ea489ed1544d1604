"""A queue of files (inode number, size) with no Python object per file, for the eviction policies.

An OrderedDict entry (its node, dict slot and fast-node slot) is about 100
bytes; the policies hold every sealed file, so a million files took 100 MB of a
daemon meant to stay under 1 GiB. Here a file costs 32 bytes in four arrays:

- the log: inode numbers in queue order, append-only. A file moved to the
  back is appended again; its earlier entry goes stale.
- the slots: the files' numbers ascending (``inos``), with ``sizes``
  (``_GONE`` once a file left) and ``at`` (where its live log entry is)
  beside them. Bisection finds a file.

``at`` is ``_ORIGINAL`` for a file placed by the constructor: each of those is
in the log exactly once, so that entry is the live one until the file moves.
Filling ``at`` with real indices would take a bisection a file at mount.

Inode numbers only grow, so a new file's number is above, or (its seal
finished after a younger file's) a little below, the largest one queued: it is
inserted into the slots in place, near their end. A number far below it (an
old file back after a compaction dropped its slot) goes into ``_extra`` (ino ->
[size, at]) instead: rare, and folded into the slots by the next compaction.

Compaction, once stale log entries or departed slots outnumber the files, is
incremental: a full rebuild at a million files held the event loop for over a
second on the one call that crossed the line. Each push() and remove() while a
compaction runs moves the next ``_STEP`` log entries into a fresh log and the
next ``_STEP`` slots into fresh slots, so no call does more than that
(``statistics()`` counts the calls and the most any one of them moved):

- The log: the queue is ``fresh[fresh_head:]`` then ``log[head:]``; new
  entries still go to the back of the old log, and ``head`` is the copy's
  cursor. ``at`` tells the logs apart by bit 63 (``_TAG``): indices into the
  log have it as ``_tag`` says, the fresh log's the other way; the two swap
  when the old log is used up. A file placed by the constructor gets a real
  ``at`` when its entry is copied, so no live file is ``_ORIGINAL`` after.
- The slots: fresh slots take the old ones' live entries in order, from
  ``moved`` on, with the numbers that were in ``_extra`` when it began
  merged in. Every number still in the old slots is above every fresh one, so
  a number above the fresh slots' last is looked up (and inserted) in the old
  slots past ``moved``, any other in the fresh ones.
Each step moves at most ``_STEP`` entries while a call adds at most one, so a
compaction ends within (entries) / (``_STEP`` - 1) calls.
"""
from __future__ import annotations

import array
import bisect
import itertools
from typing import Callable, Iterable

_GONE = (1 << 64) - 1          # sizes: the file has left the queue
_ORIGINAL = (1 << 64) - 1      # at: the file's one log entry, placed by the constructor
_TAG = 1 << 63                 # at: which of the two logs an index is into (see above)
_SLACK = 1024                  # garbage tolerated beyond the live count before a compaction
_STEP = 64                     # log entries, and slots, one call moves while a compaction runs
# A number not in the slots goes in place if that moves at most this many
# slots (a few microseconds of memmove), else into _extra.
_NEAR_END = 4096
assert _STEP >= 2, "a step must outrun the one entry each call adds, or a compaction never ends"


def _empty_slots():
    return array.array("Q"), array.array("Q"), array.array("Q")


class PackedQueue:
    __slots__ = ("_log", "_head", "_tag", "_fresh", "_fresh_head", "_slots", "_old", "_moved",
                 "_extras_due", "_extra", "_live", "_steps", "_most_moved", "_log_compactions",
                 "_slot_compactions")

    def __init__(self, order: Iterable[int] = (), size_of: Callable[[int], int] | None = None) -> None:
        """``order``: distinct inode numbers, first to leave first (a list of the caller's
        own ints, so sorting it copies none); ``size_of(ino)``: each one's size."""
        self._log = array.array("Q", order)
        self._head = 0
        self._tag = 0
        self._fresh = None             # the log a compaction is filling, or None
        self._fresh_head = 0
        inos = array.array("Q", sorted(order))
        sizes = array.array("Q", map(size_of, inos) if len(order) else ())
        self._slots = (inos, sizes, array.array("Q", [_ORIGINAL]) * len(inos))
        self._old = None               # the slots a compaction is emptying, or None
        self._moved = 0
        self._extras_due = []          # _extra's numbers when it began, largest first
        self._extra = {}
        self._live = len(inos)
        self._steps = self._most_moved = self._log_compactions = self._slot_compactions = 0

    def __len__(self):
        return self._live

    def statistics(self) -> dict[str, int]:
        return {"files": self._live, "log_entries": len(self._log) - self._head
                + (len(self._fresh) - self._fresh_head if self._fresh is not None else 0),
                "slots": len(self._slots[0]) + (len(self._old[0]) - self._moved if self._old else 0),
                "extra": len(self._extra), "log_compactions": self._log_compactions,
                "slot_compactions": self._slot_compactions, "compaction_steps": self._steps,
                "most_moved_in_one_call": self._most_moved}

    def _place(self, ino):
        """(inos, sizes, at, index): the slots that hold ``ino`` or would take it, and where.

        While slots are being moved, a number above the fresh slots' last
        belongs to the old slots past ``moved``, any other to the fresh ones."""
        inos, sizes, at = self._slots
        if self._old is not None and (not inos or ino > inos[-1]):
            inos, sizes, at = self._old
            return inos, sizes, at, bisect.bisect_left(inos, ino, self._moved)
        return inos, sizes, at, bisect.bisect_left(inos, ino)

    def _find(self, ino):
        """(sizes, at, index) of ``ino``'s slot (live or departed), or None."""
        inos, sizes, at, i = self._place(ino)
        return (sizes, at, i) if i < len(inos) and inos[i] == ino else None

    def get(self, ino: int) -> int | None:
        """``ino``'s size, or None if it is not queued."""
        slot = self._find(ino)
        if slot is not None:
            size = slot[0][slot[2]]
            return None if size == _GONE else size
        hit = self._extra.get(ino)
        return None if hit is None else hit[0]

    def __contains__(self, ino):
        return self.get(ino) is not None

    def sizes_total(self) -> int:
        sizes = self._slots[1]
        if self._old is not None:
            sizes = itertools.chain(sizes, itertools.islice(self._old[1], self._moved, None))
        return sum(s for s in sizes if s != _GONE) + sum(s for s, _ in self._extra.values())

    def push(self, ino: int, size: int) -> None:
        """Queue ``ino`` at the back, or move it there (with ``size``) if it is queued."""
        at = len(self._log) | self._tag
        self._log.append(ino)
        inos, sizes, ats, i = self._place(ino)
        if i < len(inos) and inos[i] == ino:
            if sizes[i] == _GONE:
                self._live += 1
            sizes[i], ats[i] = size, at
        elif ino in self._extra:
            self._extra[ino] = [size, at]
        else:
            self._live += 1
            if len(inos) - i <= _NEAR_END:
                inos.insert(i, ino)
                sizes.insert(i, size)
                ats.insert(i, at)
            else:
                self._extra[ino] = [size, at]
        self._compact_some()

    def remove(self, ino: int) -> int | None:
        """Take ``ino`` out; its size, or None if it was not queued."""
        slot = self._find(ino)
        if slot is not None and slot[0][slot[2]] != _GONE:
            sizes, _, i = slot
            size, sizes[i] = sizes[i], _GONE
        elif ino in self._extra:
            size = self._extra.pop(ino)[0]
        else:
            return None
        self._live -= 1
        self._compact_some()
        return size

    def _live_at(self, log, index, tag):
        """(ino, size) if ``log[index]`` is its file's live entry, else None; ``tag``: that log's."""
        ino = log[index]
        slot = self._find(ino)
        if slot is not None:
            sizes, ats, i = slot
            size, at = sizes[i], ats[i]
            if size != _GONE and (at == index | tag or (at == _ORIGINAL and log is self._log)):
                return ino, size
            return None
        hit = self._extra.get(ino)
        return (ino, hit[0]) if hit is not None and hit[1] == index | tag else None

    def first(self) -> tuple[int, int] | None:
        """(ino, size) of the file at the front, or None if the queue is empty."""
        fresh = self._fresh
        if fresh is not None:
            while self._fresh_head < len(fresh):
                hit = self._live_at(fresh, self._fresh_head, self._tag ^ _TAG)
                if hit is not None:
                    return hit
                self._fresh_head += 1
        while self._head < len(self._log):
            hit = self._live_at(self._log, self._head, self._tag)
            if hit is not None:
                return hit
            self._head += 1
        return None

    def __iter__(self):
        """(ino, size) front to back; the queue must not change meanwhile."""
        logs = [(self._log, self._head, self._tag)]
        if self._fresh is not None:
            logs.insert(0, (self._fresh, self._fresh_head, self._tag ^ _TAG))
        for log, head, tag in logs:
            for index in range(head, len(log)):
                hit = self._live_at(log, index, tag)
                if hit is not None:
                    yield hit

    def _compact_some(self):
        """Start a compaction where garbage outgrew the files; move a step of a running one."""
        limit = 2 * self._live + _SLACK
        if self._fresh is None and len(self._log) - self._head > limit:
            self._fresh, self._fresh_head = array.array("Q"), 0
        if self._old is None and len(self._slots[0]) > limit:
            self._old, self._slots, self._moved = self._slots, _empty_slots(), 0
            self._extras_due = sorted(self._extra, reverse=True)
        if self._fresh is None and self._old is None:
            return
        moved = (self._copy_log() if self._fresh is not None else 0) + \
            (self._move_slots() if self._old is not None else 0)
        self._steps += 1
        self._most_moved = max(self._most_moved, moved)

    def _copy_log(self):
        """Copy the next _STEP entries of the log into the fresh one, the live ones only."""
        log, fresh, tag, extra = self._log, self._fresh, self._tag, self._extra
        fresh_tag = tag ^ _TAG
        end = min(self._head + _STEP, len(log))
        for index in range(self._head, end):       # _live_at's test, keeping the slot it finds
            ino = log[index]
            slot = self._find(ino)
            if slot is not None:
                sizes, ats, i = slot
                at = ats[i]
                if sizes[i] != _GONE and (at == index | tag or at == _ORIGINAL):
                    ats[i] = len(fresh) | fresh_tag
                    fresh.append(ino)
            else:
                hit = extra.get(ino)
                if hit is not None and hit[1] == index | tag:
                    hit[1] = len(fresh) | fresh_tag
                    fresh.append(ino)
        moved, self._head = end - self._head, end
        if end == len(log):            # used up: the fresh log is the log
            self._log, self._head, self._tag = fresh, self._fresh_head, fresh_tag
            self._fresh = None
            self._log_compactions += 1
        return moved

    def _move_slots(self):
        """Move the next _STEP old slots (or _extra numbers due before them) into the fresh slots."""
        old_inos, old_sizes, old_at = self._old
        inos, sizes, ats = self._slots
        due, extra = self._extras_due, self._extra
        moved = 0
        while moved < _STEP and (self._moved < len(old_inos) or due):
            moved += 1
            r = self._moved
            if due and (r == len(old_inos) or due[-1] < old_inos[r]):
                ino = due.pop()
                hit = extra.pop(ino, None)       # None: it left the queue, or went to a slot
                if hit is not None:
                    inos.append(ino)
                    sizes.append(hit[0])
                    ats.append(hit[1])
                continue
            if old_sizes[r] != _GONE:
                inos.append(old_inos[r])
                sizes.append(old_sizes[r])
                ats.append(old_at[r])
            self._moved = r + 1
        if self._moved == len(old_inos) and not due:
            self._old, self._moved = None, 0
            self._slot_compactions += 1
        return moved
