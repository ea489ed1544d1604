"""Command-line tools. Each prints a one-line error and exits non-zero on bad input."""
import argparse
import functools
import logging
import os
import re
import sys

from ..errors import KvfsError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text):
    """'4G' -> 4294967296. Accepts K/M/G/T (binary) with an optional 'iB' or 'B'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use e.g. 512M, 4G, 1T)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line plus the usage hint."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def root_cause(exc):
    """The exception that really ended a command, with trio's exception groups unwrapped.

    A failure inside a nursery arrives as a (Base)ExceptionGroup, possibly nested;
    the user wants the error inside it. Cancellations caused by that error are
    skipped, so the first leaf that is not ``trio.Cancelled`` is returned.
    """
    while isinstance(exc, BaseExceptionGroup):
        leaves = list(exc.exceptions)
        real = [e for e in leaves if type(e).__name__ != "Cancelled"]
        exc = (real or leaves)[0]
    return exc


def describe(exc):
    """One line for ``exc`` (after :func:`root_cause`), for 'prog: <line>'."""
    exc = root_cause(exc)
    if isinstance(exc, KvfsError):
        return str(exc)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    text = " ".join(str(exc).split())
    return f"internal error: {type(exc).__name__}{': ' + text if text else ''}"


def tool(prog):
    """Decorate a CLI main run as ``prog``; every failure becomes one 'prog: message' line on stderr and exit 1.

    KvfsError and OSError are expected failures. Anything else is a bug, but it
    still gets one line (its traceback goes to the log, if logging is set up to a
    file); an ExceptionGroup is unwrapped to the error inside it first.
    """
    def wrap(fn):
        @functools.wraps(fn)
        def main(argv=None):
            try:
                return fn(sys.argv[1:] if argv is None else argv) or 0
            except SystemExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - the one place errors become messages
                cause = root_cause(exc)
                if isinstance(cause, KeyboardInterrupt):
                    return 130
                if isinstance(cause, BrokenPipeError):     # "| head" stopped reading: not an error
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                    return 141
                if isinstance(cause, SystemExit):
                    raise cause from None
                if not isinstance(cause, (KvfsError, OSError)):
                    _log_to_file(prog, exc)
                print(f"{prog}: {describe(cause)}", file=sys.stderr)
                return 1
        return main
    return wrap


def _log_to_file(prog, exc):
    """Keep the traceback of an unexpected error, but only where a log file is configured."""
    if any(isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers):
        logging.getLogger(prog).error("unexpected error", exc_info=exc)


def setup_logging(level=logging.INFO, path=None, tag="kvfs"):
    handler = logging.FileHandler(path) if path else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {tag} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
