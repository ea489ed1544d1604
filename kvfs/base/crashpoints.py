"""Named crash points, for tests: the daemon dies (``os._exit``, as kill -9 would) at a named place.

Code that wants a crash test at some instant calls ``crashpoint("name")``
there. Unarmed, that is one ``is None`` check. A point whose death needs a last
act first (tearing a write in half) asks ``if reached("name"):``, does the act,
then calls ``die("name")``.

Test hook for a mounted daemon: the environment variable ``KVFS_TEST_CRASH``,
read by :func:`arm_from_environment` when mount.kvfs starts. Its value is one
point, ``name`` or ``name@N``: the daemon dies at the Nth arrival there (N
defaults to 1). A name not in :data:`CRASH_POINTS` is refused, so that a typo
never makes a test that silently never crashes. Dying writes one line to stderr
and one log record (the daemon's stderr is /dev/null once it is mounted), then
``os._exit(137)``: no flush, no cleanup, no atexit, buffered log lines of other
threads may be lost. This is not a mount option and not part of the user
documentation. tests/test_crash_points.py triggers every point.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import NoReturn, Optional

from ..errors import InvalidArgument

log = logging.getLogger(__name__)

ENV = "KVFS_TEST_CRASH"
EXIT_CODE = 137                 # what a shell reports for a process killed by SIGKILL

# name -> where it sits. tests/test_crash_points.py enumerates these (each must be
# reached by a test) and checks that the code calls no name missing from here.
CRASH_POINTS = {
    "block-written": "blockindex.store_block(s): a new block's bytes are written, before it enters the "
                     "index (no record names it yet)",
    "commit-data-synced": "ExtentStore.commit: block data fdatasynced, before the journal frame naming "
                          "it is written",
    "torn-frame": "ExtentStore.commit: the first half of the frame's bytes written and fdatasynced, "
                  "the second half never (a torn frame)",
    "checkpoint-payload-written": "ExtentStore._write_slot: the new checkpoint's payload is durable over "
                                  "the inactive slot, its header not yet written",
    "checkpoint-header-written": "ExtentStore._write_slot: the new checkpoint is durable, before the "
                                 "store moves to its generation (old-generation frames still in the journal)",
    "frees-discarded": "ExtentStore._made_durable: the record freeing extents is durable and they are "
                       "discarded (TRIM/hole punch), before they become allocatable",
    "evict-file-removed": "Evictor.evict: one victim's Remove records are appended and applied (its blocks "
                          "released in RAM), before the eviction's frame",
    "evict-committed": "Evictor.evict: the eviction's frame is durable, before its count is reported",
    "rename-source-sealed": "Namespace.rename over an existing file: the source's content record is "
                            "appended, the move not yet",
    "rename-replaced": "Namespace.rename over an existing file: the move is appended and applied (the "
                       "old target's blocks released in RAM), before any commit",
    "dedup-unlink": "Namespace.unlink of one of several identical copies (same content key, shared "
                    "blocks): the Remove is appended and applied (shared reference counts dropped), before "
                    "any commit",
    "flush-backpressure": "WriteBack._admit: a writer held back by dirty_limit or by space was woken by a "
                          "finished flush while other flushes may still be running",
}

_armed: Optional[dict[str, int]] = None    # None, or {name: arrivals left before death}
_lock = threading.Lock()


def parse(text: str) -> tuple[str, int]:
    """``"name"`` or ``"name@N"`` -> (name, N); InvalidArgument for anything else."""
    name, sep, count = text.strip().partition("@")
    if name not in CRASH_POINTS:
        raise InvalidArgument(f"{ENV}={text!r}: unknown crash point {name!r} "
                              f"(known: {', '.join(sorted(CRASH_POINTS))})")
    if not sep:
        return name, 1
    try:
        n = int(count)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgument(f"{ENV}={text!r}: the arrival after '@' must be a positive integer")
    return name, n


def arm(text: Optional[str]) -> None:
    """Arm the point ``text`` names (see :func:`parse`); ``None`` or ``""`` disarms."""
    global _armed
    if not text:
        _armed = None
        return
    name, n = parse(text)
    _armed = {name: n}


def arm_from_environment() -> None:
    """Arm what $KVFS_TEST_CRASH names; raises InvalidArgument (refuse to start) for a bad value."""
    arm(os.environ.get(ENV))


def reached(name: str) -> bool:
    """True at the arrival that must die; the caller does its last act, then calls :func:`die`."""
    if _armed is None or name not in _armed:
        return False
    with _lock:
        _armed[name] -= 1
        return _armed[name] == 0


def armed(name: str) -> bool:
    """Whether ``name`` is armed: code that must work to reach a point (a lookup only its
    crash test needs) asks this first, so unarmed it costs nothing."""
    return _armed is not None and name in _armed


def crashpoint(name: str) -> None:
    """Die here if this is the armed point's fatal arrival; otherwise nothing."""
    if _armed is not None and reached(name):
        die(name)


def die(name: str) -> NoReturn:
    message = f"kvfs: crash point {name!r} reached ({ENV}): dying now"
    try:
        log.warning("%s", message)
        os.write(sys.stderr.fileno(), (message + "\n").encode())
    except (OSError, ValueError):
        pass                    # stderr closed: the log record is what the test reads
    os._exit(EXIT_CODE)


# -- stall points: the calling thread (the event loop) blocks until the test lets it go --
# ``KVFS_TEST_STALL=name:DIR``: at the first arrival at stall point ``name`` the
# daemon creates DIR/stalled, then blocks the calling thread, on purpose, until
# DIR/release exists. tests/test_native_reads.py stalls the event loop in a
# checkpoint this way to show that the native read plane answers meanwhile, and
# a native READ (in C, kvfs/fuse/readplane.c: its reader thread, not the loop)
# to change a file under it.
STALL_ENV = "KVFS_TEST_STALL"
STALL_POINTS = {
    "checkpoint": "Durability.checkpoint: the event loop blocks before the checkpoint is cut "
                  "(a checkpoint that takes long)",
    "native_read": "the native read plane: the first READ it serves waits after its file's version "
                   "is found, before the device read (a READ in hand while the file changes)",
}
_stall: Optional[tuple[str, str]] = None


def arm_stall_from_environment() -> None:
    """Arm what $KVFS_TEST_STALL names; InvalidArgument for a bad value."""
    global _stall
    text = os.environ.get(STALL_ENV)
    if not text:
        _stall = None
        return
    name, sep, where = text.partition(":")
    if name not in STALL_POINTS or not sep or not os.path.isdir(where):
        raise InvalidArgument(f"{STALL_ENV}={text!r}: expected POINT:DIR with POINT one of "
                              f"{', '.join(sorted(STALL_POINTS))} and DIR an existing directory")
    _stall = (name, where)


def take_stall(name: str) -> Optional[str]:
    """DIR if ``name`` is the armed stall point, which the caller now owns (disarmed here)."""
    global _stall
    if _stall is None or _stall[0] != name:
        return None
    where = _stall[1]
    _stall = None
    return where


def stallpoint(name: str) -> None:
    """Block here, once, if ``name`` is the armed stall point (see STALL_ENV)."""
    global _stall
    if _stall is None or _stall[0] != name:
        return
    where = _stall[1]
    _stall = None
    log.warning("stall point %r reached (%s): blocking until %s/release exists", name, STALL_ENV, where)
    open(os.path.join(where, "stalled"), "w").close()
    while not os.path.exists(os.path.join(where, "release")):
        time.sleep(0.01)
