"""Command-line tools. Each prints a one-line error and exits non-zero on bad input."""
import argparse
import functools
import logging
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


def tool(fn):
    """Run a CLI main; KvfsError/OSError become 'prog: message' and exit 1."""
    @functools.wraps(fn)
    def main(argv=None):
        prog = fn.__module__.rsplit(".", 1)[-1]
        prog = {"mkfs": "mkfs.kvfs", "mount": "mount.kvfs", "fsck": "fsck.kvfs", "admin": "kvfs-admin"}.get(prog, prog)
        try:
            return fn(sys.argv[1:] if argv is None else argv) or 0
        except KvfsError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"{prog}: {where}{exc.strerror or exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return main


def setup_logging(level=logging.INFO, path=None, tag="kvfs"):
    handler = logging.FileHandler(path) if path else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {tag} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
