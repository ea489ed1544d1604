"""The GIL while worker threads run Python: the event loop must get it back quickly.

Why. A checkpoint builds, encodes and frees its rows in worker threads: seconds
of Python at a million files. CPython hands the GIL to a waiting thread only
once the holder has kept it for the switch interval (5 ms by default), and the
event loop needs the GIL several times for every FUSE request (to read the
request, run the handler, write the reply, wait in epoll), so each request
could wait 5 ms per step while a checkpoint ran: tools/kvfs-bench meta's probe
saw a p99 of 8 ms and a longest stat of 182 ms during a checkpoint of 200,000
files.

What. While such work runs (:func:`loop_first`), the switch interval is
LOOP_FIRST_INTERVAL; it goes back to what it was when the last such section
ends. The worker is then interrupted more often, but only while another thread
wants the GIL: an idle loop costs it nothing.
"""
from __future__ import annotations

import sys
from typing import ContextManager

from .nested import NestedSetting

LOOP_FIRST_INTERVAL = 0.0005     # seconds

_switch_interval = NestedSetting(sys.getswitchinterval, sys.setswitchinterval,
                                 lambda was: min(was, LOOP_FIRST_INTERVAL))


def loop_first() -> ContextManager[None]:
    """A lower switch interval inside (nests; any thread). See the module's doc."""
    return _switch_interval.held()
