"""A process-wide setting changed while any of several sections, in any thread, is inside.

The daemon changes two settings this way: the cyclic collector is off while
a checkpoint or a load runs (kvfs/base/gcpolicy.py, ``collections_paused``) and
the switch interval is short while worker threads run Python next to the
event loop (kvfs/base/gilpolicy.py, ``loop_first``). Sections nest and overlap
across threads, so the first one to enter saves the setting and changes it,
the others only count, and the last one to leave restores what was saved.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator


class NestedSetting:
    """``read()`` the setting, ``write(value)`` it; ``inside(saved)`` is its value inside."""

    def __init__(self, read: Callable[[], Any], write: Callable[[Any], Any],
                 inside: Callable[[Any], Any]) -> None:
        self._read, self._write, self._inside = read, write, inside
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: Any = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = self._read()
                self._write(self._inside(self._saved))
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._write(self._saved)
