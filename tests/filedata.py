"""File contents for the mounted tests: deterministic bytes, and whole-file writes.

A support module (not a test file): test modules import these from here, never
from one another.
"""
import os
import random


def pattern(seed, size):
    """Deterministic incompressible bytes (fast enough for a GiB)."""
    return random.Random(seed).randbytes(size)


def write_file(path, data, *, fsync=False, dir_fd=None):
    """Create or truncate ``path`` and write all of ``data`` (as many write() calls as it
    takes); ``fsync`` makes it durable before the close."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            assert n > 0
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
