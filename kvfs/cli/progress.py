"""Progress of long work on a terminal: done/total, a rate and an estimate of the time left.

Shown only when stderr is a terminal, at most every half second, on one line
that is redrawn in place and cleared at the end; a pipe or a log file never sees it.
"""
import sys
import threading
import time

INTERVAL = 0.5


def _units(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def line(what, done, total, seconds, *, in_bytes=True):
    """'verifying blocks: 1.5 GiB of 4.0 GiB (37%), 512.0 MiB/s, 5 s left'."""
    show = _units if in_bytes else (lambda n: f"{n:.0f}")
    rate = done / seconds if seconds > 0 else 0.0
    text = f"{what}: {show(done)}"
    if total:
        text += f" of {show(total)} ({100 * done / total:.0f}%)"
    text += f", {show(rate)}{'/s' if in_bytes else ' per s'}"
    if total and rate > 0 and done < total:
        text += f", {int((total - done) / rate) + 1} s left"
    return text


class Progress:
    """``update(done, total)`` as work goes; ``close()`` at the end. Silent unless ``out`` is a tty."""

    def __init__(self, what, *, in_bytes=True, out=None, force=False):
        self.what, self.in_bytes = what, in_bytes
        self.out = out or sys.stderr
        self.enabled = force or (hasattr(self.out, "isatty") and self.out.isatty())
        self.started = time.monotonic()
        self._shown = 0.0
        self.lines = []                      # what was shown (tests read it)

    def update(self, done, total=None):
        now = time.monotonic()
        if not self.enabled or now - self._shown < INTERVAL:
            return
        self._shown = now
        text = line(self.what, done, total, now - self.started, in_bytes=self.in_bytes)
        self.lines.append(text)
        self.out.write("\r\033[K" + text)
        self.out.flush()

    def close(self):
        if self.enabled and self.lines:
            self.out.write("\r\033[K")
            self.out.flush()


def while_running(what, poll, *, total=None, in_bytes=True):
    """A context manager: while its body runs (a blocking control command), show ``poll()``
    (work done so far) as progress from a helper thread; ``total`` may be a number or None."""
    return _Poller(Progress(what, in_bytes=in_bytes), poll, total)


class _Poller:
    def __init__(self, progress, poll, total):
        self.progress, self.poll, self.total = progress, poll, total
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.wait(INTERVAL):
            try:
                self.progress.update(self.poll(), self.total)
            except Exception:           # noqa: BLE001 - progress is cosmetic; the command reports errors
                return

    def __enter__(self):
        if self.progress.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self.progress

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self.progress.close()
