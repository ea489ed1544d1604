"""Bounded device calls: a blocking device call runs in a worker thread, and its caller
waits for it at most ``io_timeout`` seconds.

A call the device does not answer in time is *abandoned*: trio stops waiting for the
thread (``abandon_on_cancel``) and the caller gets :class:`~kvfs.errors.DeviceTimeout`
(EIO). The thread itself cannot be stopped: it stays in its system call until the
device answers (a hung NVMe path, a stall), and finishes then. What the late call
does must harm nobody, so:

- A late *read* fills a buffer its caller has dropped: the block cache recycles only
  the buffers of reads that returned, so nobody ever sees those bytes.
- A late *write* (or discard) must not land on an extent that was handed out again
  meanwhile: the store gives extents back through :meth:`CallTracker.after_abandoned`,
  which waits until every writing call abandoned so far has really finished.
- A late *metadata write* (journal frame, checkpoint) must not be overtaken by a later
  one: the store passes ``on_abandon`` and stops accepting writes when it fires.

A cancellation of the caller (an unmount, a cancelled nursery) does not abandon the
call: it waits for the call to finish, as it always did, but at most ``io_timeout``.
Only the time bound leaves threads running.

The bound is measured on trio's clock, the system's monotonic clock in the daemon.
Under a virtual clock (trio.testing.MockClock with autojump, in tests) it would fire
whenever every task waits for a device thread: such tests open the device with no bound.

The worker thread keeps its limiter token until it finishes (trio releases it only
then), so a hung device holds at most ``io_threads`` threads; later calls wait for a
token inside their own time bound and time out too.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import trio

from ..errors import DeviceError, DeviceTimeout, KvfsError

log = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_QUEUED, _RUNNING, _SKIP, _LATE, _DONE = range(5)


class _Call:
    __slots__ = ("fn", "args", "writes", "state", "result", "error")

    def __init__(self, fn, args, writes):
        self.fn, self.args, self.writes = fn, args, writes
        self.state = _QUEUED
        self.result = self.error = None


class CallTracker:
    """Runs device calls in worker threads with a time bound; tracks the abandoned ones."""

    def __init__(self, limiter: trio.CapacityLimiter, timeout: Optional[float], name: str = "device") -> None:
        self.limiter = limiter
        self.timeout = timeout          # seconds; None: no bound (offline tools)
        self.name = name
        self._lock = threading.Lock()
        self._late: set[_Call] = set()  # abandoned calls whose threads still run
        self._waiters: list[list] = []  # [set of late calls, callback]: run once the set is empty
        self.timeouts = 0

    async def run(self, fn: Callable[..., T], *args: Any, on_abandon: Optional[Callable[[], None]] = None,
                  writes: bool = True) -> T:
        """``fn(*args)`` in a worker thread; DeviceTimeout after ``timeout`` seconds.

        ``on_abandon()`` is called (on the event loop) when the call was started and is
        left running after the time ran out. ``writes=False`` says the call only reads:
        nobody needs to wait for it once it is abandoned.
        """
        call = _Call(fn, args, writes)
        token = trio.lowlevel.current_trio_token()
        try:
            # Shielded: a cancellation of the caller waits for the call (it may be a
            # write), as a plain to_thread call would, but never past the time bound.
            with trio.CancelScope(shield=True), \
                    trio.move_on_after(self.timeout if self.timeout is not None else float("inf")):
                return await trio.to_thread.run_sync(self._work, call, token, limiter=self.limiter,
                                                     abandon_on_cancel=True)
        except BaseException:           # the call failed (or a KeyboardInterrupt came)
            if self._abandon(call) == _RUNNING and on_abandon is not None:
                on_abandon()
            raise
        was = self._abandon(call)
        if was == _DONE:                # it finished just as the time ran out: its outcome stands
            if call.error is not None:
                raise call.error
            return call.result
        self.timeouts += 1
        # Not started at all (every worker thread is held by calls the device has not
        # answered) is a timeout too, but nothing is left running.
        log.error("%s: %s did not return within %g s (io_timeout): EIO for its caller%s", self.name,
                  getattr(fn, "__name__", "a device call"), self.timeout,
                  "; the call is left running until the device answers" if was == _RUNNING else
                  " (it never started: the device's worker threads are all waiting for it)")
        if was == _RUNNING and on_abandon is not None:
            on_abandon()
        raise DeviceTimeout(f"{self.name}: the device did not answer within {self.timeout:g} s (io_timeout)")

    def _work(self, call, token):
        with self._lock:
            if call.state == _SKIP:
                return None             # abandoned before it started: it never touches the device
            call.state = _RUNNING
        try:
            call.result = call.fn(*call.args)
            return call.result
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            with self._lock:
                late, call.state = call.state == _LATE, _DONE
            if late:
                self._finished_late(call, token)

    def _abandon(self, call):
        """Mark a call nobody waits for any more; returns its state until then: _QUEUED (it will
        never run), _RUNNING (its thread runs on: a late call) or _DONE."""
        with self._lock:
            was = call.state
            if was == _QUEUED:
                call.state = _SKIP
            elif was == _RUNNING:
                call.state = _LATE
                self._late.add(call)
            return was

    def _finished_late(self, call, token):
        """In the late call's thread: it has finished; run the callbacks that waited for it."""
        ready = []
        with self._lock:
            self._late.discard(call)
            for waiter in self._waiters:
                waiter[0].discard(call)
                if not waiter[0]:
                    ready.append(waiter[1])
            self._waiters = [w for w in self._waiters if w[0]]
        log.warning("%s: an abandoned %s has finished", self.name, getattr(call.fn, "__name__", "call"))
        for callback in ready:
            with contextlib.suppress(trio.RunFinishedError):       # the daemon is gone: nothing to free
                token.run_sync_soon(callback)

    def after_abandoned(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` (on the event loop) once every writing call abandoned so far has
        finished: at once when none is left running."""
        with self._lock:
            writing = {call for call in self._late if call.writes}
            if writing:
                self._waiters.append([writing, callback])
                return
        callback()

    def late_calls(self) -> int:
        """Abandoned calls whose threads are still running."""
        with self._lock:
            return len(self._late)


def counts_errors(kind: str) -> Callable[[F], F]:
    """Count the calls of a Device method that end in a device error (after its retries)
    in the device's ``_errors[kind]``."""
    def wrap(method):
        @functools.wraps(method)
        def counted(device, *args, **kw):
            try:
                return method(device, *args, **kw)
            except DeviceError:
                with device._lock:
                    device._errors[kind] += 1
                raise
        return counted
    return wrap


def asked(views: memoryview | Sequence[memoryview]) -> int:
    """Bytes a transfer's system call was asked to move: one view, or a list of them."""
    return len(views) if isinstance(views, memoryview) else sum(map(len, views))


def each_outcome(fn: Callable[..., Any], calls: Iterable[Sequence[Any]]) -> list[Optional[KvfsError]]:
    """``fn(*args)`` for each ``args`` of ``calls``, in the calling (worker) thread: per call
    None, or the KvfsError it raised. One failed call fails alone: the others still run."""
    outcomes: list[Optional[KvfsError]] = []
    for args in calls:
        try:
            fn(*args)
            outcomes.append(None)
        except KvfsError as exc:
            outcomes.append(exc)
    return outcomes
