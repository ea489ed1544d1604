"""Errors raised by kvfs layers.

Every error is a :class:`KvfsError` subclass. Its errno is a property of the
class, never chosen at the raise site: ``NotFound("...")`` is ENOENT wherever it
is raised. Only ``fuseops`` turns these into ``pyfuse3.FUSEError``; the
command-line tools turn them into one-line messages. A bug is an
:class:`InternalError` (EIO, and logged), never disguised as a user error.
"""
import errno as _errno
import os


class KvfsError(Exception):
    """Base class: a readable message; ``errno`` comes from the class."""

    errno = _errno.EIO

    def __init__(self, message=""):
        super().__init__(message or os.strerror(self.errno))


# -- the store and the device ------------------------------------------------

class FormatError(KvfsError):
    """The device does not hold a valid kvfs (bad magic, checksum, bounds)."""

    errno = _errno.EUCLEAN


class CorruptBlock(KvfsError):
    """A block read from the device does not match its content key."""


class DedupCollision(KvfsError):
    """A dedup hit whose stored bytes differ from the new ones (dedup_verify=bytes): EIO."""


class DeviceError(KvfsError):
    """The device failed an I/O request or returned a short transfer."""


class DeviceTimeout(DeviceError):
    """The device did not answer a call within ``io_timeout`` seconds: EIO for the caller.
    The call's worker thread runs on until the device answers (kvfs/device/calls.py)."""


class DeviceFull(DeviceError):
    """The host filesystem under a store file has no room left (ENOSPC below kvfs)."""

    errno = _errno.ENOSPC


class Fenced(KvfsError):
    """Multi-mount protection stopped all writes: another host took the store over, or the
    heartbeat could not be written. Reads still work; every write is refused (EROFS)."""

    errno = _errno.EROFS


class DeviceFailed(Fenced):
    """Writes are stopped because a journal or checkpoint write went unanswered (io_timeout):
    it may still land, so nothing may be written after it. Reads still work; writes get EIO."""

    errno = _errno.EIO


class InternalError(KvfsError):
    """A bug in kvfs (a broken invariant). Reported as EIO and logged, never as ENOSPC."""


class NoSpace(KvfsError):
    errno = _errno.ENOSPC


class SpaceAwaitsCommit(NoSpace):
    """Not enough space now, but frees wait for a journal commit: commit, then retry."""


class JournalFull(KvfsError):
    """The journal has no room for the pending records: a checkpoint must fold it first."""

    errno = _errno.ENOSPC


# -- POSIX refusals ------------------------------------------------------------

class FsError(KvfsError):
    """A POSIX-level refusal; each subclass is one errno."""


class NotFound(FsError):
    errno = _errno.ENOENT


class Stale(FsError):
    """The kernel's cached name leads to an inode that is gone (evicted): ESTALE makes the
    kernel look the name up again, so open(O_CREAT) creates a new file instead of failing."""

    errno = _errno.ESTALE


class Exists(FsError):
    errno = _errno.EEXIST


class NotEmpty(FsError):
    errno = _errno.ENOTEMPTY


class NotADirectory(FsError):
    errno = _errno.ENOTDIR


class IsADirectory(FsError):
    errno = _errno.EISDIR


class InvalidArgument(FsError):
    errno = _errno.EINVAL


class NameTooLong(FsError):
    errno = _errno.ENAMETOOLONG


class ReadOnly(FsError):
    errno = _errno.EROFS


class AccessDenied(FsError):
    errno = _errno.EACCES


class NotPermitted(FsError):
    errno = _errno.EPERM


class BadDescriptor(FsError):
    errno = _errno.EBADF


class NotSupported(FsError):
    errno = _errno.EOPNOTSUPP


class Busy(FsError):
    errno = _errno.EBUSY


class NotADevice(FsError):
    errno = _errno.ENODEV


class TimedOut(FsError):
    errno = _errno.ETIMEDOUT


class NoData(FsError):
    errno = _errno.ENODATA


_BY_ERRNO = {cls.errno: cls for cls in (NotFound, Exists, NotEmpty, NotADirectory, IsADirectory,
                                        InvalidArgument, NameTooLong, ReadOnly, AccessDenied,
                                        NotPermitted, BadDescriptor, NotSupported, Busy, NotADevice,
                                        TimedOut)}


def device_error(exc, message):
    """The kvfs error for an OSError from a device syscall: DeviceFull for ENOSPC, else DeviceError."""
    if exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
        return DeviceFull(message)
    return DeviceError(message)


def os_error(exc, message):
    """The kvfs error for an OSError outside data transfers (opening a path, ...)."""
    return _BY_ERRNO.get(exc.errno, DeviceError)(message)
