"""The device layer's port: what the store, the layer above, may use of a device.

:class:`kvfs.device.Device` implements it (so does the test-only
:class:`kvfs.device.testfaults.FaultyDevice`, which wraps one). tests/test_ports.py
checks both directions: the Device has every member named here with the same
parameters, and the store layer uses no member of a device that is not named here.

The ``*_sync`` calls block: the store makes them in a device worker thread,
through :meth:`run`, or during a mount before the event loop starts.
"""
from typing import Any, Awaitable, Callable, Optional, Protocol, Sequence, Type

from ..base.aligned import Buffer, WritableBuffer
from ..errors import KvfsError


class DevicePort(Protocol):
    path: str
    size: int                   # bytes
    direct_io: bool             # opened with O_DIRECT
    fenced: Optional[str]       # why writes are refused, or None
    fence_error: Type[Exception]

    @property
    def timeout(self) -> Optional[float]: ...           # io_timeout, seconds

    def fence(self, reason: str, error: Type[Exception] = ...) -> None: ...
    def after_abandoned(self, callback: Callable[[], None]) -> None: ...
    def close(self) -> None: ...

    # Blocking calls, for a worker thread.
    def pread_sync(self, off: int, length: int) -> bytes: ...
    def read_block_sync(self, off: int, length: int, buf: Optional[WritableBuffer] = None) -> memoryview: ...
    def read_blocks_sync(self, off: int, lengths: Sequence[int],
                         bufs: Sequence[Optional[WritableBuffer]]) -> list[memoryview]: ...
    def pwrite_sync(self, off: int, data: Buffer, source: Optional[Buffer] = None) -> None: ...
    def sync_sync(self) -> None: ...
    def preallocate_sync(self, off: int, length: int) -> None: ...
    def discard_sync(self, off: int, length: int) -> None: ...

    # Async calls: a worker thread each, bounded by io_timeout.
    def run(self, fn: Callable[..., Any], *args: Any, on_abandon: Optional[Callable[[], None]] = None,
            writes: bool = True) -> Awaitable[Any]: ...
    def pwrite(self, off: int, data: Buffer, source: Optional[Buffer] = None) -> Awaitable[None]: ...
    def pwrite_each(self, writes: Sequence[tuple]) -> Awaitable[list[Optional[KvfsError]]]: ...   # (off, data, source)
