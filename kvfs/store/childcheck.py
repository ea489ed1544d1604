"""A mount's checkpoint checks, run in a forked child while the daemon builds from the rows.

A remount of a million files spent about 2 s of its 10 checking the
checkpoint's rows (each field's type and range, each file's block count, the
space map's extents) on the one core that then builds the namespace. The
checks are pure functions of the payload. So once the payload is read and its
checksum verified, a child is forked to run them over the same bytes (shared
copy-on-write), and the parent decodes the rows unchecked and builds the block
index and the namespace meanwhile. Nothing built is used before the verdict:
``Loaded.confirm_checked`` waits for it (kvfs/server/stack.py, at the end of replay,
and first when the build raised), and a refused checkpoint fails the mount
with the same message the in-process check gives.

Why a fork is safe here, though the MMP claim thread runs: the child only
decodes and checks (no device, no logging, no lock another thread may hold),
writes its verdict to a pipe and leaves with ``os._exit``. If it dies instead
(killed, out of memory), the checks run in the parent after all. Payloads
under ``MIN_PAYLOAD`` and single-CPU hosts are checked in process, as before:
there a fork gains nothing.
"""
from __future__ import annotations

import os
import signal
import warnings
from typing import Callable, Optional

from ..errors import FormatError

MIN_PAYLOAD = 4 << 20           # bytes: about 30,000 files; below it the checks take < 50 ms
_DONE = b"\x01"                 # first byte of a verdict: the child finished (what follows: refusal)


def start(check: Callable[[], None], payload_len: int) -> Optional[ChildCheck]:
    """A ChildCheck running ``check()`` (None, or raises FormatError) in a forked child;
    None when the checks should run in process (small payload, one CPU, no fork)."""
    if payload_len < MIN_PAYLOAD or len(os.sched_getaffinity(0)) < 2:
        return None
    rfd, wfd = os.pipe()
    try:
        with warnings.catch_warnings():         # 3.12+ warns of fork beside threads: see module doc
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(rfd)
        os.close(wfd)
        return None
    if pid == 0:                                 # the child: never returns
        try:
            # Only the verdict's pipe stays open: the device's copy (and its
            # lock's reference) must not outlive the parent's use of it.
            os.closerange(3, wfd)
            os.closerange(wfd + 1, os.sysconf("SC_OPEN_MAX"))
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _write_all(wfd, _DONE + _refusal(check).encode(errors="replace"))
        finally:
            os._exit(0)
    os.close(wfd)
    return ChildCheck(pid, rfd, check)


def _refusal(check):
    try:
        check()
    except FormatError as exc:
        return str(exc) or "the checkpoint is invalid"
    except Exception as exc:                    # noqa: BLE001 - a bug in a check: refuse, say what
        return f"the checkpoint check failed: {exc!r}"
    return ""


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class ChildCheck:
    """The child's verdict, once: :meth:`verdict` waits for it."""

    def __init__(self, pid: int, rfd: int, check: Callable[[], None]) -> None:
        self.pid: Optional[int] = pid
        self._rfd, self._check = rfd, check
        self.ran_in_child: Optional[bool] = None                # True / False once the verdict is in

    def verdict(self) -> str:
        """'' if the checkpoint passed, else the refusal's message (the checks run here if the child died)."""
        chunks = []
        try:
            while chunk := os.read(self._rfd, 65536):
                chunks.append(chunk)
        finally:
            os.close(self._rfd)
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:           # reaped elsewhere (SIGCHLD ignored): nothing to wait for
                pass
        self.pid = None
        reply = b"".join(chunks)
        check, self._check = self._check, None
        self.ran_in_child = reply[:1] == _DONE
        return reply[1:].decode(errors="replace") if self.ran_in_child else _refusal(check)

    def __del__(self):
        # Dropped without a verdict (a load that failed in a way no caller
        # waited through): end the child rather than leave it running.
        if self.pid is not None:
            for end in (lambda: os.close(self._rfd), lambda: os.kill(self.pid, signal.SIGKILL),
                        lambda: os.waitpid(self.pid, 0)):
                try:
                    end()
                except OSError:         # each step on its own: a child already gone still has its pipe closed
                    pass
