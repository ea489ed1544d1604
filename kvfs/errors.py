"""Errors raised by kvfs layers.

Every layer raises a :class:`KvfsError` subclass carrying an errno. Only
``fuseops`` turns these into ``pyfuse3.FUSEError``; the command-line tools turn
them into one-line messages. Nothing else catches them.
"""
import errno as _errno


class KvfsError(Exception):
    """Base class: an error with a precise errno and a readable message."""

    errno = _errno.EIO

    def __init__(self, message, errno=None):
        super().__init__(message)
        if errno is not None:
            self.errno = errno


class FormatError(KvfsError):
    """The device does not hold a valid kvfs (bad magic, checksum, bounds)."""

    errno = _errno.EUCLEAN


class CorruptBlock(KvfsError):
    """A block read from the device does not match its content key."""

    errno = _errno.EIO


class DeviceError(KvfsError):
    """The device failed an I/O request or returned a short transfer."""

    errno = _errno.EIO


class NoSpace(KvfsError):
    errno = _errno.ENOSPC


class FsError(KvfsError):
    """A POSIX-level refusal (ENOENT, EEXIST, ENOTEMPTY, ...)."""

    def __init__(self, errno, message=""):
        super().__init__(message or _errno.errorcode.get(errno, str(errno)), errno)
